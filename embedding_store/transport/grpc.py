"""``grpc://``: a shard process over gRPC, with the job's token and a retry policy.

Lookup and Push travel as raw frames (``embedding_store.wire``), through a
shared-memory area (``shm``) when the shard is on this host; a shard without
frames is called with the protobuf methods instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from embedding_store.errors import (
    InvalidRequest,
    ShardRestarted,
    StoreError,
    StoreUnavailable,
)
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
from embedding_store.service import AUTH_HEADER
from embedding_store.transport.base import F32, U64, RetryPolicy, Rows, T, Wait
from embedding_store.transport.messages import checkpoint_from_pb, latency_from_pb, table_changes
from embedding_store.transport.shm import MIN_AREA, SHM_DIR, SharedArea, align64
from embedding_store.transport.status import RETRYABLE, NoFrames, map_rpc_error
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    PushResult,
    RestoreResult,
    RowDtype,
    ShardStats,
    TableChanges,
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
    rows_frame_size,
)

_KINDS = {"auto": pb.AUTO, "full": pb.FULL, "delta": pb.DELTA}


def _left(until: float | None) -> float | None:
    """Seconds left until ``until`` (a ``time.monotonic()``), never below 0; None: no limit."""
    return None if until is None else max(0.0, until - time.monotonic())


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
        shard turns out to be on this host (see ``SharedArea``); only the small
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
        self._area: SharedArea | None = None
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
        which a shard older than frames answers with UNIMPLEMENTED: ``NoFrames``).
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
                    error = NoFrames(f"{method} frames on shard {self.address}: UNIMPLEMENTED")
                    break
                if exc.code() not in RETRYABLE or attempt == self._retry.attempts - 1:
                    error = map_rpc_error(exc, self.address, method)
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

    def _take_area(self, need: int) -> SharedArea | None:
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
            size = AREA_HEADER + max(MIN_AREA, 1 << (need - AREA_HEADER - 1).bit_length())
            area = self._attach(min(size, self._area_limit))
            if area is not None:
                area.lock.acquire()
                self._area = area
            return area

    def _attach(self, size: int) -> SharedArea | None:
        try:
            area = SharedArea(SHM_DIR, size)
        except OSError as exc:
            # A full /dev/shm (a container's 64 MiB) refuses this size only.
            if exc.errno != errno.ENOSPC:
                self._shared_ok = False
            return None
        call = SharedCall(area.session, area.nonce, reply_capacity=size)
        attach = self._channel.unary_unary(ATTACH_METHOD, None, None)
        try:
            self._call("Attach", encode_shared(call), fn=attach)
        except (InvalidRequest, NoFrames) as exc:
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

    def _detach(self, area: SharedArea) -> None:
        """Tell the shard to unmap ``area`` (best effort) and unmap it here."""
        detach = self._channel.unary_unary(DETACH_METHOD, None, None)
        with contextlib.suppress(grpc.RpcError):
            detach(encode_shared(SharedCall(area.session)), metadata=self._metadata, timeout=5)
        area.close()

    def _forget(self, area: SharedArea) -> None:
        """Stop using ``area`` (the shard no longer knows it); the next call attaches anew."""
        with self._area_guard:
            if self._area is area:
                self._area = None
        area.close()

    def _shared(
        self,
        method: str,
        fn: Any,
        area: SharedArea,
        payload: bytes,
        deferred: bool,
        network: Callable[[], T],
        read: Callable[[bytes, SharedArea, int], T],
        *,
        until: float | None = None,
    ) -> Wait[T]:
        """Call ``method`` with ``payload`` written into ``area`` (locked by the caller).

        ``read(reply, area, reply_offset)`` makes the result while the area is still
        held; when the shard no longer knows the area (it restarted), ``network()``.
        """
        start = AREA_HEADER
        area.map[start : start + len(payload)] = payload
        reply_at = start + align64(len(payload))
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
                except (InvalidRequest, NoFrames) as exc:
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
        time: after a few seconds' outage a plain call could spend all its retries
        before the channel tries again, and end the job of a rank taking the restart
        while the shard already serves.
        """
        try:
            reply = self._stub.Health(
                pb.HealthRequest(),
                metadata=self._metadata,
                timeout=self._retry.timeout_s,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.address, "Health") from None
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
                need = align64(len(payload)) + rows_frame_size(shapes, dtype)
                area = self._take_area(AREA_HEADER + need)
            if area is not None:

                def network() -> dict[str, Rows]:
                    left = _left(until)
                    return self.start_lookup(
                        ids, train, step, dtype, deferred=True, timeout_s=left
                    )()

                def read(reply: bytes, area: SharedArea, at: int) -> dict[str, Rows]:
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
                except NoFrames:
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
            area = self._take_area(AREA_HEADER + align64(len(payload)))
            if area is not None:

                def network() -> PushResult:
                    return self.start_push(
                        grads, request_id, dtype, return_rows=return_rows, deferred=True
                    )()

                def read(reply: bytes, area: SharedArea, at: int) -> PushResult:
                    return self._push_result(pb.PushResponse.FromString(reply), rows_of)

                return self._shared(
                    "PushShared", self._push_shared, area, payload, deferred, network, read
                )
            wait_frame = self._start("Push", payload, self._push_frame, deferred=deferred)

            def applied() -> PushResult:
                try:
                    data = wait_frame()
                except NoFrames:
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
        return checkpoint_from_pb(r)

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
        return table_changes(r)

    def changes_many(self, asks: Sequence[tuple[str, str, int]]) -> list[TableChanges]:
        """:meth:`changes` of several ``(table, epoch, since)`` in one call."""
        request = pb.ChangesManyRequest(
            tables=[pb.ChangesRequest(table=t, epoch=e, since=s) for t, e, s in asks]
        )
        return [table_changes(r) for r in self._call("ChangesMany", request).tables]

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
        last = checkpoint_from_pb(r.last_checkpoint) if r.HasField("last_checkpoint") else None
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
