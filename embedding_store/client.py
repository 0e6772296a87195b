"""``StoreClient``: one interface to the store, whether its shards are in this process or remote.

The transport is chosen by the address (as in distributed's comm registry):

- ``inproc://`` or ``inproc://N``: N shards in this process (tests, one-process runs);
- ``grpc://host:port[,host:port...]``: shard processes, in shard-index order.

An id belongs to shard ``jump_hash(remix(id), num_shards)``. Each call sends one
request per shard, to all shards in parallel, and puts the answers back in the
caller's order. Calls that failed with UNAVAILABLE or DEADLINE_EXCEEDED are
retried with exponential backoff; pushes carry a request id, so a retry after a
lost reply is never applied twice.

>>> import numpy as np
>>> from embedding_store.types import StoreConfig
>>> cfg = StoreConfig(tables={"user": {"dim": 4}}, row_dtype="float32")
>>> with StoreClient.connect("inproc://2", config=cfg) as store:
...     ids = np.arange(100, dtype=np.uint64)
...     rows = store.lookup({"user": ids})["user"]
...     again = store.lookup({"user": ids}, train=False)["user"]
...     print(rows.shape, rows.dtype, bool((rows == again).all()), store.num_shards)
(100, 4) float32 True 2
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from embedding_store.errors import InvalidRequest, StoreError, UnknownTable
from embedding_store.hashing import group_by_shard
from embedding_store.shard import StoreShard
from embedding_store.transport.base import (
    U64,
    RetryPolicy,
    Rows,
    ShardTransport,
    T,
    Wait,
    id_array,
)
from embedding_store.transport.grpc import GrpcTransport
from embedding_store.transport.inproc import InprocTransport
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    PushedRows,
    PushOrigin,
    PushResult,
    RestoreResult,
    RowDtype,
    ShardRows,
    ShardStats,
    StoreConfig,
    TableConfig,
)

# Ids of one table routed to shards: the ids, their order by shard, each shard's bounds.
_Routed = tuple[U64, npt.NDArray[np.int64], npt.NDArray[np.int64]]


class StoreClient:
    """Routes ids to shards and fans calls out to all of them in parallel."""

    def __init__(
        self,
        transports: Sequence[ShardTransport],
        *,
        row_dtype: RowDtype | None = None,
        grad_dtype: RowDtype = "float32",
        pool: ThreadPoolExecutor | None = None,
        latency_s: float = 0.0,
    ) -> None:
        if not transports:
            msg = "a StoreClient needs at least one shard"
            raise ValueError(msg)
        self._transports = list(transports)
        self._pool = pool
        self.dims, store_dtype = self._transports[0].describe()
        for t in self._transports[1:]:
            dims, _ = t.describe()
            if dims != self.dims:
                msg = f"shard {t.address} serves tables {dims}, shard 0 serves {self.dims}"
                raise StoreError(msg)
        self.row_dtype: RowDtype = row_dtype or store_dtype
        self.grad_dtype: RowDtype = grad_dtype
        self._client_id = uuid.uuid4().hex
        self._push_seq = itertools.count()
        # A benchmarking aid: seconds added to every call (a slower network's round
        # trip, e.g. 0.002 for a cross-rack one); the sleep happens before the
        # requests go out, so the call takes this much longer whatever the shards do.
        self.latency_s = float(latency_s)

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        config: StoreConfig | None = None,
        token: str | None = None,
        row_dtype: RowDtype | None = None,
        grad_dtype: RowDtype = "float32",
        retry: RetryPolicy | None = None,
        max_message_bytes: int | None = None,
        latency_s: float = 0.0,
        shared_memory: bool = True,
    ) -> StoreClient:
        """A client for ``inproc://[N]`` (needs ``config``) or ``grpc://h:p[,h:p...]``.

        Rows come back in ``row_dtype``, by default the store's configured one.
        ``latency_s`` (a benchmarking aid) is added to every call. With
        ``shared_memory`` the rows, ids and gradients of a shard on this host pass
        through shared memory instead of the socket (found out, and fallen back
        from, by itself); False keeps every byte on the network.
        """
        if address.startswith("inproc://"):
            if config is None:
                msg = f"{address}: an in-process store needs its StoreConfig (config=...)"
                raise ValueError(msg)
            rest = address.removeprefix("inproc://")
            if rest and not rest.isdigit():
                msg = f"{address}: expected inproc:// or inproc://N with N shards"
                raise ValueError(msg)
            shards = [StoreShard(config) for _ in range(int(rest or 1))]
            return cls.from_shards(
                shards, row_dtype=row_dtype, grad_dtype=grad_dtype, latency_s=latency_s
            )
        if address.startswith("grpc://"):
            hosts = [h.strip() for h in address.removeprefix("grpc://").split(",") if h.strip()]
            if not hosts:
                msg = f"{address}: expected grpc://host:port[,host:port...]"
                raise ValueError(msg)
            limit = max_message_bytes or (config.max_message_bytes if config else 64 << 20)
            transports = [
                GrpcTransport(
                    h,
                    token=token,
                    max_message_bytes=limit,
                    retry=retry or RetryPolicy(),
                    shared_memory=shared_memory,
                )
                for h in hosts
            ]
            try:
                return cls(
                    transports, row_dtype=row_dtype, grad_dtype=grad_dtype, latency_s=latency_s
                )
            except BaseException:
                for t in transports:
                    t.close()
                raise
        msg = f"unknown store address {address!r}: use inproc://[N] or grpc://host:port[,...]"
        raise ValueError(msg)

    @classmethod
    def from_shards(
        cls,
        shards: Sequence[StoreShard],
        *,
        row_dtype: RowDtype | None = None,
        grad_dtype: RowDtype = "float32",
        latency_s: float = 0.0,
        current_at: Sequence[Callable[[], float]] | None = None,
        parallel: bool = True,
    ) -> StoreClient:
        """A client over shard objects of this process; ``current_at``: per shard, when
        its rows were last current (serving replicas; default: now). ``parallel``: the
        shards' parts of a call run on threads at once; False: one after the other on
        the caller's thread (cheaper for the few rows of a prediction request)."""
        pool = (
            ThreadPoolExecutor(len(shards), thread_name_prefix="inproc-store")
            if len(shards) > 1 and parallel
            else None
        )
        clocks = list(current_at) if current_at is not None else [None] * len(shards)
        transports = [
            InprocTransport(s, pool, f"inproc://shard-{i}", clock)
            for i, (s, clock) in enumerate(zip(shards, clocks, strict=True))
        ]
        return cls(
            transports, row_dtype=row_dtype, grad_dtype=grad_dtype, pool=pool, latency_s=latency_s
        )

    @property
    def num_shards(self) -> int:
        return len(self._transports)

    @property
    def addresses(self) -> list[str]:
        """Each shard's address, in shard order (``host:port``, or ``inproc://shard-N``)."""
        return [t.address for t in self._transports]

    @property
    def table_configs(self) -> dict[str, TableConfig] | None:
        """The tables' configs where this client holds its shards (``inproc://``), else
        None: a remote shard's config is the job's ``store:`` section, not sent.
        """
        configs = [
            t.shard.config.tables for t in self._transports if isinstance(t, InprocTransport)
        ]
        return dict(configs[0]) if len(configs) == len(self._transports) and configs else None

    def _delay(self) -> None:
        """The added latency of one call (``latency_s``, a benchmarking aid)."""
        if self.latency_s > 0.0:
            time.sleep(self.latency_s)

    def _check_table(self, name: str) -> int:
        try:
            return self.dims[name]
        except KeyError:
            msg = f"table {name!r} is not served by this store (tables: {sorted(self.dims)})"
            raise UnknownTable(msg) from None

    def _route_tables(self, ids: Mapping[str, npt.ArrayLike]) -> dict[str, _Routed]:
        routed = {}
        for name, table_ids in ids.items():
            self._check_table(name)
            routed[name] = self._route(table_ids, f"ids[{name}]")
        return routed

    def _part(self, routed: Mapping[str, _Routed], s: int) -> dict[str, U64]:
        """Shard ``s``'s ids of each routed table."""
        if self.num_shards == 1:
            return {name: arr for name, (arr, _, _) in routed.items()}
        return {
            name: arr[order[bounds[s] : bounds[s + 1]]]
            for name, (arr, order, bounds) in routed.items()
        }

    def _route(
        self, ids: npt.ArrayLike, field: str
    ) -> tuple[U64, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        arr = id_array(ids, field)
        if self.num_shards == 1:
            return arr, np.arange(arr.shape[0], dtype=np.int64), np.array([0, arr.shape[0]])
        order, bounds = group_by_shard(arr, self.num_shards)
        return arr, order, bounds

    def lookup(
        self,
        ids: Mapping[str, npt.ArrayLike],
        *,
        train: bool = True,
        step: int | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Rows]:
        """Rows (``row_dtype``, shape ``[n, dim]``) for the ids of each table, in order.

        ``timeout_s``: every shard's call, retries included, ends within it, else
        ``StoreUnavailable`` (a prediction server's request deadline); None: the
        client's retry policy."""
        routed = self._route_tables(ids)
        self._delay()
        # Shard 0's call is made by its wait, the first, on this thread (see ShardTransport).
        waits = [
            transport.start_lookup(
                self._part(routed, s),
                train,
                step,
                self.row_dtype,
                deferred=s == 0,
                timeout_s=timeout_s,
            )
            for s, transport in enumerate(self._transports)
        ]
        out = {
            name: np.empty((arr.shape[0], self.dims[name]), dtype=self.row_dtype)
            for name, (arr, _, _) in routed.items()
        }
        for s, wait in enumerate(waits):
            for name, rows in wait().items():
                _, order, bounds = routed[name]
                if self.num_shards == 1:
                    # Replies decode as read-only views of the message; callers
                    # (torch.from_numpy) expect arrays they own.
                    out[name] = rows if rows.flags.writeable else rows.copy()
                else:
                    out[name][order[bounds[s] : bounds[s + 1]]] = rows
        return out

    def create_rows(self, ids: Mapping[str, npt.ArrayLike], *, step: int | None = None) -> None:
        """Create the rows of ``ids`` (a bulk load) without reading them back.

        Rows start where a training lookup would start them (deterministic from
        the id), through the tables' admission, eviction and capacity; only the
        reply's rows are skipped, so a load of many ids costs ids on the wire.
        Split very large loads into calls of about a million ids.
        """
        routed = self._route_tables(ids)
        waits = [
            transport.start_lookup(
                self._part(routed, s), True, step, self.row_dtype, create_only=True, deferred=s == 0
            )
            for s, transport in enumerate(self._transports)
        ]
        for wait in waits:
            wait()

    def push(
        self,
        grads: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]],
        *,
        request_id: str | None = None,
        return_rows: bool = False,
    ) -> PushResult:
        """Apply row gradients (``[n, dim]`` per table); safe to retry with the same id.

        ``return_rows``: the result's ``rows`` holds each table's pushed rows as the
        store holds them after the push, with their optimizer state (float32, in
        the order of the ids): what a lookup right after it would read, without
        another round trip.

        >>> from embedding_store.types import StoreConfig
        >>> store = StoreClient.connect("inproc://2", config=StoreConfig(
        ...     tables={"t": {"dim": 2, "optimizer": {"kind": "sgd", "lr": 0.5}}}))
        >>> ids = np.array([4, 9], dtype=np.uint64)
        >>> before = store.lookup({"t": ids})["t"]
        >>> result = store.push({"t": (ids, np.ones((2, 2)))}, return_rows=True)
        >>> after = result.rows["t"]
        >>> bool(np.allclose(after.weights, before - 0.5, atol=1e-3)), after.row_step.tolist()
        (True, [1, 1])
        >>> now = store.lookup({"t": ids}, train=False)["t"]
        >>> bool((after.weights.astype(store.row_dtype) == now).all())
        True
        """
        rid = request_id or f"{self._client_id}-{next(self._push_seq)}"
        routed = {}
        for name, (table_ids, g) in grads.items():
            dim = self._check_table(name)
            arr, order, bounds = self._route(table_ids, f"grads[{name}].ids")
            g_arr = np.asarray(g)
            if g_arr.shape != (arr.shape[0], dim):
                msg = f"grads[{name}]: shape {g_arr.shape}, expected ({arr.shape[0]}, {dim})"
                raise InvalidRequest(msg)
            routed[name] = (arr, g_arr, order, bounds)
        self._delay()
        waits: list[tuple[int, Wait[PushResult]]] = []
        sent: list[dict[str, U64]] = []
        for s, transport in enumerate(self._transports):
            part = {}
            for name, (arr, g_arr, order, bounds) in routed.items():
                if self.num_shards == 1:
                    part[name] = (arr, g_arr)
                    continue
                sel = order[bounds[s] : bounds[s + 1]]
                if sel.shape[0]:
                    part[name] = (arr[sel], g_arr[sel])
            sent.append({name: ids for name, (ids, _) in part.items()})
            if part:
                wait = transport.start_push(
                    part, rid, self.grad_dtype, return_rows=return_rows, deferred=not waits
                )
                waits.append((s, wait))
        total = PushResult()
        parts: list[ShardRows] = []
        for s, wait in waits:
            result = wait()
            total = total + result
            if result.rows is None:
                continue
            where = None
            if self.num_shards > 1:
                where = {}
                for name in result.rows:
                    _, _, order, bounds = routed[name]
                    where[name] = order[bounds[s] : bounds[s + 1]]
            parts.append(ShardRows(sent[s], where, result.rows, result.seen))
        if not (return_rows and len(parts) == len(waits)):
            return total  # a shard left its rows out (too large to send): none
        return replace(total, rows=PushedRows(parts))

    def read_pushed(
        self, ids: Mapping[str, npt.ArrayLike], *, origin: PushOrigin
    ) -> PushedRows | None:
        """The rows of ``ids`` as the store holds them now, with their optimizer state,
        and per shard which pushes of each rank of ``origin``'s group they include
        (``ShardRows.seen``); ``origin`` must be a read (``PushOrigin(..., read=True)``).
        Nothing is applied. None if a shard left its rows out (too large to send).

        >>> from embedding_store.types import StoreConfig
        >>> store = StoreClient.connect("inproc://1", config=StoreConfig(tables={"t": {"dim": 2}}))
        >>> ids = np.array([4, 9], dtype=np.uint64)
        >>> _ = store.lookup({"t": ids})
        >>> _ = store.push({"t": (ids, np.ones((2, 2)))}, request_id="job@0/2:3")
        >>> rows = store.read_pushed({"t": ids}, origin=PushOrigin("job", 1, 2, 0, read=True))
        >>> rows["t"].row_step.tolist(), rows.parts[0].seen
        ([1, 1], (3, 0))
        """
        if not origin.read:
            msg = f"read_pushed: origin {origin.request_id!r} is not a read"
            raise InvalidRequest(msg)
        zeros = {
            name: (rows, np.zeros((np.shape(rows)[0], self._check_table(name)), np.float32))
            for name, rows in ids.items()
        }
        rows = self.push(zeros, request_id=origin.request_id, return_rows=True).rows
        return rows if isinstance(rows, PushedRows) else None

    def _each(self, fn: Callable[[int, ShardTransport], T]) -> list[T]:
        self._delay()
        with ThreadPoolExecutor(self.num_shards) as pool:
            return list(pool.map(fn, range(self.num_shards), self._transports))

    def checkpoint(
        self,
        directory: Path | str | None = None,
        kind: CheckpointKind = "auto",
        *,
        metadata: dict[str, Any] | None = None,
    ) -> list[CheckpointResult]:
        """Every shard checkpoints, in parallel, into ``directory/shard-NNN``.

        With ``directory=None`` each shard writes into its own data dir instead.
        """

        def one(i: int, t: ShardTransport) -> CheckpointResult:
            target = "" if directory is None else str(Path(directory) / f"shard-{i:03d}")
            return t.checkpoint(target, kind, metadata or {})

        return self._each(one)

    def restore(
        self,
        directory: Path | str | None = None,
        *,
        upto_seq: int | Sequence[int] | None = None,
    ) -> list[RestoreResult]:
        """Every shard loads the ids it owns from a checkpoint of any number of shards.

        With ``directory=None`` each shard restores its own data dir, and
        ``upto_seq`` may give each shard its own checkpoint (one seq per shard).
        """
        if not isinstance(upto_seq, int) and upto_seq is not None:
            seqs = list(upto_seq)
            if directory is not None or len(seqs) != self.num_shards:
                msg = (
                    f"upto_seq: one seq per shard ({self.num_shards}) restores each shard's "
                    f"own data dir (directory=None); got {len(seqs)} seqs and {directory=}"
                )
                raise InvalidRequest(msg)
            return self._each(lambda i, t: t.restore("", 0, 1, seqs[i]))
        if directory is None:
            return self._each(lambda i, t: t.restore("", 0, 1, upto_seq))
        return self._each(lambda i, t: t.restore(str(directory), i, self.num_shards, upto_seq))

    def stats(self) -> list[ShardStats]:
        """Counters of every shard, in shard order."""
        return self._each(lambda i, t: t.stats())

    def accept_restarts(self) -> None:
        """Train against the shards' current processes from now on.

        A push or checkpoint answered by another process of a shard than the one
        this client knew raises :class:`ShardRestarted`; a job that rolled the
        store back to a checkpoint calls this on every rank before it goes on
        (``restore`` does it for the caller's own client).
        """
        self._each(lambda i, t: t.accept_restart())

    def current_at(self) -> float:
        """The oldest of the shards' ``current_at``: every row read now is at least as
        fresh as the training shards were then (a client over serving replicas)."""
        return min(t.current_at() for t in self._transports)

    def close(self) -> None:
        """Close the channels (the shards themselves keep running)."""
        for t in self._transports:
            t.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
