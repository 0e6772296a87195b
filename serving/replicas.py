"""Serving replicas inside the prediction server: rows read in place, no network.

``streamrec store replica`` runs a replica as a process of its own, which many
servers share over gRPC. A server that follows the training shards itself
(``streamrec serve --follow``) holds one read-only shard per training shard,
each kept current by a :class:`~embedding_store.replica.ShardFollower` on a
thread, and reads its rows from memory: a lookup is a hash probe instead of
a round trip. Each server then holds a whole copy of the tables, so this
suits tables that fit in a server's memory (a tiered table's copy is tiered
too, its disk tier in a temporary folder); the training shards' load grows
with every server that follows them (one Changes call per shard per poll).

Until a replica has its first copy its lookups are refused
(``StoreUnavailable``: the server answers 503), as a replica process's are.

>>> import numpy as np
>>> from embedding_store.shard import StoreShard
>>> from embedding_store.types import StoreConfig
>>> config = StoreConfig(tables={"item": {"dim": 2}})
>>> training = StoreShard(config)
>>> _ = training.lookup({"item": np.array([3], np.uint64)})
>>> replicas = LocalReplicas(config, [training], poll_s=0.05)
>>> replicas.wait_caught_up(timeout_s=10)
True
>>> served = replicas.rows.lookup({"item": np.array([3], np.uint64)}, train=False)["item"]
>>> now = training.lookup({"item": np.array([3], np.uint64)})["item"]
>>> bool((served == now.astype(served.dtype)).all())  # rows travel in the store's row_dtype
True
>>> replicas.close()
"""

from __future__ import annotations

import operator
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from embedding_store.errors import InvalidRequest, StoreUnavailable
from embedding_store.follow import FOLLOW_POLL_S
from embedding_store.hashing import shard_of
from embedding_store.replica import ChangeSource, ShardFollower
from embedding_store.shard import StoreShard
from embedding_store.table import EmbeddingTable
from embedding_store.table_group import TableGroup
from embedding_store.transport.base import RetryPolicy, id_array
from embedding_store.transport.grpc import GrpcTransport
from embedding_store.types import RowDtype, StoreConfig
from trainer.joined_fields import widened

_Tables = Mapping[str, EmbeddingTable]


class ReplicaRows:
    """Reads rows from replicas of this process in place, each id from the shard that
    owns it (the store's routing), in the store's ``row_dtype`` as a replica process
    sends them: a ``RowReader`` with the ``current_at`` of a ``StoreClient``.

    A request's ids are few: a client's machinery (a transport per shard, each
    shard's part of every table, the reply put together from the parts) cost more
    than the reads themselves.
    """

    def __init__(
        self,
        shards: Sequence[StoreShard],
        row_dtype: RowDtype,
        current_at: Sequence[Callable[[], float]],
    ) -> None:
        self.shards = list(shards)
        self.row_dtype = row_dtype
        self._current_at = list(current_at)
        # The group each list of tables read, with the shards' tables it was made of.
        self._groups: dict[tuple[str, ...], tuple[list[_Tables], TableGroup]] = {}

    def lookup(
        self,
        ids: Mapping[str, npt.ArrayLike],
        *,
        train: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, npt.NDArray[np.floating]]:
        """Rows (``row_dtype``, ``[n, dim]``) for the ids of each table, in order.

        ``train`` must be False: replicas are read-only. ``timeout_s`` is taken for a
        reader's interface: a read in memory waits on nothing.
        """
        if train:
            msg = "train: serving replicas are read-only"
            raise InvalidRequest(msg)
        for shard in self.shards:
            if shard.unavailable is not None:
                raise StoreUnavailable(shard.unavailable)
        keys_of: dict[str, npt.NDArray[np.uint64]] = {}
        for name, wanted in ids.items():
            keys_of[name] = id_array(wanted, f"ids[{name}]")
        if not keys_of:
            return {}
        names = list(keys_of)
        bounds = np.cumsum([0, *(k.shape[0] for k in keys_of.values())], dtype=np.int64)
        rows = self._read(names, np.concatenate(list(keys_of.values())), bounds)
        if rows is None:
            return self._lookup_by_table(keys_of)
        out: dict[str, npt.NDArray[np.floating]] = {}
        at = 0
        for name, k in zip(names, np.diff(bounds).tolist(), strict=True):
            out[name] = rows[at : at + k].astype(self.row_dtype, copy=False)
            at += k
        return out

    def read_flat(
        self,
        names: Sequence[str],
        ids: npt.NDArray[np.uint64],
        bounds: npt.NDArray[np.int64],
        *,
        timeout_s: float | None = None,
    ) -> npt.NDArray[np.float32] | None:
        """The rows of every table's ids side by side (table ``names[t]``'s are
        ``ids[bounds[t]:bounds[t + 1]]``), float32 as :meth:`lookup` gives them in
        ``row_dtype``; None when the tables are not of one dim (use :meth:`lookup`)."""
        for shard in self.shards:
            if shard.unavailable is not None:
                raise StoreUnavailable(shard.unavailable)
        # Rounded to float16 as lookup's rows are, in the read.
        return self._read(names, ids, bounds, half=self.row_dtype == "float16")

    def _read(
        self,
        names: Sequence[str],
        keys: npt.NDArray[np.uint64],
        bounds: npt.NDArray[np.int64],
        *,
        half: bool = False,
    ) -> npt.NDArray[np.float32] | None:
        """Every table of every shard in one kernel call (shard-major; table ``names[t]``'s
        ids are ``keys[bounds[t]:bounds[t + 1]]``), each id read from the shard that owns
        it (``half``: rounded to float16); None when the tables are not of one dim."""
        group = self._group(names)
        if group.dim is None:
            return None
        rows = np.empty((keys.shape[0], group.dim), np.float32)
        read = group.read_bounds(bounds, keys, rows, num_shards=len(self.shards), half=half)
        return rows if read else None

    def _group(self, names: Sequence[str]) -> TableGroup:
        """The group of the tables ``names`` of every shard (shard-major), made again once
        a shard's tables were replaced (a restore makes a new mapping)."""
        key = tuple(names)
        now = [shard.tables for shard in self.shards]
        found = self._groups.get(key)
        if found is not None and all(map(operator.is_, found[0], now)):
            return found[1]
        if len(self._groups) >= 64:  # a client chooses the lists: keep a few
            self._groups.clear()
        group = TableGroup([shard.table(name) for shard in self.shards for name in names])
        self._groups[key] = (now, group)
        return group

    def _lookup_by_table(
        self, keys_of: Mapping[str, npt.NDArray[np.uint64]]
    ) -> dict[str, npt.NDArray[np.floating]]:
        """Table by table: tables of several dims, or laid out otherwise than
        ``TableGroup`` reads them."""
        owners = (
            shard_of(np.concatenate(list(keys_of.values())), len(self.shards))
            if len(self.shards) > 1
            else None
        )
        out: dict[str, npt.NDArray[np.floating]] = {}
        at = 0
        for name, keys in keys_of.items():
            k = keys.shape[0]
            owner = owners[at : at + k] if owners is not None else None
            at += k
            if owner is None or k <= 1 or owner.min() == owner.max():
                shard = self.shards[int(owner[0]) if owner is not None and k else 0]
                rows, _ = shard.table(name).read(keys)
            else:
                rows = np.empty((k, self.shards[0].table(name).dim), np.float32)
                for s in np.unique(owner):
                    mine = owner == s
                    rows[mine] = self.shards[int(s)].table(name).read(keys[mine])[0]
            out[name] = rows.astype(self.row_dtype, copy=False)
        return out

    def current_at(self) -> float:
        """The oldest replica's newest round: every row read now is at least as fresh
        as the training shards were then."""
        return min(at() for at in self._current_at)

    def close(self) -> None:
        """Nothing to close: the replicas are the :class:`LocalReplicas`'."""


class StoreRows:
    """A ``StoreClient``'s rows (serving replicas in processes of their own) with the
    flat read of :class:`ReplicaRows`: every table's ids in one lookup (one call to
    each shard, as ``lookup`` makes), the rows side by side in float32, so that a
    request's rows skip the per-table batch objects and the per-table half-precision
    casts (``serving.model.ServingModel`` takes whichever a reader has).

    ``client``: anything with ``lookup`` and the tables' ``dims``.

    >>> from embedding_store.client import StoreClient
    >>> config = StoreConfig(tables={"a": {"dim": 2}, "b": {"dim": 2}}, row_dtype="float16")
    >>> with StoreClient.from_shards([StoreShard(config, read_only=True)]) as client:
    ...     rows = StoreRows(client)
    ...     ids = np.array([7, 8, 9], np.uint64)  # two of table a, one of b
    ...     flat = rows.read_flat(["a", "b"], ids, np.array([0, 2, 3]))
    ...     apart = rows.lookup({"a": ids[:2], "b": ids[2:]})
    >>> flat.dtype, bool((flat == np.concatenate([apart["a"], apart["b"]])).all())
    (dtype('float32'), True)
    """

    def __init__(self, client: _DimsAndLookup) -> None:
        self.client = client
        self._one_dim = len(set(client.dims.values())) == 1

    def lookup(
        self,
        ids: Mapping[str, npt.ArrayLike],
        *,
        train: bool = False,
        timeout_s: float | None = None,
    ) -> Mapping[str, npt.NDArray[np.floating]]:
        """The client's lookup (``train`` must be False: serving reads), within
        ``timeout_s`` when given."""
        if train:
            msg = "train: serving reads rows without changing them"
            raise InvalidRequest(msg)
        return self.client.lookup(ids, train=False, timeout_s=timeout_s)

    def read_flat(
        self,
        names: Sequence[str],
        ids: npt.NDArray[np.uint64],
        bounds: npt.NDArray[np.int64],
        *,
        timeout_s: float | None = None,
    ) -> npt.NDArray[np.float32] | None:
        """As :meth:`ReplicaRows.read_flat`: table ``names[t]``'s ids are
        ``ids[bounds[t]:bounds[t + 1]]``; None when the tables are not of one dim."""
        if not self._one_dim or not names:
            return None
        at = bounds.tolist()
        got = self.client.lookup(
            {name: ids[at[t] : at[t + 1]] for t, name in enumerate(names)},
            train=False,
            timeout_s=timeout_s,
        )
        return widened(np.concatenate([got[name] for name in names]))


class _DimsAndLookup(Protocol):
    @property
    def dims(self) -> Mapping[str, int]: ...

    def lookup(
        self,
        ids: Mapping[str, npt.ArrayLike],
        *,
        train: bool = ...,
        timeout_s: float | None = ...,
    ) -> Mapping[str, npt.NDArray[np.floating]]: ...


class LocalReplicas:
    """One read-only shard per training shard in ``sources``, each following its own."""

    def __init__(
        self,
        config: StoreConfig,
        sources: Sequence[ChangeSource],
        *,
        poll_s: float = FOLLOW_POLL_S,
    ) -> None:
        """``sources``: the training shards in shard order (``StoreShard`` objects, or
        ``GrpcTransport``s: see :meth:`follow`)."""
        self.sources = list(sources)
        # A tiered table's replica is tiered too: its disk tier in a folder of this
        # server's own, removed at close.
        tiered = any(t.tier is not None for t in config.tables.values())
        self._scratch = (
            tempfile.TemporaryDirectory(prefix="streamrec-replicas-") if tiered else None
        )
        self.shards = [
            StoreShard(
                config,
                data_dir=Path(self._scratch.name) / f"shard-{i}" if self._scratch else None,
                read_only=True,
            )
            for i in range(len(self.sources))
        ]
        self.followers = [
            ShardFollower(shard, source, poll_s=poll_s)
            for shard, source in zip(self.shards, self.sources, strict=True)
        ]
        self.rows = ReplicaRows(
            self.shards, config.row_dtype, [f.current_at for f in self.followers]
        )
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=f.run, args=(self._stop,), name=f"follow-{i}", daemon=True)
            for i, f in enumerate(self.followers)
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def follow(
        cls,
        config: StoreConfig,
        addresses: str,
        *,
        token: str | None,
        poll_s: float = FOLLOW_POLL_S,
    ) -> LocalReplicas:
        """Replicas of the training shards at ``grpc://HOST:PORT,...`` (shard order)."""
        hosts = [a for a in addresses.removeprefix("grpc://").split(",") if a]
        if not addresses.startswith("grpc://") or not hosts:
            msg = f"{addresses!r} is not grpc://HOST:PORT[,HOST:PORT...]"
            raise ValueError(msg)
        sources = [
            GrpcTransport(
                host,
                token=token,
                max_message_bytes=config.max_message_bytes,
                # Few quick attempts: a round that fails is tried again a poll later.
                retry=RetryPolicy(attempts=2, timeout_s=30.0),
                shared_memory=False,
            )
            for host in hosts
        ]
        return cls(config, sources, poll_s=poll_s)

    def caught_up(self) -> bool:
        """Every replica has caught up with its training shard once."""
        return all(f.caught_up.is_set() for f in self.followers)

    def wait_caught_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(f.caught_up.wait(max(0.0, deadline - time.monotonic())) for f in self.followers)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.rows.close()
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        for shard in self.shards:
            shard.close()
        if self._scratch is not None:
            self._scratch.cleanup()
