"""The gRPC shell around a ``StoreShard``: decode, call, encode, map errors to codes.

Error mapping (the client maps the codes back to the same exception types):

==========================  ======================
``UnknownTable``            ``NOT_FOUND``
``InvalidRequest``          ``INVALID_ARGUMENT``
``CheckpointError``         ``FAILED_PRECONDITION``
missing or wrong token      ``UNAUTHENTICATED``
message over the size cap   ``RESOURCE_EXHAUSTED`` (by gRPC itself)
==========================  ======================

The servicer times every Lookup and Push it handles (from entry until the
response message is built, failed calls included) into two histograms of its
own; Stats returns them with the shard's counters.

Lookup and Push are served twice: as the protobuf methods of the ``.proto``
(any gRPC client), and as raw frames (``wire.FRAME_SERVICE``, what
``StoreClient`` sends) on a generic handler with no (de)serialiser, so a
frame's bytes reach the handler as they came off the wire and the reply's
rows are written by the lookup straight into the bytes sent back. Both go
through the same checks, error codes, token, size limits and timers. A client
on the shard's host passes the same frames through a shared area instead
(``SharedAreas``, methods ``LookupShared`` and ``PushShared``).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import mmap
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from embedding_store.errors import (
    CheckpointError,
    InvalidRequest,
    MessageTooLarge,
    StoreUnavailable,
    UnknownTable,
)
from embedding_store.heap import trim_heap
from embedding_store.latency import LatencyHistogram
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
from embedding_store.shard import StoreShard
from embedding_store.types import CheckpointResult, LatencySnapshot, ShardStats
from embedding_store.wire import (
    AREA_HEADER,
    FRAME_SERVICE,
    TO_PB,
    SharedCall,
    decode_ids,
    decode_lookup,
    decode_matrix,
    decode_push,
    decode_shared,
    encode_ids,
    encode_matrix,
    row_dtype,
    row_state_reply,
    rows_frame,
    rows_frame_size,
)
from embedding_store.wire import (
    LookupFrame as DecodedLookup,
)

AUTH_HEADER = "authorization"
_KINDS = {pb.AUTO: "auto", pb.FULL: "full", pb.DELTA: "delta"}
# Lookup replies being built at once may hold this many times max_message_bytes.
_INFLIGHT_REPLIES = 4
# Bytes a looked-up row takes while its reply is built: float32 rows, then the wire copy
# (a frame holds less: its rows once in the dtype sent, and the bytes sent).
_WORK_BYTES_PER_VALUE = 4 + 4


class _ByteBudget:
    """Bounds the bytes that concurrent calls hold; a call that alone exceeds it still runs."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self._cond:
            while self._used and self._used + n > self.capacity:
                self._cond.wait()
            self._used += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _errors_to_status(
    method: Callable[[Any, Req, grpc.ServicerContext], Resp],
) -> Callable[[Any, Req, grpc.ServicerContext], Resp]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return method(self, request, context)
        except UnknownTable as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CheckpointError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except MessageTooLarge as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except StoreUnavailable as exc:  # a replica with nothing to serve yet: ask again
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    return wrapper


def checkpoint_to_pb(result: CheckpointResult) -> pb.CheckpointResponse:
    return pb.CheckpointResponse(
        manifest=result.manifest,
        kind=result.kind,
        seq=result.seq,
        rows=result.rows,
        tombstones=result.tombstones,
        bytes=result.bytes,
        seconds=result.seconds,
    )


def latency_to_pb(snap: LatencySnapshot) -> pb.LatencyHistogram:
    """The wire form of a latency snapshot (read back by ``transport.messages.latency_from_pb``)."""
    return pb.LatencyHistogram(
        buckets=snap.buckets, counts=snap.counts, sum_seconds=snap.sum_s, count=snap.count
    )


SHM_DIR = "/dev/shm"
# Areas a shard keeps mapped at once; the least recently attached goes first.
_MAX_AREAS = 64


class SharedAreas:
    """The shared-memory areas that clients on this host attached (see ``wire.SharedCall``).

    A client creates a file in ``/dev/shm``, writes a random nonce at its start
    and asks the shard to attach it: the shard maps it only when it finds the
    file, of the size said, holding that nonce, which proves both share the host
    (a shard elsewhere finds no such file, and the client keeps to the network).
    The client then unlinks the file, so nothing is left behind if either dies;
    the mapping lives until the client detaches, or the area is the oldest of
    ``_MAX_AREAS``. Every failure is an InvalidRequest starting "shared area:".
    """

    def __init__(self, directory: str = SHM_DIR, limit: int = _MAX_AREAS) -> None:
        self.directory = directory
        self.limit = limit
        self._maps: OrderedDict[bytes, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def attach(self, call: SharedCall, max_size: int) -> None:
        size = call.reply_capacity
        if not AREA_HEADER < size <= max_size:
            msg = f"shared area: size {size:,} out of range ({AREA_HEADER}, {max_size:,}]"
            raise InvalidRequest(msg)
        try:
            fd = os.open(os.path.join(self.directory, call.name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            msg = f"shared area: {call.name} cannot be opened here ({exc.strerror})"
            raise InvalidRequest(msg) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                msg = f"shared area: {call.name} is not a file of {size:,} bytes"
                raise InvalidRequest(msg)
            area = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if area[:16] != call.nonce:
            area.close()
            msg = f"shared area: {call.name} does not hold the nonce sent"
            raise InvalidRequest(msg)
        with self._lock:
            self._maps[call.session] = area
            while len(self._maps) > self.limit:
                self._close(self._maps.popitem(last=False)[1])

    def get(self, session: bytes) -> mmap.mmap:
        with self._lock:
            area = self._maps.get(session)
        if area is None:
            msg = "shared area: unknown session (detached, evicted, or the shard restarted)"
            raise InvalidRequest(msg)
        return area

    def detach(self, session: bytes) -> None:
        with self._lock:
            area = self._maps.pop(session, None)
        if area is not None:
            self._close(area)

    @staticmethod
    def _close(area: mmap.mmap) -> None:
        with contextlib.suppress(BufferError):  # a call still reads it: unmapped when done
            area.close()


def _region(area: mmap.mmap, offset: int, length: int, what: str) -> memoryview:
    """``[offset, offset + length)`` of an area, refused when it is not inside it."""
    if not AREA_HEADER <= offset <= offset + length <= len(area):
        msg = f"shared area: {what} [{offset}, +{length}) is outside the area of {len(area):,}"
        raise InvalidRequest(msg)
    return memoryview(area)[offset : offset + length]


class EmbeddingStoreServicer(pb_grpc.EmbeddingStoreServicer):
    """Serves one ``StoreShard`` over gRPC, timing its Lookup and Push calls."""

    def __init__(
        self,
        shard: StoreShard,
        *,
        allow_dirs: tuple[Path, ...] = (),
        health: Callable[[], str] | None = None,
        current_at: Callable[[], float] | None = None,
    ) -> None:
        """``health``: the status Health answers ("SERVING" when not given); a serving
        replica answers "SYNCING" until it has caught up with its training shard.
        ``current_at``: a replica's time of its newest round that was current."""
        self.shard = shard
        self._health = health
        self._current_at = current_at
        # Folders besides the data dir that Checkpoint and Restore may name.
        self.allow_dirs = tuple(Path(d).resolve() for d in allow_dirs)
        self.lookup_latency = LatencyHistogram()
        self.push_latency = LatencyHistogram()
        self._replies = _ByteBudget(_INFLIGHT_REPLIES * shard.config.max_message_bytes)
        self.areas = SharedAreas()

    def stats(self) -> ShardStats:
        """The shard's counters with this server's call latencies (what Stats returns)."""
        return replace(
            self.shard.stats(),
            lookup_latency=self.lookup_latency.snapshot(),
            push_latency=self.push_latency.snapshot(),
        )

    @_errors_to_status
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with self.lookup_latency.time():
            return self._lookup(request)

    def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        dtype = row_dtype(request.dtype)
        ids = {t.table: decode_ids(t.ids, f"tables[{t.table}].ids") for t in request.tables}
        if len(ids) != len(request.tables):
            msg = "tables: a table is named twice in one Lookup"
            raise InvalidRequest(msg)
        step = request.step if request.HasField("step") else None
        if self._create_only(ids, request.create_only, request.train, step):
            return pb.LookupResponse(dtype=request.dtype)
        values = self._check_reply_size(ids, dtype)
        with self._replies.hold(values * _WORK_BYTES_PER_VALUE):
            rows = self.shard.lookup(ids, train=request.train, step=step)
            return pb.LookupResponse(
                tables=[
                    pb.TableRows(table=name, dim=r.shape[1], rows=encode_matrix(r, dtype))
                    for name, r in rows.items()
                ],
                dtype=request.dtype,
            )

    def _create_only(
        self, ids: dict[str, Any], create_only: bool, train: bool, step: int | None
    ) -> bool:
        """Make the rows of a bulk load (``create_only``) and say so; False for a plain lookup."""
        if not create_only:
            return False
        if not train:
            msg = "create_only: needs train=true (a bulk load creates rows)"
            raise InvalidRequest(msg)
        values = sum(len(v) * self.shard.table(name).dim for name, v in ids.items())
        with self._replies.hold(values * 4):  # the rows made, at most, held at once
            self.shard.create_rows(ids, step=step)
        return True

    def _check_reply_size(self, ids: dict[str, Any], dtype: str, what: str = "Lookup") -> int:
        """The values the reply will hold; MessageTooLarge when it could not be sent.

        Refused before any row is made or read: a reply that cannot be sent would
        only cost memory (and, with train=True, create rows for nothing).
        """
        values = sum(len(v) * self.shard.table(name).dim for name, v in ids.items())
        reply = values * (2 if dtype == "float16" else 4)
        limit = self.shard.config.max_message_bytes
        if reply > limit:
            n = sum(len(v) for v in ids.values())
            msg = (
                f"{what}: the reply for {n} ids would be {reply:,} bytes, over "
                f"max_message_bytes {limit:,}; split the ids into several calls"
            )
            raise MessageTooLarge(msg)
        return values

    @_errors_to_status
    def LookupFrame(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Lookup with a raw frame each way (see ``wire``): the rows are copied once."""
        with self.lookup_latency.time():
            return bytes(self._lookup_frame(decode_lookup(request), None))

    def _lookup_frame(
        self, frame: DecodedLookup, into: Callable[[int], memoryview] | None
    ) -> bytearray | memoryview:
        """The reply frame of ``frame``, built in ``into(size)`` (default a new bytearray)."""
        if self._create_only(frame.ids, frame.create_only, frame.train, frame.step):
            empty = None if into is None else into(rows_frame_size({}, frame.dtype))
            return rows_frame({}, frame.dtype, empty)[0]
        values = self._check_reply_size(frame.ids, frame.dtype)
        item = 2 if frame.dtype == "float16" else 4
        with self._replies.hold(values * 2 * item):
            dims = {name: self.shard.table(name).dim for name in frame.ids}
            shapes = {name: (len(v), dims[name]) for name, v in frame.ids.items()}
            buf, views = rows_frame(
                shapes,
                frame.dtype,
                None if into is None else into(rows_frame_size(shapes, frame.dtype)),
            )
            self.shard.lookup(frame.ids, train=frame.train, step=frame.step, out=views)
            return buf

    @_errors_to_status
    def LookupShared(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Lookup with both frames in a shared area; the message carries 8 bytes back."""
        with self.lookup_latency.time():
            call = decode_shared(request)
            area = self.areas.get(call.session)
            frame = decode_lookup(
                _region(area, call.request_offset, call.request_length, "the request")
            )

            def into(size: int) -> memoryview:
                if size > call.reply_capacity:
                    msg = (
                        f"shared area: a reply of {size:,} bytes, the client left room "
                        f"for {call.reply_capacity:,}"
                    )
                    raise InvalidRequest(msg)
                return _region(area, call.reply_offset, size, "the reply")

            return struct.pack("<Q", len(self._lookup_frame(frame, into)))

    @_errors_to_status
    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushResponse:
        with self.push_latency.time():
            return self._push(request)

    def _push(self, request: pb.PushRequest) -> pb.PushResponse:
        dtype = row_dtype(request.dtype)
        grads = {}
        for t in request.tables:
            ids = decode_ids(t.ids, f"tables[{t.table}].ids")
            dim = self.shard.table(t.table).dim
            g = decode_matrix(t.grads, dim, dtype, f"tables[{t.table}].grads")
            if g.shape[0] != ids.shape[0]:
                msg = (
                    f"tables[{t.table}].grads: {g.shape[0]} rows of dim {dim} for "
                    f"{ids.shape[0]} ids"
                )
                raise InvalidRequest(msg)
            grads[t.table] = (ids, g.astype(np.float32))
        if len(grads) != len(request.tables):
            msg = "tables: a table is named twice in one Push"
            raise InvalidRequest(msg)
        return self._apply_push(grads, request.request_id, request.return_rows)

    def _apply_push(
        self, grads: dict[str, Any], request_id: str, return_rows: bool = False
    ) -> pb.PushResponse:
        ids = {name: i for name, (i, _) in grads.items()}
        # Each row goes back as float32 weights and state, and an int64 update count.
        tables = {name: self.shard.table(name) for name in ids}
        values = sum(len(v) * (tables[k].dim + tables[k].state_width + 2) for k, v in ids.items())
        # A reply too large to send leaves the rows out (the trainer then reads this
        # push's rows as looked up): the push itself must not fail for its reply.
        return_rows = return_rows and values * 4 < self.shard.config.max_message_bytes
        if not return_rows:
            result = self.shard.push(grads, request_id=request_id or None)
            rows = state = steps = b""
        else:
            # Read right after the push (gathered as it is applied): what the trainer's
            # next lookup would get, and what its prediction of its next push starts from.
            with self._replies.hold(values * 4):
                shapes = {k: (len(v), tables[k].dim, tables[k].state_width) for k, v in ids.items()}
                reply, into = row_state_reply(shapes)
                result = self.shard.push(grads, request_id=request_id or None, into=into)
                rows, state, steps = bytes(reply), b"", b""
        return pb.PushResponse(
            applied=result.applied,
            dropped_not_admitted=result.dropped_not_admitted,
            rejected_nonfinite=result.rejected_nonfinite,
            duplicate_request=result.duplicate_request,
            incarnation=self.shard.incarnation,
            rows=rows,
            state=state,
            row_steps=steps,
            seen=result.seen or (),
        )

    @_errors_to_status
    def PushFrame(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Push with a raw frame (see ``wire``); the reply is a serialised PushResponse."""
        with self.push_latency.time():
            return self._push_frame(request)

    @_errors_to_status
    def PushShared(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Push with its frame in a shared area; the reply is a serialised PushResponse."""
        with self.push_latency.time():
            call = decode_shared(request)
            area = self.areas.get(call.session)
            return self._push_frame(
                _region(area, call.request_offset, call.request_length, "the request")
            )

    def _push_frame(self, request: bytes | memoryview) -> bytes:
        frame = decode_push(request)
        grads = {}
        for name, (ids, g) in frame.grads.items():
            dim = self.shard.table(name).dim
            if g.shape[1] != dim:
                msg = f"tables[{name}].grads: rows of dim {g.shape[1]}, the table's dim is {dim}"
                raise InvalidRequest(msg)
            # float32 gradients are used as they came (a view of the request's bytes).
            grads[name] = (ids, g if g.dtype == np.float32 else g.astype(np.float32))
        reply: bytes = self._apply_push(
            grads, frame.request_id, frame.return_rows
        ).SerializeToString()
        return reply

    @_errors_to_status
    def Attach(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Map a client's shared area (see ``SharedAreas``); an empty reply."""
        limit = 2 * self.shard.config.max_message_bytes + AREA_HEADER
        self.areas.attach(decode_shared(request), limit)
        return b""

    @_errors_to_status
    def Detach(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Unmap a client's shared area (a client closing); an empty reply."""
        self.areas.detach(decode_shared(request).session)
        return b""

    def frame_handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        """The generic handler of ``wire.FRAME_SERVICE``: bytes in, bytes out."""
        return grpc.method_handlers_generic_handler(
            FRAME_SERVICE,
            {
                "Lookup": grpc.unary_unary_rpc_method_handler(self.LookupFrame),
                "Push": grpc.unary_unary_rpc_method_handler(self.PushFrame),
                "LookupShared": grpc.unary_unary_rpc_method_handler(self.LookupShared),
                "PushShared": grpc.unary_unary_rpc_method_handler(self.PushShared),
                "Attach": grpc.unary_unary_rpc_method_handler(self.Attach),
                "Detach": grpc.unary_unary_rpc_method_handler(self.Detach),
            },
        )

    def _confined(self, directory: str) -> Path | None:
        """``directory`` of a Checkpoint or Restore: inside the data dir or an allowed one.

        A caller may name a folder inside the shard's data dir (relative, or
        absolute within it) or inside a folder the shard was started with
        (``--allow-dir``); the empty string is the data dir itself. Anything
        else (``/etc``, ``../../..``) is refused: a remote caller must not make
        the shard write or read where its operator did not say it may.
        """
        if not directory:
            return None
        home = self.shard.data_dir
        roots = ((home.resolve(),) if home is not None else ()) + self.allow_dirs
        if not roots:
            msg = f"directory: {directory!r} given, but this shard has no data directory"
            raise InvalidRequest(msg)
        target = (roots[0] / directory).resolve()
        if not any(target == r or r in target.parents for r in roots):
            msg = (
                f"directory: {directory!r} is outside the shard's data directory "
                f"{roots[0]}; name a folder inside it (or leave it empty for the data "
                "directory), or start the shard with --allow-dir"
            )
            raise InvalidRequest(msg)
        return target

    @_errors_to_status
    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointResponse:
        try:
            metadata = json.loads(request.metadata_json) if request.metadata_json else {}
        except ValueError as exc:
            msg = f"metadata_json: not JSON ({exc})"
            raise InvalidRequest(msg) from exc
        if not isinstance(metadata, dict):
            msg = f"metadata_json: expected a JSON object, got {type(metadata).__name__}"
            raise InvalidRequest(msg)
        kind = _KINDS.get(request.kind)
        if kind is None:
            msg = f"kind: unknown checkpoint kind {request.kind}"
            raise InvalidRequest(msg)
        directory = self._confined(request.directory)
        result = self.shard.checkpoint(directory, kind, metadata=metadata)  # type: ignore[arg-type]
        # A checkpoint allocates and frees a copy of every table's rows: the pages
        # go back to the OS now rather than staying in the heap between live blocks.
        trim_heap()
        reply = checkpoint_to_pb(result)
        reply.incarnation = self.shard.incarnation
        return reply

    @_errors_to_status
    def Restore(
        self, request: pb.RestoreRequest, context: grpc.ServicerContext
    ) -> pb.RestoreResponse:
        result = self.shard.restore(
            self._confined(request.directory),
            shard_index=request.shard_index,
            num_shards=max(1, request.num_shards),
            upto_seq=request.upto_seq if request.HasField("upto_seq") else None,
        )
        return pb.RestoreResponse(
            manifests=list(result.manifests),
            rows=result.rows,
            rows_by_table=result.rows_by_table,
            incarnation=self.shard.incarnation,
        )

    @_errors_to_status
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        stats = self.stats()
        resp = pb.StatsResponse(
            tables=[pb.TableStats(**vars(t)) for t in stats.tables],
            duplicate_pushes=stats.duplicate_pushes,
        )
        if stats.last_checkpoint is not None:
            resp.last_checkpoint.CopyFrom(checkpoint_to_pb(stats.last_checkpoint))
        if stats.lookup_latency is not None:
            resp.lookup_latency.CopyFrom(latency_to_pb(stats.lookup_latency))
        if stats.push_latency is not None:
            resp.push_latency.CopyFrom(latency_to_pb(stats.push_latency))
        return resp

    @_errors_to_status
    def Changes(
        self, request: pb.ChangesRequest, context: grpc.ServicerContext
    ) -> pb.ChangesResponse:
        return self._changes(request, self.shard.config.max_message_bytes)[0]

    @_errors_to_status
    def ChangesMany(
        self, request: pb.ChangesManyRequest, context: grpc.ServicerContext
    ) -> pb.ChangesManyResponse:
        room = self.shard.config.max_message_bytes
        answers = []
        for r in request.tables:
            answer, size = self._changes(r, room)
            if size > room:  # after the tables before it, no room: next round
                answer = pb.ChangesResponse(
                    epoch=r.epoch, version=r.since, complete=True, dim=answer.dim
                )
                size = 0
            room -= size
            answers.append(answer)
        return pb.ChangesManyResponse(tables=answers)

    def _changes(self, request: pb.ChangesRequest, room: int) -> tuple[pb.ChangesResponse, int]:
        """One table's answer and the bytes its rows take (0 when it sends none)."""
        c = self.shard.changes(request.table, request.epoch, request.since)
        dim = self.shard.table(request.table).dim
        complete = c.complete
        # Rows changed since a version too far back to send in one message: the
        # replica copies the table page by page instead.
        size = c.ids.shape[0] * (dim * 4 + 8) + c.removed.shape[0] * 8
        if size > self.shard.config.max_message_bytes:
            complete = False
        if not complete:
            incomplete = pb.ChangesResponse(
                epoch=c.epoch, version=c.version, complete=False, dim=dim, changed_at=c.changed_at
            )
            return incomplete, 0
        if size > room:
            return pb.ChangesResponse(dim=dim), size
        return pb.ChangesResponse(
            epoch=c.epoch,
            version=c.version,
            complete=True,
            dim=dim,
            ids=encode_ids(c.ids),
            rows=encode_matrix(c.weights, "float32"),
            removed=encode_ids(c.removed),
            changed_at=c.changed_at,
        ), size

    @_errors_to_status
    def RowsPage(
        self, request: pb.RowsPageRequest, context: grpc.ServicerContext
    ) -> pb.RowsPageResponse:
        table = self.shard.table(request.table)
        limit = self.shard.config.max_message_bytes // (table.dim * 4 + 8)
        ids, weights, nxt = self.shard.rows_page(
            request.table, request.cursor, max(1, min(request.count, limit))
        )
        return pb.RowsPageResponse(
            dim=table.dim, ids=encode_ids(ids), rows=encode_matrix(weights, "float32"),
            next_cursor=nxt,
        )  # fmt: skip

    def health_status(self) -> str:
        """What Health answers as ``status``: ``SERVING``, or why not (a replica catching up)."""
        return "SERVING" if self._health is None else self._health()

    @_errors_to_status
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(
            status=self.health_status(),
            dims={name: t.dim for name, t in self.shard.tables.items()},
            row_dtype=TO_PB[self.shard.config.row_dtype],
            incarnation=self.shard.incarnation,
            current_at=0.0 if self._current_at is None else self._current_at(),
        )


class TokenAuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call whose metadata lacks ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong token: send 'authorization: Bearer <token>' metadata "
                "(the job's token file)",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return continuation(handler_call_details)
        return self._deny


def make_server(
    shard: StoreShard,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None,
    servicer: EmbeddingStoreServicer | None = None,
) -> tuple[grpc.Server, int]:
    """A started gRPC server for ``shard``; returns it and the port it listens on.

    ``token=None`` disables authentication (only for tests of in-process servers
    on loopback; the command line always requires a token). ``servicer``: the
    servicer of ``shard`` to serve (default a new one); pass one to read its
    ``stats()``, latencies included, from the same process (a metrics endpoint).
    """
    if servicer is None:
        servicer = EmbeddingStoreServicer(shard)
    elif servicer.shard is not shard:
        msg = "make_server: the servicer serves another shard; pass the servicer's own shard"
        raise ValueError(msg)
    cfg = shard.config
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.server_threads, thread_name_prefix="store"),
        interceptors=[TokenAuthInterceptor(token)] if token is not None else [],
        options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_EmbeddingStoreServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_generic_rpc_handlers((servicer.frame_handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        msg = f"could not listen on {host}:{port} (port in use?)"
        raise OSError(msg)
    server.start()
    return server, bound
