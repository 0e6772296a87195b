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
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from embedding_store.errors import InvalidRequest
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.types import RowDtype

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
