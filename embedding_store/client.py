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

import contextlib
import errno
import itertools
import json
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from embedding_store.errors import (
    CheckpointError,
    InvalidRequest,
    MessageTooLarge,
    ShardRestarted,
    StoreError,
    StoreUnavailable,
    Unauthenticated,
    UnknownTable,
)
from embedding_store.hashing import group_by_shard
from embedding_store.latency import LatencyHistogram
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
from embedding_store.service import AUTH_HEADER
from embedding_store.shard import StoreShard
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    LatencySnapshot,
    PushedRows,
    PushResult,
    RestoreResult,
    RowDtype,
    ShardRows,
    ShardStats,
    StoreConfig,
    TableChanges,
    TableConfig,
    TableStats,
)
from embedding_store.wire import (
    AREA_HEADER,
    ATTACH_METHOD,
    DETACH_METHOD,
    FROM_PB,
    LOOKUP_FRAME_METHOD,
    PUSH_FRAME_METHOD,
    SHARED_LOOKUP_METHOD,
    SHARED_PUSH_METHOD,
    TO_PB,
    SharedCall,
    decode_ids,
    decode_matrix,
    decode_row_state,
    decode_rows,
    encode_ids,
    encode_lookup,
    encode_matrix,
    encode_push,
    encode_shared,
    row_state_reply,
    rows_frame_size,
)

T = TypeVar("T")
U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]
Rows = npt.NDArray[np.floating]
Wait = Callable[[], T]

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_ERRORS: dict[grpc.StatusCode, type[StoreError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownTable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: CheckpointError,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
}
_KINDS = {"auto": pb.AUTO, "full": pb.FULL, "delta": pb.DELTA}


class _NoFrames(StoreError):
    """The shard does not serve frames (UNIMPLEMENTED): one older than them."""


# Ids of one table routed to shards: the ids, their order by shard, each shard's bounds.
_Routed = tuple[U64, npt.NDArray[np.int64], npt.NDArray[np.int64]]


@dataclass(frozen=True)
class RetryPolicy:
    """How the gRPC transport retries idempotent calls."""

    attempts: int = 6
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    timeout_s: float = 30.0

    @property
    def longest_s(self) -> float:
        """The longest a call's attempts can span: every attempt timing out, with the
        backoffs between them. A shard remembers a push's request id for longer
        (``store.remembered_push_s``), so a retried push is never applied twice.

        >>> RetryPolicy().longest_s
        181.55
        """
        backoffs, delay = 0.0, self.initial_backoff_s
        for _ in range(self.attempts - 1):
            backoffs += delay
            delay = min(delay * 2, self.max_backoff_s)
        return round(self.attempts * self.timeout_s + backoffs, 6)


class ShardTransport(Protocol):
    """How a client talks to one shard. ``start_*`` send now; the returned callable waits.

    With ``deferred`` the call may instead be made by the returned callable, on the
    caller's thread: the client defers one shard's call, which it waits for first,
    and so spares a thread hand-off (on loopback, a blocking gRPC call takes about
    1 ms less than the same call through a future).
    """

    address: str

    def describe(self) -> tuple[dict[str, int], RowDtype]:
        """The shard's tables (name -> dim) and its configured row dtype."""
        ...

    def start_lookup(
        self,
        ids: dict[str, U64],
        train: bool,
        step: int | None,
        dtype: RowDtype,
        *,
        create_only: bool = False,
        deferred: bool = False,
        timeout_s: float | None = None,
    ) -> Wait[dict[str, Rows]]:
        """Rows of ``ids``; with ``create_only`` (and ``train``) none: the rows are only made.
        ``timeout_s``: the whole call, retries included, ends within it (``StoreUnavailable``);
        None: the transport's own policy."""
        ...

    def start_push(
        self,
        grads: dict[str, tuple[U64, Rows]],
        request_id: str,
        dtype: RowDtype,
        *,
        return_rows: bool = False,
        deferred: bool = False,
    ) -> Wait[PushResult]:
        """Apply ``grads``; with ``return_rows`` the result carries the pushed rows after it."""
        ...

    def checkpoint(
        self, directory: str, kind: CheckpointKind, metadata: dict[str, Any]
    ) -> CheckpointResult: ...

    def restore(
        self, directory: str, shard_index: int, num_shards: int, upto_seq: int | None
    ) -> RestoreResult: ...

    def stats(self) -> ShardStats: ...

    def accept_restart(self) -> None:
        """Take the shard's current process as the one to train against (see ShardRestarted)."""
        ...

    def current_at(self) -> float:
        """When the shard's rows were last current (a serving replica's newest round)."""
        ...

    def close(self) -> None: ...


def _left(until: float | None) -> float | None:
    """Seconds left until ``until`` (a ``time.monotonic()``), never below 0; None: no limit."""
    return None if until is None else max(0.0, until - time.monotonic())


def id_array(ids: npt.ArrayLike, field: str) -> U64:
    """``ids`` as a contiguous uint64 array; ``InvalidRequest`` naming ``field`` unless
    they are a 1-d array of integers (or empty).

    >>> id_array([3, 4], "ids[t]").dtype
    dtype('uint64')
    >>> id_array([0.5], "ids[t]")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    embedding_store.errors.InvalidRequest: ids[t]: expected a 1-d array of integer ids, ...
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.shape[0] > 0):
        msg = f"{field}: expected a 1-d array of integer ids, got {arr.dtype} shape {arr.shape}"
        raise InvalidRequest(msg)
    return np.ascontiguousarray(arr, dtype=np.uint64)


class InprocTransport:
    """A shard object in this process; calls run on a thread (kernels release the GIL).

    Like the gRPC servicer, it times the lookups and pushes it runs (the
    shard's work and the dtype casts) and ``stats()`` reports them.
    """

    def __init__(
        self,
        shard: StoreShard,
        pool: ThreadPoolExecutor | None,
        name: str,
        current_at: Callable[[], float] | None = None,
    ) -> None:
        """``current_at``: when a replica's rows were last current (its follower's);
        None: the shard is read as it is, current now."""
        self.shard = shard
        self.address = name
        self._pool = pool
        self._current_at = current_at
        self.lookup_latency = LatencyHistogram()
        self.push_latency = LatencyHistogram()

    def _start(self, fn: Callable[[], T], deferred: bool) -> Wait[T]:
        if deferred:
            return fn
        if self._pool is None:
            value = fn()
            return lambda: value
        return self._pool.submit(fn).result

    def describe(self) -> tuple[dict[str, int], RowDtype]:
        return {name: t.dim for name, t in self.shard.tables.items()}, self.shard.config.row_dtype

    def accept_restart(self) -> None:
        """A shard object in this process cannot restart."""

    def current_at(self) -> float:
        return time.time() if self._current_at is None else self._current_at()

    def start_lookup(
        self,
        ids: dict[str, U64],
        train: bool,
        step: int | None,
        dtype: RowDtype,
        *,
        create_only: bool = False,
        deferred: bool = False,
        timeout_s: float | None = None,
    ) -> Wait[dict[str, Rows]]:
        # A shard of this process answers without a network to wait on: no timeout.
        def run() -> dict[str, Rows]:
            with self.lookup_latency.time():
                # Float16 rows are rounded as they are copied out of the table.
                rows = self.shard.lookup(ids, train=train, step=step, dtype=dtype)
                return {} if create_only else rows

        return self._start(run, deferred)

    def start_push(
        self,
        grads: dict[str, tuple[U64, Rows]],
        request_id: str,
        dtype: RowDtype,
        *,
        return_rows: bool = False,
        deferred: bool = False,
    ) -> Wait[PushResult]:
        def run() -> PushResult:
            with self.push_latency.time():
                # The wire rounds gradients to the push dtype; do the same here so
                # that inproc:// and grpc:// train identically.
                cast = {
                    k: (i, np.asarray(g).astype(dtype).astype(np.float32))
                    for k, (i, g) in grads.items()
                }
                if not return_rows:
                    return self.shard.push(cast, request_id=request_id)
                # Filled as the push is applied (a peek after it could see a later push).
                _, into = row_state_reply(
                    {
                        k: (len(i), t.dim, t.state_width)
                        for k, (i, _) in grads.items()
                        for t in (self.shard.table(k),)
                    }
                )
                return replace(self.shard.push(cast, request_id=request_id, into=into), rows=into)

        return self._start(run, deferred)

    def checkpoint(
        self, directory: str, kind: CheckpointKind, metadata: dict[str, Any]
    ) -> CheckpointResult:
        return self.shard.checkpoint(directory or None, kind, metadata=metadata)

    def restore(
        self, directory: str, shard_index: int, num_shards: int, upto_seq: int | None
    ) -> RestoreResult:
        return self.shard.restore(
            directory or None, shard_index=shard_index, num_shards=num_shards, upto_seq=upto_seq
        )

    def stats(self) -> ShardStats:
        return replace(
            self.shard.stats(),
            lookup_latency=self.lookup_latency.snapshot(),
            push_latency=self.push_latency.snapshot(),
        )

    def close(self) -> None:
        pass


def _map_rpc_error(exc: grpc.RpcError, address: str, method: str) -> StoreError:
    code = exc.code()
    cls = _ERRORS.get(code, StoreError)
    return cls(f"{method} on shard {address}: {code.name}: {exc.details()}")


SHM_DIR = "/dev/shm"
# The smallest shared area made (it grows, by powers of two, to what a call needs).
_MIN_AREA = 4 << 20


def _align64(n: int) -> int:
    return (n + 63) & ~63


class _SharedArea:
    """A file in ``/dev/shm`` mapped by this client and, once attached, by a shard.

    Its pages are reserved when it is made (``posix_fallocate``): a full
    ``/dev/shm`` fails here, with an OSError, and not later with a SIGBUS in the
    shard. One call uses it at a time (``lock``); a call that finds it busy goes
    over the network.
    """

    def __init__(self, directory: str, size: int) -> None:
        self.session = os.urandom(16)
        self.nonce = os.urandom(16)
        self.size = size
        self.lock = threading.Lock()
        self.path = os.path.join(directory, SharedCall(self.session).name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.map[:16] = self.nonce

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
            self.map.close()


class GrpcTransport:
    """A shard process over gRPC, with the job's token and a retry policy."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        max_message_bytes: int,
        retry: RetryPolicy,
        shared_memory: bool = True,
    ) -> None:
        """``shared_memory``: pass the frames through a shared-memory area when the
        shard turns out to be on this host (see ``_SharedArea``); only the small
        call messages then go over gRPC."""
        self.address = address
        self._retry = retry
        self._metadata = ((AUTH_HEADER, f"Bearer {token}"),) if token is not None else ()
        # The shard process this client trains against (see ShardRestarted); "" until known.
        self.incarnation = ""
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.EmbeddingStoreStub(self._channel)  # type: ignore[no-untyped-call]
        # Lookup and Push as raw frames (bytes each way, see ``wire``); False once a
        # shard older than frames answered UNIMPLEMENTED: then the protobuf methods.
        self._frames = True
        self._lookup_frame = self._channel.unary_unary(LOOKUP_FRAME_METHOD, None, None)
        self._push_frame = self._channel.unary_unary(PUSH_FRAME_METHOD, None, None)
        self._lookup_shared = self._channel.unary_unary(SHARED_LOOKUP_METHOD, None, None)
        self._push_shared = self._channel.unary_unary(SHARED_PUSH_METHOD, None, None)
        # The shared area with the shard; False once it proved elsewhere (or refused).
        self._shared_ok = shared_memory and os.path.isdir(SHM_DIR)
        self._area: _SharedArea | None = None
        self._area_guard = threading.Lock()
        self._area_limit = AREA_HEADER + 2 * max_message_bytes
        self._dims: dict[str, int] = {}

    def _call(
        self,
        method: str,
        request: Any,
        first: Any = None,
        fn: Any = None,
        until: float | None = None,
    ) -> Any:
        """Call ``method`` with retries; ``first`` is an already started future.

        ``fn``: the callable to use instead of the stub's ``method`` (a frame method,
        which a shard older than frames answers with UNIMPLEMENTED: ``_NoFrames``).
        ``until``: no attempt runs past this ``time.monotonic()``, and none starts after it.
        """
        frame = fn is not None
        fn = fn or getattr(self._stub, method)
        delay = self._retry.initial_backoff_s
        error: StoreError | None = None
        for attempt in range(self._retry.attempts):
            timeout = self._retry.timeout_s
            if until is not None:
                timeout = min(timeout, until - time.monotonic())
                if timeout <= 0:
                    msg = f"{method} on shard {self.address}: no answer within the call's time"
                    error = StoreUnavailable(msg)
                    break
            try:
                if attempt == 0 and first is not None:
                    return first.result()
                return fn(request, metadata=self._metadata, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and frame:
                    error = _NoFrames(f"{method} frames on shard {self.address}: UNIMPLEMENTED")
                    break
                if exc.code() not in _RETRYABLE or attempt == self._retry.attempts - 1:
                    error = _map_rpc_error(exc, self.address, method)
                    break
                if until is not None:
                    delay = min(delay, max(0.0, until - time.monotonic()))
                time.sleep(delay)
                delay = min(delay * 2, self._retry.max_backoff_s)
        # Raised outside the handler, so no gRPC call object rides along as its
        # __context__: Dask pickles a task's error, and that object does not pickle
        # (the job would get a plain Exception instead of StoreUnavailable).
        if error is None:  # pragma: no cover - every way out of the loop sets it
            raise AssertionError("unreachable")
        raise error

    def _start(
        self,
        method: str,
        request: Any,
        fn: Any = None,
        *,
        deferred: bool = False,
        until: float | None = None,
    ) -> Wait[Any]:
        frame = fn
        if deferred:
            return lambda: self._call(method, request, fn=frame, until=until)
        timeout = self._retry.timeout_s
        if until is not None:
            timeout = max(0.0, min(timeout, until - time.monotonic()))
        future = (fn or getattr(self._stub, method)).future(
            request, metadata=self._metadata, timeout=timeout
        )
        return lambda: self._call(method, request, first=future, fn=frame, until=until)

    def describe(self) -> tuple[dict[str, int], RowDtype]:
        r = self._call("Health", pb.HealthRequest())
        if not self.incarnation:
            self.incarnation = r.incarnation
        self._dims = dict(r.dims)
        return dict(r.dims), FROM_PB.get(r.row_dtype, "float16")

    def current_at(self) -> float:
        """When the shard's rows were last current: now for a training shard, a serving
        replica's newest round that caught up (0: not yet)."""
        r = self._call("Health", pb.HealthRequest())
        return time.time() if r.status == "SERVING" and r.current_at == 0.0 else r.current_at

    # --- the shared area ----------------------------------------------------------

    def _take_area(self, need: int) -> _SharedArea | None:
        """The shared area, locked for one call of ``need`` bytes; None: use the network."""
        if not self._shared_ok or need > self._area_limit:
            return None
        with self._area_guard:
            area = self._area
            if area is not None and area.size >= need:
                return area if area.lock.acquire(blocking=False) else None
            if area is not None:  # too small: make a bigger one once it is free
                if not area.lock.acquire(blocking=False):
                    return None
                self._area = None
                self._detach(area)
            size = AREA_HEADER + max(_MIN_AREA, 1 << (need - AREA_HEADER - 1).bit_length())
            area = self._attach(min(size, self._area_limit))
            if area is not None:
                area.lock.acquire()
                self._area = area
            return area

    def _attach(self, size: int) -> _SharedArea | None:
        try:
            area = _SharedArea(SHM_DIR, size)
        except OSError as exc:
            # A full /dev/shm (a container's 64 MiB) refuses this size only.
            if exc.errno != errno.ENOSPC:
                self._shared_ok = False
            return None
        call = SharedCall(area.session, area.nonce, reply_capacity=size)
        attach = self._channel.unary_unary(ATTACH_METHOD, None, None)
        try:
            self._call("Attach", encode_shared(call), fn=attach)
        except (InvalidRequest, _NoFrames) as exc:
            # Another host (the shard found no such file), or a shard without areas;
            # an area over the shard's size limit only means this call's is too big.
            if "out of range" not in str(exc):
                self._shared_ok = False
            area.close()
            return None
        except StoreError:
            area.close()
            return None
        finally:
            area.unlink()  # both have it mapped: nothing is left behind if either dies
        return area

    def _detach(self, area: _SharedArea) -> None:
        """Tell the shard to unmap ``area`` (best effort) and unmap it here."""
        detach = self._channel.unary_unary(DETACH_METHOD, None, None)
        with contextlib.suppress(grpc.RpcError):
            detach(encode_shared(SharedCall(area.session)), metadata=self._metadata, timeout=5)
        area.close()

    def _forget(self, area: _SharedArea) -> None:
        """Stop using ``area`` (the shard no longer knows it); the next call attaches anew."""
        with self._area_guard:
            if self._area is area:
                self._area = None
        area.close()

    def _shared(
        self,
        method: str,
        fn: Any,
        area: _SharedArea,
        payload: bytes,
        deferred: bool,
        network: Callable[[], T],
        read: Callable[[bytes, _SharedArea, int], T],
        *,
        until: float | None = None,
    ) -> Wait[T]:
        """Call ``method`` with ``payload`` written into ``area`` (locked by the caller).

        ``read(reply, area, reply_offset)`` makes the result while the area is still
        held; when the shard no longer knows the area (it restarted), ``network()``.
        """
        start = AREA_HEADER
        area.map[start : start + len(payload)] = payload
        reply_at = start + _align64(len(payload))
        call = SharedCall(
            area.session,
            request_offset=start,
            request_length=len(payload),
            reply_offset=reply_at,
            reply_capacity=area.size - reply_at,
        )
        wait = self._start(method, encode_shared(call), fn, deferred=deferred, until=until)

        def result() -> T:
            try:
                try:
                    reply = wait()
                except (InvalidRequest, _NoFrames) as exc:
                    if isinstance(exc, InvalidRequest) and "shared area:" not in str(exc):
                        raise
                    self._forget(area)
                    return network()
                return read(reply, area, reply_at)
            finally:
                area.lock.release()

        return result

    def accept_restart(self) -> None:
        """Take the shard's current process as the one to train against from now on.

        Waits for the channel to reach the shard, up to the policy's ``timeout_s``:
        gRPC waits 1 s before it tries a lost peer again, then 1.6 times longer each
        time, so after a few seconds' outage a restarted shard was refused past every
        retry of a call (a rank taking the restart ended its job, the shard serving).
        """
        try:
            reply = self._stub.Health(
                pb.HealthRequest(),
                metadata=self._metadata,
                timeout=self._retry.timeout_s,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise _map_rpc_error(exc, self.address, "Health") from None
        self.incarnation = reply.incarnation

    def _check_incarnation(self, seen: str, what: str) -> None:
        if self.incarnation and seen and seen != self.incarnation:
            msg = (
                f"store shard {self.address} restarted (a new process answered the {what}): "
                "what was pushed to it since its last checkpoint is lost"
            )
            raise ShardRestarted(msg)

    def start_lookup(
        self,
        ids: dict[str, U64],
        train: bool,
        step: int | None,
        dtype: RowDtype,
        *,
        create_only: bool = False,
        deferred: bool = False,
        timeout_s: float | None = None,
    ) -> Wait[dict[str, Rows]]:
        until = None if timeout_s is None else time.monotonic() + timeout_s
        if self._frames:
            payload = encode_lookup(
                ids, train=train, dtype=dtype, step=step, create_only=create_only
            )
            area = None
            if not create_only and all(k in self._dims for k in ids):
                shapes = {k: (len(v), self._dims[k]) for k, v in ids.items()}
                need = _align64(len(payload)) + rows_frame_size(shapes, dtype)
                area = self._take_area(AREA_HEADER + need)
            if area is not None:

                def network() -> dict[str, Rows]:
                    left = _left(until)
                    return self.start_lookup(
                        ids, train, step, dtype, deferred=True, timeout_s=left
                    )()

                def read(reply: bytes, area: _SharedArea, at: int) -> dict[str, Rows]:
                    (n,) = struct.unpack("<Q", reply)
                    if at + n > area.size:
                        msg = f"Lookup reply from shard {self.address}: {n} bytes at {at}"
                        raise InvalidRequest(msg)
                    # Copies: the area is reused by the next call.
                    return {
                        k: np.array(v)
                        for k, v in decode_rows(memoryview(area.map)[at : at + n], dtype).items()
                    }

                return self._shared(
                    "LookupShared", self._lookup_shared, area, payload, deferred, network, read,
                    until=until,
                )  # fmt: skip
            wait_frame = self._start(
                "Lookup", payload, self._lookup_frame, deferred=deferred, until=until
            )

            def rows() -> dict[str, Rows]:
                try:
                    data = wait_frame()
                except _NoFrames:
                    self._frames = False
                    return self.start_lookup(
                        ids, train, step, dtype, create_only=create_only, deferred=True,
                        timeout_s=_left(until),
                    )()  # fmt: skip
                try:
                    return decode_rows(data, dtype)
                except InvalidRequest as exc:
                    msg = f"Lookup reply from shard {self.address}: {exc}"
                    raise InvalidRequest(msg) from None

            return rows
        request = pb.LookupRequest(
            tables=[pb.TableIds(table=k, ids=encode_ids(v)) for k, v in ids.items()],
            train=train,
            dtype=TO_PB[dtype],
            step=step,
            create_only=create_only,
        )
        wait = self._start("Lookup", request, deferred=deferred, until=until)

        def result() -> dict[str, Rows]:
            resp = wait()
            return {
                t.table: decode_matrix(t.rows, t.dim, dtype, f"{t.table} rows from {self.address}")
                for t in resp.tables
            }

        return result

    def start_push(
        self,
        grads: dict[str, tuple[U64, Rows]],
        request_id: str,
        dtype: RowDtype,
        *,
        return_rows: bool = False,
        deferred: bool = False,
    ) -> Wait[PushResult]:
        rows_of = (list(grads), [len(i) for i, _ in grads.values()]) if return_rows else None
        if self._frames:
            payload = encode_push(
                grads, request_id=request_id, dtype=dtype, return_rows=return_rows
            )
            area = self._take_area(AREA_HEADER + _align64(len(payload)))
            if area is not None:

                def network() -> PushResult:
                    return self.start_push(
                        grads, request_id, dtype, return_rows=return_rows, deferred=True
                    )()

                def read(reply: bytes, area: _SharedArea, at: int) -> PushResult:
                    return self._push_result(pb.PushResponse.FromString(reply), rows_of)

                return self._shared(
                    "PushShared", self._push_shared, area, payload, deferred, network, read
                )
            wait_frame = self._start("Push", payload, self._push_frame, deferred=deferred)

            def applied() -> PushResult:
                try:
                    data = wait_frame()
                except _NoFrames:
                    self._frames = False
                    return self.start_push(
                        grads, request_id, dtype, return_rows=return_rows, deferred=True
                    )()
                return self._push_result(pb.PushResponse.FromString(data), rows_of)

            return applied
        request = pb.PushRequest(
            request_id=request_id,
            tables=[
                pb.TableGrads(table=k, ids=encode_ids(i), grads=encode_matrix(g, dtype))
                for k, (i, g) in grads.items()
            ],
            dtype=TO_PB[dtype],
            return_rows=return_rows,
        )
        wait = self._start("Push", request, deferred=deferred)
        return lambda: self._push_result(wait(), rows_of)

    def _push_result(
        self, r: pb.PushResponse, rows_of: tuple[list[str], list[int]] | None
    ) -> PushResult:
        """``rows_of``: the pushed tables and their row counts, when rows were asked for."""
        self._check_incarnation(r.incarnation, "push")
        rows = None
        if rows_of is not None and r.rows:  # a shard leaves out a reply too large to send
            try:
                rows = decode_row_state(r.rows, *rows_of)
            except InvalidRequest as exc:
                msg = f"Push reply from shard {self.address}: {exc}"
                raise InvalidRequest(msg) from None
        return PushResult(
            applied=r.applied,
            dropped_not_admitted=r.dropped_not_admitted,
            rejected_nonfinite=r.rejected_nonfinite,
            duplicate_request=r.duplicate_request,
            rows=rows,
            seen=tuple(r.seen) or None,
        )

    def checkpoint(
        self, directory: str, kind: CheckpointKind, metadata: dict[str, Any]
    ) -> CheckpointResult:
        r = self._call(
            "Checkpoint",
            pb.CheckpointRequest(
                directory=directory, kind=_KINDS[kind], metadata_json=json.dumps(metadata)
            ),
        )
        self._check_incarnation(r.incarnation, "checkpoint")
        return _checkpoint_from_pb(r)

    def restore(
        self, directory: str, shard_index: int, num_shards: int, upto_seq: int | None
    ) -> RestoreResult:
        r = self._call(
            "Restore",
            pb.RestoreRequest(
                directory=directory,
                shard_index=shard_index,
                num_shards=num_shards,
                upto_seq=upto_seq,
            ),
        )
        # Restored: this process's rows are the checkpoint's, so train against it.
        self.incarnation = r.incarnation
        return RestoreResult(
            manifests=tuple(r.manifests), rows=r.rows, rows_by_table=dict(r.rows_by_table)
        )

    def changes(self, table: str, epoch: str, since: int) -> TableChanges:
        """The shard's rows of ``table`` changed since ``since`` (``EmbeddingTable.changes``)."""
        r = self._call("Changes", pb.ChangesRequest(table=table, epoch=epoch, since=since))
        return _table_changes(r)

    def changes_many(self, asks: Sequence[tuple[str, str, int]]) -> list[TableChanges]:
        """:meth:`changes` of several ``(table, epoch, since)`` in one call."""
        request = pb.ChangesManyRequest(
            tables=[pb.ChangesRequest(table=t, epoch=e, since=s) for t, e, s in asks]
        )
        return [_table_changes(r) for r in self._call("ChangesMany", request).tables]

    def rows_page(self, table: str, cursor: int, count: int) -> tuple[U64, F32, int]:
        """The shard's rows of ``table`` in slots ``[cursor, cursor + count)``, next cursor."""
        r = self._call("RowsPage", pb.RowsPageRequest(table=table, cursor=cursor, count=count))
        ids = decode_ids(r.ids, "RowsPageResponse.ids")
        weights = decode_matrix(r.rows, r.dim, "float32", "RowsPageResponse.rows")
        return ids, weights.astype(np.float32, copy=False), int(r.next_cursor)

    def stats(self) -> ShardStats:
        r = self._call("Stats", pb.StatsRequest())
        tables = tuple(
            TableStats(**{f: getattr(t, f) for f in TableStats.__dataclass_fields__})
            for t in r.tables
        )
        last = _checkpoint_from_pb(r.last_checkpoint) if r.HasField("last_checkpoint") else None
        latency = {}
        for name in ("lookup_latency", "push_latency"):
            # Servers older than these fields leave them out: None, not zeros.
            if r.HasField(name):
                try:
                    latency[name] = latency_from_pb(getattr(r, name))
                except ValueError as exc:
                    msg = f"Stats from shard {self.address}: bad {name}: {exc}"
                    raise StoreError(msg) from None
        return ShardStats(
            tables=tables,
            duplicate_pushes=r.duplicate_pushes,
            last_checkpoint=last,
            lookup_latency=latency.get("lookup_latency"),
            push_latency=latency.get("push_latency"),
        )

    def close(self) -> None:
        with self._area_guard:
            area, self._area = self._area, None
        if area is not None:
            self._detach(area)
        self._channel.close()


def _table_changes(r: pb.ChangesResponse) -> TableChanges:
    return TableChanges(
        epoch=r.epoch,
        version=r.version,
        complete=r.complete,
        ids=decode_ids(r.ids, "ChangesResponse.ids"),
        weights=decode_matrix(r.rows, r.dim, "float32", "ChangesResponse.rows"),
        removed=decode_ids(r.removed, "ChangesResponse.removed"),
        changed_at=r.changed_at,
    )


def latency_from_pb(r: pb.LatencyHistogram) -> LatencySnapshot:
    """A latency snapshot from its wire form; ``ValueError`` when it is inconsistent."""
    return LatencySnapshot(
        buckets=tuple(r.buckets), counts=tuple(r.counts), sum_s=r.sum_seconds, count=r.count
    )


def _checkpoint_from_pb(r: pb.CheckpointResponse) -> CheckpointResult:
    return CheckpointResult(
        manifest=r.manifest,
        kind="full" if r.kind == "full" else "delta",
        seq=r.seq,
        rows=r.rows,
        tombstones=r.tombstones,
        bytes=r.bytes,
        seconds=r.seconds,
    )


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
