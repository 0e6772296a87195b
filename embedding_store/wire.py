"""Raw little-endian byte encodings of ids, rows and gradients on the wire.

>>> import numpy as np
>>> ids = decode_ids(encode_ids(np.array([1, 2**63], dtype=np.uint64)), "ids")
>>> ids.tolist()
[1, 9223372036854775808]
>>> decode_matrix(b"\\x00" * 12, 2, "float16", "rows").shape
(3, 2)
>>> decode_matrix(b"\\x00" * 7, 2, "float16", "rows")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
embedding_store.errors.InvalidRequest: rows: 7 bytes is not a whole number of float16 rows ...

Lookup and Push also travel as *frames*: one raw message each way on gRPC's
generic handlers (``FRAME_SERVICE``), with no protobuf around the payload. A
reply built as a protobuf field copies every row three times (the message is
built, then serialised, then parsed; ``benchmarks/store.py``, ``grpc_*``);
a frame is a small fixed header, the table names, and the arrays back to
back, so the server writes rows straight into the reply and the client reads
them with ``np.frombuffer``. Layout, all little-endian::

    head   magic 4s | version B | dtype B | flags B | pad x | step q | tables I | extra I
    table  count Q | dim I | name length H | name (UTF-8)   (once per table)
    extra  the push's request id (UTF-8); empty otherwise
    pad    zeros up to a multiple of 8 bytes
    body   per table, each section padded to 8 bytes:
           lookup request: ids (uint64); reply: rows (dtype, row-major);
           push request: ids (uint64), then gradients (dtype, row-major)

A push's reply is the protobuf ``PushResponse`` (a few counters). A push may
ask for the rows it changed back (flag ``1``): then the response holds exactly
the pushed ids' rows as the shard holds them after the push, with their
optimizer state (``row_state_reply``), which is how a trainer reads its own
pushes fresh, and predicts the next, without another round trip.

For a shard on the client's host the same frames go through a shared-memory
area instead (``SharedCall``): the client writes the request frame into a
file in ``/dev/shm`` that the shard has mapped, the shard reads it in place and
writes the reply frame next to it, and gRPC carries only a 72-byte message one
way and 8 bytes (a lookup) or a PushResponse the other, with the token,
deadlines and error codes as for any call, and the rows cross no socket
(``benchmarks/store.py``: ``grpc_*`` against ``grpc_network_*``).

>>> frame = decode_lookup(encode_lookup({"user": np.array([3, 4], np.uint64)}, train=True,
...                                     step=7, dtype="float16"))
>>> frame.ids["user"].tolist(), frame.train, frame.step, frame.dtype, frame.create_only
([3, 4], True, 7, 'float16', False)
>>> buf, views = rows_frame({"user": (2, 3)}, "float16")
>>> views["user"][:] = 1.5
>>> decode_rows(bytes(buf), "float16")["user"].tolist()
[[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]]
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedding_store.errors import InvalidRequest
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.types import FlatRows, RowDtype, RowState

_LE_U64 = np.dtype("<u8")
_DTYPES: dict[str, np.dtype[np.floating]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}
TO_PB = {"float16": pb.FLOAT16, "float32": pb.FLOAT32}
FROM_PB: dict[int, RowDtype] = {pb.FLOAT16: "float16", pb.FLOAT32: "float32"}


def encode_ids(ids: npt.NDArray[np.uint64]) -> bytes:
    """Ids as little-endian uint64 bytes."""
    return np.ascontiguousarray(ids, dtype=_LE_U64).tobytes()


def decode_ids(data: bytes, field: str) -> npt.NDArray[np.uint64]:
    """Bytes back to ids; the length must be a multiple of 8."""
    if len(data) % 8:
        msg = f"{field}: {len(data)} bytes is not a whole number of uint64 ids (8 bytes each)"
        raise InvalidRequest(msg)
    return np.frombuffer(data, dtype=_LE_U64).astype(np.uint64, copy=False)


def encode_matrix(rows: npt.NDArray[np.floating], dtype: RowDtype) -> bytes:
    """Rows (or gradients) as little-endian bytes of ``dtype``, row-major."""
    return np.ascontiguousarray(rows, dtype=_DTYPES[dtype]).tobytes()


def decode_matrix(data: bytes, dim: int, dtype: RowDtype, field: str) -> npt.NDArray[np.floating]:
    """Bytes back to a ``[n, dim]`` matrix of ``dtype`` (read-only, zero-copy)."""
    width = dim * _DTYPES[dtype].itemsize
    if width == 0 or len(data) % width:
        msg = (
            f"{field}: {len(data)} bytes is not a whole number of {dtype} rows of dim {dim} "
            f"({width} bytes each)"
        )
        raise InvalidRequest(msg)
    return np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(-1, dim)


def row_dtype(value: int, field: str = "dtype") -> RowDtype:
    """A wire dtype enum to its name; unknown values are an InvalidRequest."""
    try:
        return FROM_PB[value]
    except KeyError:
        msg = f"{field}: unknown row dtype {value} (expected FLOAT16=0 or FLOAT32=1)"
        raise InvalidRequest(msg) from None


# --- frames -------------------------------------------------------------------------

FRAME_SERVICE = "streamrec.embedding_store.v1.EmbeddingStoreFrames"
LOOKUP_FRAME_METHOD = f"/{FRAME_SERVICE}/Lookup"
PUSH_FRAME_METHOD = f"/{FRAME_SERVICE}/Push"

FRAME_VERSION = 1
LOOKUP_MAGIC = b"SRLQ"
ROWS_MAGIC = b"SRLR"
PUSH_MAGIC = b"SRPQ"
_HEAD = struct.Struct("<4sBBBxqII")
_TABLE = struct.Struct("<QIH")
_TRAIN, _CREATE_ONLY, _HAS_STEP = 1, 2, 4
# Push frame flag: the reply carries the pushed rows and their optimizer state.
_RETURN_ROWS = 1
_DTYPE_CODES: dict[str, int] = {"float16": 0, "float32": 1}
_CODE_DTYPES: dict[int, RowDtype] = {0: "float16", 1: "float32"}
# Bounds a hostile header cannot pass (a frame is capped by max_message_bytes anyway).
_MAX_TABLES = 1 << 16


@dataclass(frozen=True)
class LookupFrame:
    """A decoded Lookup frame; ``ids`` are read-only views of the received bytes."""

    ids: dict[str, npt.NDArray[np.uint64]]
    train: bool
    dtype: RowDtype
    step: int | None
    create_only: bool


@dataclass(frozen=True)
class PushFrame:
    """A decoded Push frame; ids and gradients are read-only views of the received bytes."""

    request_id: str
    dtype: RowDtype
    grads: dict[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.floating]]]
    return_rows: bool = False


Frame = bytearray | memoryview


def _pad8(n: int) -> int:
    return -n % 8


def _head(
    magic: bytes,
    dtype: RowDtype,
    flags: int,
    step: int,
    tables: list[tuple[str, int, int]],
    extra: bytes = b"",
) -> bytes:
    """The head, table entries and extra of a frame, padded to 8 bytes."""
    parts = [
        _HEAD.pack(magic, FRAME_VERSION, _DTYPE_CODES[dtype], flags, step, len(tables), len(extra))
    ]
    for name, count, dim in tables:
        encoded = name.encode()
        parts.append(_TABLE.pack(count, dim, len(encoded)))
        parts.append(encoded)
    parts.append(extra)
    size = sum(len(p) for p in parts)
    parts.append(bytes(_pad8(size)))
    return b"".join(parts)


def _section(arr: npt.NDArray[np.generic]) -> list[memoryview | bytes]:
    """An array's bytes and the zeros that pad them to 8 (no copy of the array)."""
    view = arr.data.cast("B")
    pad = _pad8(view.nbytes)
    return [view, bytes(pad)] if pad else [view]


class _Head:
    """A parsed frame head: every bound checked, so a hostile frame is an InvalidRequest."""

    def __init__(self, data: bytes | memoryview, magic: bytes, what: str) -> None:
        self.what = what
        if len(data) < _HEAD.size:
            msg = f"{what}: {len(data)} bytes is shorter than a frame head ({_HEAD.size} bytes)"
            raise InvalidRequest(msg)
        got, version, code, self.flags, self.step, n_tables, n_extra = _HEAD.unpack_from(data)
        if got != magic:
            msg = f"{what}: not a {magic!r} frame (starts with {bytes(got)!r})"
            raise InvalidRequest(msg)
        if version != FRAME_VERSION:
            msg = f"{what}: frame version {version}, this side speaks {FRAME_VERSION}"
            raise InvalidRequest(msg)
        if code not in _CODE_DTYPES:
            msg = f"{what}: unknown row dtype {code} (expected 0 float16 or 1 float32)"
            raise InvalidRequest(msg)
        self.dtype: RowDtype = _CODE_DTYPES[code]
        if n_tables > _MAX_TABLES:
            msg = f"{what}: {n_tables} tables in one frame (at most {_MAX_TABLES})"
            raise InvalidRequest(msg)
        self.data = data
        pos = _HEAD.size
        self.tables: list[tuple[str, int, int]] = []
        named: set[str] = set()
        for _ in range(n_tables):
            if pos + _TABLE.size > len(data):
                msg = f"{what}: the frame ends inside its table list"
                raise InvalidRequest(msg)
            count, dim, n_name = _TABLE.unpack_from(data, pos)
            pos += _TABLE.size
            raw = bytes(data[pos : pos + n_name])
            pos += n_name
            if len(raw) != n_name:
                msg = f"{what}: the frame ends inside a table name"
                raise InvalidRequest(msg)
            try:
                name = raw.decode()
            except UnicodeDecodeError:
                msg = f"{what}: a table name is not UTF-8 ({raw[:40]!r})"
                raise InvalidRequest(msg) from None
            if name in named:
                msg = f"{what}: table {name!r} is named twice in one frame"
                raise InvalidRequest(msg)
            named.add(name)
            self.tables.append((name, count, dim))
        raw_extra = bytes(data[pos : pos + n_extra])
        if len(raw_extra) != n_extra:
            msg = f"{what}: the frame ends inside its header"
            raise InvalidRequest(msg)
        try:
            self.extra = raw_extra.decode()
        except UnicodeDecodeError:
            msg = f"{what}: the request id is not UTF-8"
            raise InvalidRequest(msg) from None
        self.pos = pos + n_extra + _pad8(pos + n_extra)

    def array(self, dtype: np.dtype[np.generic], count: int, field: str) -> npt.NDArray[np.generic]:
        """The next section: ``count`` items of ``dtype`` (a read-only view), then padding."""
        size = count * dtype.itemsize
        if self.pos + size > len(self.data):
            msg = (
                f"{self.what}: {field} needs {size:,} bytes, the frame has "
                f"{max(0, len(self.data) - self.pos):,} left"
            )
            raise InvalidRequest(msg)
        arr = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
        self.pos += size + _pad8(size)
        return arr

    def finish(self) -> None:
        """Refuse a frame whose length is not exactly its sections (built by other rules)."""
        if len(self.data) != self.pos:
            msg = (
                f"{self.what}: the frame is {len(self.data):,} bytes, its header describes "
                f"{self.pos:,}"
            )
            raise InvalidRequest(msg)


def encode_lookup(
    ids: Mapping[str, npt.NDArray[np.uint64]],
    *,
    train: bool,
    dtype: RowDtype,
    step: int | None = None,
    create_only: bool = False,
) -> bytes:
    """A Lookup frame: the ids of each table (one copy of them, into the frame)."""
    if step is not None and not -(1 << 63) <= step < 1 << 63:
        msg = f"step: {step} does not fit in an int64"
        raise InvalidRequest(msg)
    flags = (_TRAIN if train else 0) | (_CREATE_ONLY if create_only else 0)
    flags |= _HAS_STEP if step is not None else 0
    arrays = {k: np.ascontiguousarray(v, dtype=_LE_U64) for k, v in ids.items()}
    parts: list[memoryview | bytes] = [
        _head(LOOKUP_MAGIC, dtype, flags, step or 0, [(k, len(v), 0) for k, v in arrays.items()])
    ]
    for v in arrays.values():
        parts.extend(_section(v))
    return b"".join(parts)


def decode_lookup(data: bytes | memoryview) -> LookupFrame:
    """A Lookup frame back to its fields; the ids are zero-copy views of ``data``."""
    head = _Head(data, LOOKUP_MAGIC, "Lookup frame")
    if head.flags & ~(_TRAIN | _CREATE_ONLY | _HAS_STEP):
        msg = f"Lookup frame: unknown flags {head.flags:#x}"
        raise InvalidRequest(msg)
    ids = {
        name: head.array(_LE_U64, count, f"tables[{name}].ids").astype(np.uint64, copy=False)
        for name, count, _ in head.tables
    }
    head.finish()
    return LookupFrame(
        ids=ids,
        train=bool(head.flags & _TRAIN),
        dtype=head.dtype,
        step=head.step if head.flags & _HAS_STEP else None,
        create_only=bool(head.flags & _CREATE_ONLY),
    )


def rows_frame_size(tables: Mapping[str, tuple[int, int]], dtype: RowDtype) -> int:
    """The bytes of a Lookup reply frame for ``{table: (rows, dim)}``."""
    head = _head(ROWS_MAGIC, dtype, 0, 0, [(k, n, d) for k, (n, d) in tables.items()])
    item = _DTYPES[dtype].itemsize
    return len(head) + sum(n * d * item + _pad8(n * d * item) for n, d in tables.values())


def rows_frame(
    tables: Mapping[str, tuple[int, int]], dtype: RowDtype, into: memoryview | None = None
) -> tuple[bytearray | memoryview, dict[str, npt.NDArray[np.floating]]]:
    """A Lookup reply frame for ``{table: (rows, dim)}``, and a writable view of each table's rows.

    The server looks the rows up straight into the views, then sends ``bytes(buf)``:
    the rows are copied once, from the table into the frame. ``into``: a writable
    buffer of ``rows_frame_size`` bytes to build the frame in (a shared area).
    """
    head = _head(ROWS_MAGIC, dtype, 0, 0, [(k, n, d) for k, (n, d) in tables.items()])
    item = _DTYPES[dtype].itemsize
    sizes = [n * d * item for n, d in tables.values()]
    total = len(head) + sum(s + _pad8(s) for s in sizes)
    buf: bytearray | memoryview = bytearray(total) if into is None else into
    if len(buf) != total:
        msg = f"rows_frame: a buffer of {len(buf):,} bytes for a frame of {total:,}"
        raise ValueError(msg)
    buf[: len(head)] = head
    views = {}
    pos = len(head)
    for (name, (n, d)), size in zip(tables.items(), sizes, strict=True):
        views[name] = np.frombuffer(buf, dtype=_DTYPES[dtype], count=n * d, offset=pos).reshape(
            n, d
        )
        buf[pos + size : pos + size + _pad8(size)] = bytes(_pad8(size))
        pos += size + _pad8(size)
    return buf, views


def decode_rows(data: bytes | memoryview, dtype: RowDtype) -> dict[str, npt.NDArray[np.floating]]:
    """A Lookup reply frame back to ``{table: rows}`` (read-only views of ``data``)."""
    head = _Head(data, ROWS_MAGIC, "Lookup reply frame")
    if head.dtype != dtype:
        msg = f"Lookup reply frame: rows in {head.dtype}, {dtype} were asked for"
        raise InvalidRequest(msg)
    rows = {
        name: head.array(_DTYPES[dtype], count * dim, f"tables[{name}].rows").reshape(count, dim)
        for name, count, dim in head.tables
    }
    head.finish()
    return rows  # type: ignore[return-value]


def encode_push(
    grads: Mapping[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.floating]]],
    *,
    request_id: str,
    dtype: RowDtype,
    return_rows: bool = False,
) -> bytes:
    """A Push frame: each table's ids, then its gradients rounded to ``dtype``.

    ``return_rows``: ask for the pushed rows back (see ``row_state_reply``).

    >>> ids, g = np.array([5], np.uint64), np.ones((1, 2), np.float32)
    >>> frame = decode_push(encode_push({"t": (ids, g)}, request_id="r", dtype="float32",
    ...                                 return_rows=True))
    >>> frame.request_id, frame.return_rows, frame.grads["t"][1].tolist()
    ('r', True, [[1.0, 1.0]])
    """
    arrays = {
        k: (np.ascontiguousarray(i, dtype=_LE_U64), np.ascontiguousarray(g, dtype=_DTYPES[dtype]))
        for k, (i, g) in grads.items()
    }
    for k, (i, g) in arrays.items():
        if g.ndim != 2 or g.shape[0] != i.shape[0]:
            msg = f"grads[{k}]: shape {g.shape} for {i.shape[0]} ids"
            raise InvalidRequest(msg)
    parts: list[memoryview | bytes] = [
        _head(
            PUSH_MAGIC,
            dtype,
            _RETURN_ROWS if return_rows else 0,
            0,
            [(k, len(i), g.shape[1]) for k, (i, g) in arrays.items()],
            request_id.encode(),
        )
    ]
    for i, g in arrays.values():
        parts.extend(_section(i))
        parts.extend(_section(g))
    return b"".join(parts)


def decode_push(data: bytes | memoryview) -> PushFrame:
    """A Push frame back to its fields; ids and gradients are zero-copy views of ``data``."""
    head = _Head(data, PUSH_MAGIC, "Push frame")
    if head.flags & ~_RETURN_ROWS:
        msg = f"Push frame: unknown flags {head.flags:#x}"
        raise InvalidRequest(msg)
    grads = {}
    for name, count, dim in head.tables:
        ids = head.array(_LE_U64, count, f"tables[{name}].ids").astype(np.uint64, copy=False)
        g = head.array(_DTYPES[head.dtype], count * dim, f"tables[{name}].grads")
        grads[name] = (ids, g.reshape(count, dim))
    head.finish()
    return PushFrame(
        request_id=head.extra,
        dtype=head.dtype,
        grads=grads,  # type: ignore[arg-type]
        return_rows=bool(head.flags & _RETURN_ROWS),
    )


def row_state_reply(
    tables: Mapping[str, tuple[int, int, int]],
) -> tuple[bytearray, dict[str, RowState]]:
    """A push reply's rows for ``{table: (rows, dim, state width)}``, empty, and a
    writable :class:`RowState` view of each table's part to fill them through.

    The reply names no table: its tables are the push request's, in its order, so
    that the trainer reads a reply with one parse however many tables it holds.
    Layout (little-endian, sections padded to 8 bytes): the table count (int64),
    ``(rows, dim, width)`` per table (int64), then the float32 weights, the float32
    optimizer state and the update counts (int64) of every table back to back.

    >>> buf, views = row_state_reply({"t": (2, 3, 1)})
    >>> views["t"].weights[:] = 1.0; views["t"].state[:] = 0.0; views["t"].row_step[:] = 4
    >>> decode_row_state(bytes(buf), ["t"], [2])["t"].row_step.tolist()
    [4, 4]
    """
    shapes = np.array([len(tables)] + [v for t in tables.values() for v in t], dtype="<i8")
    counts, dims, widths = shapes[1::3], shapes[2::3], shapes[3::3]
    n, w_size, s_size = int(counts.sum()), int(counts @ dims), int(counts @ widths)
    w_at = shapes.nbytes + _pad8(shapes.nbytes)
    s_at = w_at + 4 * w_size + _pad8(4 * w_size)
    r_at = s_at + 4 * s_size + _pad8(4 * s_size)
    buf = bytearray(r_at + 8 * n)
    buf[: shapes.nbytes] = shapes.tobytes()
    weights = np.frombuffer(buf, "<f4", w_size, w_at)
    state = np.frombuffer(buf, "<f4", s_size, s_at)
    steps = np.frombuffer(buf, "<i8", n, r_at)
    views, row, w, s = {}, 0, 0, 0
    for name, (k, dim, width) in tables.items():
        views[name] = RowState(
            weights[w : w + k * dim].reshape(k, dim),
            state[s : s + k * width].reshape(k, width),
            steps[row : row + k],
        )
        row, w, s = row + k, w + k * dim, s + k * width
    return buf, views


def decode_row_state(data: bytes, names: list[str], counts: list[int]) -> FlatRows:
    """:func:`row_state_reply`'s bytes back to rows (read-only views of ``data``): the
    reply to a push of ``counts`` rows of tables ``names``, in the request's order.
    """
    what = "push reply"
    k = len(names)
    head = 8 * (1 + 3 * k)
    if len(data) < head or int.from_bytes(data[:8], "little", signed=True) != k:
        msg = f"{what}: not the rows of {k} tables"
        raise InvalidRequest(msg)
    shapes = np.frombuffer(data, "<i8", 3 * k, 8).reshape(k, 3).astype(np.int64)
    if shapes[:, 0].tolist() != counts:
        msg = f"{what}: rows {shapes[:, 0].tolist()} for a push of {counts}"
        raise InvalidRequest(msg)
    if (shapes < 0).any() or (shapes > 1 << 40).any():
        msg = f"{what}: impossible table shapes {shapes.tolist()}"
        raise InvalidRequest(msg)
    n = int(shapes[:, 0].sum())
    w_size = int((shapes[:, 0] * shapes[:, 1]).sum())
    s_size = int((shapes[:, 0] * shapes[:, 2]).sum())
    w_at = head + _pad8(head)
    s_at = w_at + 4 * w_size + _pad8(4 * w_size)
    r_at = s_at + 4 * s_size + _pad8(4 * s_size)
    if len(data) != r_at + 8 * n:
        msg = f"{what}: {len(data):,} bytes for rows that take {r_at + 8 * n:,}"
        raise InvalidRequest(msg)
    return FlatRows(
        names,
        shapes,
        RowState(
            np.frombuffer(data, "<f4", w_size, w_at).astype(np.float32, copy=False),
            np.frombuffer(data, "<f4", s_size, s_at).astype(np.float32, copy=False),
            np.frombuffer(data, "<i8", n, r_at).astype(np.int64, copy=False),
        ),
    )


# --- shared areas: the same frames through shared memory, for a shard on this host ----

ATTACH_METHOD = f"/{FRAME_SERVICE}/Attach"
DETACH_METHOD = f"/{FRAME_SERVICE}/Detach"
SHARED_LOOKUP_METHOD = f"/{FRAME_SERVICE}/LookupShared"
SHARED_PUSH_METHOD = f"/{FRAME_SERVICE}/PushShared"
SHARED_MAGIC = b"SRSH"
# magic, version, session id, nonce, then four offsets or sizes
_SHARED = struct.Struct("<4sB3x16s16sQQQQ")
# Bytes at the start of an area: its nonce, then room to spare.
AREA_HEADER = 64


@dataclass(frozen=True)
class SharedCall:
    """A call whose frames lie in a shared area (``session``), not in the message.

    For ``Attach`` the offsets are unused and ``size`` is the area's; for
    ``LookupShared`` / ``PushShared`` the request frame is at
    ``[request_offset, + request_length)`` and a lookup's reply frame goes at
    ``[reply_offset, + reply_capacity)``.
    """

    session: bytes
    nonce: bytes = bytes(16)
    request_offset: int = 0
    request_length: int = 0
    reply_offset: int = 0
    reply_capacity: int = 0

    @property
    def name(self) -> str:
        """The area's file name in ``/dev/shm``."""
        return f"streamrec-{self.session.hex()}"


def encode_shared(call: SharedCall) -> bytes:
    """A shared call's small message (the frames themselves are in the area).

    >>> c = SharedCall(bytes(range(16)), request_offset=64, request_length=8)
    >>> decode_shared(encode_shared(c)) == c
    True
    """
    return _SHARED.pack(
        SHARED_MAGIC,
        FRAME_VERSION,
        call.session,
        call.nonce,
        call.request_offset,
        call.request_length,
        call.reply_offset,
        call.reply_capacity,
    )


def decode_shared(data: bytes) -> SharedCall:
    """A shared call's message back to its fields (InvalidRequest when malformed)."""
    if len(data) != _SHARED.size:
        msg = f"shared area: a call message of {len(data)} bytes (expected {_SHARED.size})"
        raise InvalidRequest(msg)
    magic, version, session, nonce, *offsets = _SHARED.unpack(data)
    if magic != SHARED_MAGIC or version != FRAME_VERSION:
        msg = f"shared area: not a version {FRAME_VERSION} {SHARED_MAGIC!r} message"
        raise InvalidRequest(msg)
    return SharedCall(session, nonce, *offsets)
