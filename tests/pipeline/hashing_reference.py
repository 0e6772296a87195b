"""A pure-Python reference of the documented feature hash, for the hashing tests.

It reads a record as ``to_pylist()`` shows it and hashes it with Python
integers, so the kernels can be held to it bit for bit.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa

MASK = (1 << 64) - 1
P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F


def ref_mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def ref_round(h: int, w: int) -> int:
    x = h ^ ((w * P2) & MASK)
    return ((((x << 31) | (x >> 33)) & MASK) * P1) & MASK


def ref_string_id(field: str, value: str) -> int:
    seed = int.from_bytes(
        hashlib.blake2b(b"streamrec/string\x00" + field.encode(), digest_size=8).digest(), "little"
    )
    data = value.encode("utf-8")
    h = seed ^ ((len(data) * P1) & MASK)
    for p in range(0, len(data), 8):
        h = ref_round(h, int.from_bytes(data[p : p + 8], "little"))
    return ref_mix64(h)


def ref_int_id(field: str, value: int) -> int:
    digest = hashlib.blake2b(b"streamrec/int\x00" + field.encode(), digest_size=16).digest()
    lo, hi = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
    return ref_mix64((ref_mix64((value & MASK) ^ lo) + hi) & MASK)


def ref_value_id(field: str, value: str | int) -> int:
    return ref_string_id(field, value) if isinstance(value, str) else ref_int_id(field, value)


def ref_record_ids(field: str, record: Any, kind: str) -> list[int]:
    """The ids of one record, as ``to_pylist()`` shows it."""
    if record is None:
        return []
    values = record if kind.startswith("list_") else [record]
    return [ref_value_id(field, v) for v in values if v is not None]


def ref_hash(
    field: str, column: pa.Array | pa.ChunkedArray, kind: str
) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    lengths: list[int] = []
    for record in column.to_pylist():
        got = ref_record_ids(field, record, kind)
        ids.extend(got)
        lengths.append(len(got))
    return ids, lengths
