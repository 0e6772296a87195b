"""Feature hashing: each sparse value becomes a 64-bit id of (field, type, value).

A value's id depends on the field it comes from and on whether it is a string or
an integer, so ``"12"`` in field ``a``, ``12`` in field ``a`` and ``"12"`` in
field ``b`` are three different ids even when the fields share an embedding
table. The ids are a pure function of the field name and the value's bytes: the
same on every process and machine (no Python ``hash()``, no native byte order).

The hash, for reference implementations elsewhere (``P1``, ``P2`` are xxHash64's
primes, ``mix64`` SplitMix64's finalizer, all arithmetic modulo 2**64):

- a field's seeds are ``blake2b(b"streamrec/<type>\\x00" + field)`` read as
  little-endian uint64s (8 bytes for strings, 16 for ints, split lo | hi);
- string (UTF-8 bytes ``s`` of length ``n``): ``h = seed ^ n * P1``, then for each
  8-byte little-endian word ``w`` of ``s`` (the last one zero-padded)
  ``h = rotl(h ^ w * P2, 31) * P1``; the id is ``mix64(h)``;
- integer ``v`` (as its two's-complement uint64): ``mix64(mix64(v ^ lo) + hi)``,
  a bijection, so distinct integers of one field never collide.

Kernels read Arrow buffers directly (offsets, data, validity bitmap, the array's
``offset`` for slices, every chunk of a ``ChunkedArray``): there is no Python
work per record.

>>> import pyarrow as pa
>>> ids, lengths = hash_sparse("tags", pa.array([["a", "b"], None, [], ["a"]]), "list_string")
>>> lengths.tolist()
[2, 0, 0, 1]
>>> bool(ids[0] == ids[2] == feature_id("tags", "a"))
True
>>> feature_id("tags", "12") != feature_id("tags", 12) != feature_id("user", 12)
True
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from embedding_store.hashing import mix64

SparseKind = Literal["string", "int", "list_string", "list_int"]
U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
# Shift counts and small offsets as uint64 scalars: numba promotes uint64 mixed
# with int64 to float64, and unsigned byte indices let LLVM fuse the eight byte
# loads of a word into one load (signed ones carry negative-index wraparound).
_B1 = np.uint64(1)
_B2 = np.uint64(2)
_B3 = np.uint64(3)
_B4 = np.uint64(4)
_B5 = np.uint64(5)
_B6 = np.uint64(6)
_B7 = np.uint64(7)
_B8 = np.uint64(8)
_S16 = np.uint64(16)
_S24 = np.uint64(24)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_S33 = np.uint64(33)
_S40 = np.uint64(40)
_S48 = np.uint64(48)
_S56 = np.uint64(56)
_ZERO = np.uint64(0)


def _frozen(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
    # Read-only like the arrays np.frombuffer makes of Arrow buffers, so numba
    # compiles one specialization per layout, not one more for these stand-ins.
    a.flags.writeable = False
    return a


_NO_BITMAP: U8 = _frozen(np.empty(0, dtype=np.uint8))  # type: ignore[assignment]
_NO_OFFSETS: npt.NDArray[np.int32] = _frozen(np.empty(0, dtype=np.int32))  # type: ignore[assignment]


# The helpers below are loop-free on purpose: numba inlines "always" functions
# at the IR level, and one that loops over an array argument keeps a reference
# count on it per call: an atomic add and a function call per value.
@nb.njit(nogil=True, cache=True, inline="always")
def _round(h: np.uint64, w: np.uint64) -> np.uint64:
    # A bijection of h for fixed w and of w for fixed h: strings of equal length
    # that differ only in their last word never collide.
    x = h ^ (w * _P2)
    return ((x << _S31) | (x >> _S33)) * _P1


@nb.njit(nogil=True, cache=True, inline="always")
def _load8(data: U8, p: np.uint64) -> np.uint64:
    # Little-endian by construction, so ids do not depend on the machine.
    return (
        np.uint64(data[p])
        | (np.uint64(data[p + _B1]) << _B8)
        | (np.uint64(data[p + _B2]) << _S16)
        | (np.uint64(data[p + _B3]) << _S24)
        | (np.uint64(data[p + _B4]) << _S32)
        | (np.uint64(data[p + _B5]) << _S40)
        | (np.uint64(data[p + _B6]) << _S48)
        | (np.uint64(data[p + _B7]) << _S56)
    )


@nb.njit(nogil=True, cache=True, inline="always")
def _is_valid(bitmap: U8, i: int) -> bool:
    # An empty bitmap means "no nulls" (Arrow omits it then, and so do we).
    return bool(bitmap.shape[0] == 0 or ((bitmap[i >> 3] >> (i & 7)) & 1) == 1)


@nb.njit(nogil=True, cache=True)
def _hash_strings(
    is_list: bool,
    list_offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    list_validity: U8,
    list_start: int,
    n: int,
    offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    data: U8,
    validity: U8,
    start: int,
    seed: np.uint64,
    out_ids: U64,
    pos: int,
    out_lens: I32,
) -> int:
    """Hash ``n`` records (strings, or lists of strings) into ``out_ids[pos:]``.

    Element ``j`` (a logical index) lives at ``start + j`` in the buffers; a
    single-hot record ``i`` is element ``i``. Returns the new ``pos``.
    """
    for i in range(n):
        if is_list:
            r = list_start + i
            if not _is_valid(list_validity, r):
                out_lens[i] = 0
                continue
            j0 = np.int64(list_offsets[r])
            j1 = np.int64(list_offsets[r + 1])
        else:
            j0 = np.int64(i)
            j1 = np.int64(i + 1)
        first = pos
        for j in range(j0, j1):
            e = start + j
            if not _is_valid(validity, e):
                continue
            a = np.uint64(offsets[e])
            b = np.uint64(offsets[e + 1])
            h = seed ^ ((b - a) * _P1)
            p = a
            while p + _B8 <= b:
                h = _round(h, _load8(data, p))
                p += _B8
            if p < b:
                w = _ZERO
                shift = _ZERO
                while p < b:
                    w |= np.uint64(data[p]) << shift
                    shift += _B8
                    p += _B1
                h = _round(h, w)
            out_ids[pos] = mix64(h)
            pos += 1
        out_lens[i] = pos - first
    return pos


@nb.njit(nogil=True, cache=True)
def _hash_ints(
    is_list: bool,
    list_offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    list_validity: U8,
    list_start: int,
    n: int,
    values: U64,
    validity: U8,
    start: int,
    lo: np.uint64,
    hi: np.uint64,
    out_ids: U64,
    pos: int,
    out_lens: I32,
) -> int:
    """``_hash_strings`` for int64 values (read as their uint64 bit patterns)."""
    for i in range(n):
        if is_list:
            r = list_start + i
            if not _is_valid(list_validity, r):
                out_lens[i] = 0
                continue
            j0 = np.int64(list_offsets[r])
            j1 = np.int64(list_offsets[r + 1])
        else:
            j0 = np.int64(i)
            j1 = np.int64(i + 1)
        first = pos
        for j in range(j0, j1):
            e = start + j
            if not _is_valid(validity, e):
                continue
            out_ids[pos] = mix64(mix64(values[e] ^ lo) + hi)
            pos += 1
        out_lens[i] = pos - first
    return pos


@nb.njit(nogil=True, cache=True)
def _hash_elements(
    is_string: npt.NDArray[np.bool_],
    field_of: I32,
    string_offsets: npt.NDArray[np.int64],
    data: U8,
    ints: U64,
    string_seeds: U64,
    int_lo: U64,
    int_hi: U64,
    out_ids: U64,
) -> None:
    """One id per element of a flat sequence mixing fields and kinds.

    Element ``e`` is field ``field_of[e]``'s; the ``k``-th string element is
    ``data[string_offsets[k]:string_offsets[k + 1]]`` and the ``k``-th int
    element ``ints[k]``. The arithmetic is ``_hash_strings``' and ``_hash_ints``'
    (the module docstring's); it is written out here rather than shared through
    an inline helper, because an inlined loop over an array argument costs a
    reference count per call (see the helpers above).
    """
    s = 0
    k = 0
    for e in range(is_string.shape[0]):
        f = field_of[e]
        if is_string[e]:
            a = np.uint64(string_offsets[s])
            b = np.uint64(string_offsets[s + 1])
            s += 1
            h = string_seeds[f] ^ ((b - a) * _P1)
            p = a
            while p + _B8 <= b:
                h = _round(h, _load8(data, p))
                p += _B8
            if p < b:
                w = _ZERO
                shift = _ZERO
                while p < b:
                    w |= np.uint64(data[p]) << shift
                    shift += _B8
                    p += _B1
                h = _round(h, w)
            out_ids[e] = mix64(h)
        else:
            out_ids[e] = mix64(mix64(ints[k] ^ int_lo[f]) + int_hi[f])
            k += 1


class ValueHasher:
    """Ids of values held as Python objects, several fields in one kernel call.

    The ids ``hash_sparse`` gives the same values in their columns, for callers
    that hold a few records as Python objects (a prediction server's request):
    one pass over every field's values instead of one call per field. A ``str``
    value is hashed as a string, an ``int`` (within int64) as an integer; the
    caller checks the types.

    >>> hasher = ValueHasher(["user", "tags"])
    >>> ids = hasher.ids([0, 1, 1], ["abc", 12, "12"])
    >>> [int(i) for i in ids] == [
    ...     feature_id("user", "abc"), feature_id("tags", 12), feature_id("tags", "12")]
    True
    """

    def __init__(self, fields: Sequence[str]) -> None:
        self.fields = tuple(fields)
        seeds = [FieldSeeds.of(f) for f in self.fields]
        self._string = np.array([s.string for s in seeds], dtype=np.uint64)
        self._lo = np.array([s.int_lo for s in seeds], dtype=np.uint64)
        self._hi = np.array([s.int_hi for s in seeds], dtype=np.uint64)

    def ids(self, field_of: Sequence[int], values: Sequence[str | int]) -> U64:
        """The id of each value: ``values[e]`` of field ``fields[field_of[e]]``."""
        n = len(values)
        where = np.asarray(field_of, dtype=np.int32)
        if where.shape != (n,) or (n and (where.min() < 0 or where.max() >= len(self.fields))):
            msg = (
                f"field_of must hold {n} indices in [0, {len(self.fields)}), "
                f"got {where.shape[0]} in [{where.min(initial=0)}, {where.max(initial=0)}]"
            )
            raise ValueError(msg)
        strings = [v.encode() for v in values if type(v) is str]
        offsets = np.zeros(len(strings) + 1, dtype=np.int64)
        if strings:
            np.cumsum([len(b) for b in strings], out=offsets[1:])
        out = np.empty(n, dtype=np.uint64)
        _hash_elements(
            np.array([type(v) is str for v in values], dtype=np.bool_),
            where,
            offsets,
            np.frombuffer(b"".join(strings), dtype=np.uint8),
            np.array([v for v in values if type(v) is not str], dtype=np.int64).view(np.uint64),
            self._string,
            self._lo,
            self._hi,
            out,
        )
        return out

    def scanned_ids(
        self,
        is_string: npt.NDArray[np.bool_],
        field_of: I32,
        string_offsets: npt.NDArray[np.int64],
        strings: U8,
        ints: npt.NDArray[np.int64],
    ) -> U64:
        """The ids of values already laid out as arrays (``pipeline.json_scan``): element
        ``e`` is field ``field_of[e]``'s; the ``k``-th string element is the UTF-8
        bytes ``strings[string_offsets[k]:string_offsets[k + 1]]``, the ``k``-th int
        element ``ints[k]``.

        >>> hasher = ValueHasher(["user", "tags"])
        >>> ids = hasher.scanned_ids(np.array([True, False]), np.array([0, 1], np.int32),
        ...     np.array([0, 3]), np.frombuffer(b"abc", np.uint8), np.array([12]))
        >>> [int(i) for i in ids] == [feature_id("user", "abc"), feature_id("tags", 12)]
        True
        """
        out = np.empty(is_string.shape[0], dtype=np.uint64)
        _hash_elements(
            is_string, field_of, string_offsets, strings, ints.view(np.uint64),
            self._string, self._lo, self._hi, out,
        )  # fmt: skip
        return out


@dataclass(frozen=True)
class FieldSeeds:
    """The per-field seeds of the string and integer hashes (see the module doc)."""

    string: np.uint64
    int_lo: np.uint64
    int_hi: np.uint64

    @classmethod
    def of(cls, field: str) -> FieldSeeds:
        """The seeds of ``field``; the same on every machine.

        >>> FieldSeeds.of("user") == FieldSeeds.of("user") != FieldSeeds.of("item")
        True
        """
        return _field_seeds(field)


@functools.lru_cache(maxsize=4096)
def _field_seeds(field: str) -> FieldSeeds:
    # A pure function of the name, asked once per field per batch: two blake2b
    # digests per field each time are a noticeable part of a one-record request.
    name = field.encode()
    s = hashlib.blake2b(b"streamrec/string\x00" + name, digest_size=8).digest()
    i = hashlib.blake2b(b"streamrec/int\x00" + name, digest_size=16).digest()
    return FieldSeeds(
        string=np.uint64(int.from_bytes(s, "little")),
        int_lo=np.uint64(int.from_bytes(i[:8], "little")),
        int_hi=np.uint64(int.from_bytes(i[8:], "little")),
    )


def _bitmap(arr: pa.Array) -> U8:
    buf = arr.buffers()[0]
    if arr.null_count == 0 or buf is None:
        return _NO_BITMAP
    return np.frombuffer(buf, dtype=np.uint8)


def _offsets(arr: pa.Array, buf_index: int) -> npt.NDArray[np.int32] | npt.NDArray[np.int64]:
    buf = arr.buffers()[buf_index]
    if _is_large(arr.type):
        return np.frombuffer(bytes(8) if buf is None else buf, dtype=np.int64)
    # A buffer is missing only from a zero-length array.
    return np.frombuffer(bytes(4) if buf is None else buf, dtype=np.int32)


def _is_large(t: pa.DataType) -> bool:
    return bool(pa.types.is_large_string(t) or pa.types.is_large_list(t))


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _normalize(field: str, arr: pa.Array, kind: SparseKind) -> pa.Array:
    """``arr`` in a layout the kernels read, or a TypeError naming the field."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_null(t):
        return arr  # every record missing: empty bags, whatever the kind
    if getattr(pa.types, "is_string_view", lambda _: False)(t):  # pyarrow >= 16
        arr = pc.cast(arr, pa.large_string())
        t = arr.type
    ok = False
    if kind == "string":
        ok = _is_string(t)
    elif kind == "int":
        ok = pa.types.is_integer(t)
        if ok:
            arr = _as_int64(arr)
    elif _is_list(t):
        vt = t.value_type
        if kind == "list_string":
            ok = _is_string(vt)
        else:
            ok = pa.types.is_integer(vt)
            if ok and vt != pa.int64():
                target = pa.large_list(pa.int64()) if _is_large(t) else pa.list_(pa.int64())
                # As in _as_int64: uint64 by bit pattern, the rest by value.
                arr = arr.view(target) if vt == pa.uint64() else pc.cast(arr, target)
    if not ok:
        msg = (
            f"sparse field {field!r} is declared {kind!r} but its column has Arrow type "
            f"{t}; the decoder must produce "
            + {
                "string": "string or large_string",
                "int": "an integer type",
                "list_string": "list<string> or large_list<string>",
                "list_int": "list<integer> or large_list<integer>",
            }[kind]
        )
        raise TypeError(msg)
    return arr


def _as_int64(arr: pa.Array) -> pa.Array:
    # uint64 keeps its bit pattern (a cast would reject values >= 2**63); the
    # narrower types widen by value, so 5 as int8 and 5 as int64 get one id.
    if arr.type == pa.int64():
        return arr
    if arr.type == pa.uint64():
        return arr.view(pa.int64())
    return pc.cast(arr, pa.int64())


def _bound(arr: pa.Array) -> int:
    """An upper bound on the values ``arr`` (normalized) yields."""
    if pa.types.is_null(arr.type):
        return 0
    if _is_list(arr.type):
        off = _offsets(arr, 1)
        return int(off[arr.offset + len(arr)] - off[arr.offset])
    return int(len(arr) - arr.null_count)


def _chunks(column: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    if isinstance(column, pa.ChunkedArray):
        return list(column.chunks)
    return [column]


class FieldHasher:
    """One field's column, checked, ready to hash into buffers the caller owns.

    ``bound`` is an upper bound on the ids it yields, so a caller hashing several
    fields (``build_batch``: every field of one embedding table) allocates once
    and writes them back to back.

    >>> h = FieldHasher("tags", pa.array([["a"], ["b", "c"]]), "list_string")
    >>> ids, lens = np.empty(h.bound, dtype=np.uint64), np.empty(h.num_records, dtype=np.int32)
    >>> h.into(ids, 0, lens), lens.tolist()
    (3, [1, 2])
    """

    def __init__(self, field: str, column: pa.Array | pa.ChunkedArray, kind: SparseKind) -> None:
        self.field = field
        self.kind = kind
        self.chunks = [_normalize(field, c, kind) for c in _chunks(column)]
        self.num_records = sum(len(c) for c in self.chunks)
        self.bound = sum(_bound(c) for c in self.chunks)
        self.seeds = FieldSeeds.of(field)

    def into(self, out_ids: U64, pos: int, out_lens: I32) -> int:
        """Write the ids from ``out_ids[pos]`` on and one length per record; the new pos."""
        # The kernels do not check bounds (numba's default), so this check is what
        # stands between a short buffer and a corrupted heap.
        if (
            out_ids.dtype != np.uint64
            or out_lens.dtype != np.int32
            or not 0 <= pos <= out_ids.shape[0] - self.bound
            or out_lens.shape[0] < self.num_records
        ):
            msg = (
                f"field {self.field!r} needs uint64 room for {self.bound} ids from {pos} and "
                f"int32 room for {self.num_records} lengths; got {out_ids.dtype}"
                f"[{out_ids.shape[0]}] and {out_lens.dtype}[{out_lens.shape[0]}]"
            )
            raise ValueError(msg)
        rec = 0
        for c in self.chunks:
            n = len(c)
            lens = out_lens[rec : rec + n]
            rec += n
            if n == 0:
                continue
            if pa.types.is_null(c.type):
                lens[:] = 0
                continue
            if _is_list(c.type):
                values = c.values
                head = (True, _offsets(c, 1), _bitmap(c), c.offset, n)
            else:
                values = c
                head = (False, _NO_OFFSETS, _NO_BITMAP, 0, n)
            if _is_string(values.type):
                data = values.buffers()[2]
                pos = _hash_strings(
                    *head,
                    _offsets(values, 1),
                    np.frombuffer(b"" if data is None else data, dtype=np.uint8),
                    _bitmap(values),
                    values.offset,
                    self.seeds.string,
                    out_ids,
                    pos,
                    lens,
                )
            else:
                buf = values.buffers()[1]
                pos = _hash_ints(
                    *head,
                    np.frombuffer(b"" if buf is None else buf, dtype=np.uint64),
                    _bitmap(values),
                    values.offset,
                    self.seeds.int_lo,
                    self.seeds.int_hi,
                    out_ids,
                    pos,
                    lens,
                )
        return pos


def hash_sparse(field: str, array: pa.Array | pa.ChunkedArray, kind: SparseKind) -> tuple[U64, I32]:
    """The ids of every record's values and the number of ids per record.

    ``string`` and ``int`` fields give 0 ids (null) or 1 per record; ``list_*``
    fields give one id per non-null element (a null list is an empty bag).
    Integer columns of any width are read as int64 values (uint64 by bit
    pattern); large, sliced, dictionary-encoded and chunked columns are
    accepted, and an all-null (``pa.null()``) column gives empty bags.

    >>> ids, lengths = hash_sparse("user", pa.array([3, None, 3], pa.int8()), "int")
    >>> lengths.tolist(), len(ids), bool(ids[0] == ids[1])
    ([1, 0, 1], 2, True)
    >>> hash_sparse("user", pa.array([1.5]), "int")
    Traceback (most recent call last):
    ...
    TypeError: sparse field 'user' is declared 'int' but its column has Arrow type double; \
the decoder must produce an integer type
    """
    hasher = FieldHasher(field, array, kind)
    ids = np.empty(hasher.bound, dtype=np.uint64)
    lengths = np.empty(hasher.num_records, dtype=np.int32)
    n = hasher.into(ids, 0, lengths)
    return ids[:n], lengths


def feature_id(field: str, value: str | int) -> int:
    """The id of one value of ``field``, as ``hash_sparse`` computes it.

    >>> feature_id("user", "abc") == feature_id("user", "abc")
    True
    >>> feature_id("user", "1") == feature_id("user", 1)
    False
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        msg = f"feature_id takes a str or an int, got {type(value).__name__}"
        raise TypeError(msg)
    if isinstance(value, str):
        ids, _ = hash_sparse(field, pa.array([value], pa.string()), "string")
    else:
        typ = pa.uint64() if value >= 1 << 63 else pa.int64()
        ids, _ = hash_sparse(field, pa.array([value], typ), "int")
    return int(ids[0])
