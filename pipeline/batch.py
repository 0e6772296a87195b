"""Building a ``PreparedBatch`` from a validated Arrow table.

Labels and dense features become float32 matrices (missing dense values filled,
then transformed and clipped); sparse fields are hashed per field
(``pipeline.hashing``), then, per embedding table, laid out sample-major and
deduplicated in one pass: bag ``b * F + f`` holds field ``f`` of sample ``b``,
and ``unique_ids`` lists each id once, in order of first appearance, so the
same table always gives the same batch.

>>> import pyarrow as pa
>>> from connectors.spec import DenseField, FeatureSpec
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"],
...     "dense": [{"name": "price", "transform": "log1p"}],
...     "sparse": [{"name": "user", "table": "ids"}, {"name": "item", "table": "ids"}],
... })
>>> table = pa.table({"click": [1, 0], "price": [0.0, None],
...                   "user": ["u1", "u2"], "item": ["i1", None]})
>>> batch = build_batch(table, spec)
>>> batch.labels.tolist(), batch.dense.tolist()
([[1.0], [0.0]], [[0.0], [0.0]])
>>> ids = batch.tables["ids"]
>>> ids.fields, ids.offsets.tolist(), ids.inverse.tolist(), ids.pooling
(('user', 'item'), [0, 1, 2, 3, 3], [0, 1, 2], ('sum', 'sum'))
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from connectors.spec import DenseField, FeatureSpec
from pipeline.hashing import U64, FieldHasher
from pipeline.types import PreparedBatch, TableBatch

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

_INT32_MAX = (1 << 31) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
# The dedup map starts small and doubles: most fields of a batch have few
# distinct values, and a map that stays in L1 beats one sized for every id
# (zeroing 16 bytes per slot for 10^5 ids per field costs more than the dedup).
_MIN_BITS = 10


@nb.njit(nogil=True, cache=True)
def _rehash(unique: U64, u: int, bits: int) -> U64:
    """A fresh map of ``2**bits`` slots holding ``unique[:u]``."""
    cap = 1 << bits
    mask = cap - 1
    shift = np.uint64(64 - bits)
    table = np.zeros(2 * cap, dtype=np.uint64)
    for k in range(u):
        x = unique[k]
        s = np.int64(((x ^ (x >> _S32)) * _GOLDEN) >> shift)
        while table[2 * s + 1] != _ZERO:
            s = (s + 1) & mask
        table[2 * s] = x
        table[2 * s + 1] = np.uint64(k + 1)
    return table


@nb.njit(nogil=True, cache=True)
def dedup_bags(ids: U64, starts: I64, lengths: I32, total: int) -> tuple[U64, I32, I32]:
    """Sample-major bags of ``F`` fields' ids, deduplicated.

    Field ``f``'s ids are ``ids[starts[f]:]``, ``lengths[f, b]`` of them for
    sample ``b``. Returns ``(unique, inverse, offsets)`` with ``unique`` in order
    of first appearance in bag order.
    """
    F = lengths.shape[0]
    B = lengths.shape[1]
    offsets = np.empty(B * F + 1, dtype=np.int32)
    offsets[0] = 0
    inverse = np.empty(total, dtype=np.int32)
    unique = np.empty(total, dtype=np.uint64)
    bits = _MIN_BITS
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    # Open addressing, linear probing, load <= 1/2; slot s is (key, index + 1)
    # side by side so a probe touches one cache line; index 0 marks it empty.
    table = np.zeros(2 << bits, dtype=np.uint64)
    cur = starts.copy()
    u = 0
    pos = 0
    for b in range(B):
        for f in range(F):
            c = cur[f]
            n = lengths[f, b]
            for k in range(c, c + n):
                x = ids[k]
                s = np.int64(((x ^ (x >> _S32)) * _GOLDEN) >> shift)
                while True:
                    tag = table[2 * s + 1]
                    if tag == _ZERO:
                        table[2 * s] = x
                        table[2 * s + 1] = np.uint64(u + 1)
                        unique[u] = x
                        inverse[pos] = u
                        u += 1
                        if 2 * u > mask + 1:
                            bits += 1
                            mask = (1 << bits) - 1
                            shift = np.uint64(64 - bits)
                            table = _rehash(unique, u, bits)
                        break
                    if table[2 * s] == x:
                        inverse[pos] = np.int32(tag - _ONE)
                        break
                    s = (s + 1) & mask
                pos += 1
            cur[f] = c + n
            offsets[b * F + f + 1] = pos
    return unique[:u].copy(), inverse, offsets


@nb.njit(nogil=True, cache=True)
def dedup_tables(
    ids: U64, starts: I64, lengths: I32, firsts: I64
) -> tuple[U64, I64, I32, I32, I64]:
    """:func:`dedup_bags` for every table in one call (a request's batch has a few ids
    in each of dozens of tables, and a call each cost more than the work).

    Table ``t`` has the fields ``firsts[t]`` to ``firsts[t + 1] - 1``, their ids side
    by side (field ``f``'s from ``ids[starts[f]]``, ``starts[F]`` the end). Returns
    ``(unique, unique_bounds, inverse, offsets, offset_bounds)``: table ``t``'s
    ``dedup_bags`` answer is ``unique[unique_bounds[t]:unique_bounds[t + 1]]``,
    ``inverse[starts[firsts[t]]:starts[firsts[t + 1]]]`` (into its own unique
    ids) and ``offsets[offset_bounds[t]:offset_bounds[t + 1]]``.

    >>> ids = np.array([7, 7, 3, 9, 3], np.uint64)  # field 0: 7 7 | field 1: 3 | field 2: 9 3
    >>> starts = np.array([0, 2, 3, 5], np.int64)
    >>> lengths = np.array([[1, 1], [1, 0], [1, 1]], np.int32)  # [field, sample]
    >>> out = dedup_tables(ids, starts, lengths, np.array([0, 1, 3], np.int64))
    >>> [a.tolist() for a in out]
    [[7, 3, 9], [0, 1, 3], [0, 0, 0, 1, 0], [0, 1, 2, 0, 1, 2, 2, 3], [0, 3, 8]]
    """
    T = firsts.shape[0] - 1
    B = lengths.shape[1]
    total = starts[firsts[T]] - starts[firsts[0]]
    unique = np.empty(total, dtype=np.uint64)
    inverse = np.empty(total, dtype=np.int32)
    unique_bounds = np.zeros(T + 1, dtype=np.int64)
    offset_bounds = np.zeros(T + 1, dtype=np.int64)
    for t in range(T):
        offset_bounds[t + 1] = offset_bounds[t] + B * (firsts[t + 1] - firsts[t]) + 1
    offsets = np.empty(offset_bounds[T], dtype=np.int32)
    for t in range(T):
        f0, f1 = firsts[t], firsts[t + 1]
        lo, hi = starts[f0], starts[f1]
        u, inv, off = dedup_bags(ids[lo:hi], starts[f0:f1] - lo, lengths[f0:f1], hi - lo)
        n = u.shape[0]
        unique[unique_bounds[t] : unique_bounds[t] + n] = u
        unique_bounds[t + 1] = unique_bounds[t] + n
        inverse[lo - starts[firsts[0]] : hi - starts[firsts[0]]] = inv
        offsets[offset_bounds[t] : offset_bounds[t + 1]] = off
    return unique[: unique_bounds[T]].copy(), unique_bounds, inverse, offsets, offset_bounds


def dedup(ids: npt.ArrayLike) -> tuple[U64, I32]:
    """``(unique, inverse)`` with ``unique[inverse] == ids``; unique in first-seen order.

    A hash map, not a sort: linear in ``len(ids)``, faster than ``np.unique``
    on a batch's ids (``benchmarks/hashing_micro.py`` compares the two), and the
    order does not depend on the values.

    >>> unique, inverse = dedup(np.array([9, 4, 9, 7, 4], dtype=np.uint64))
    >>> unique.tolist(), inverse.tolist()
    ([9, 4, 7], [0, 1, 0, 2, 1])
    """
    arr = np.ascontiguousarray(ids, dtype=np.uint64).reshape(-1)
    n = arr.shape[0]
    if n > _INT32_MAX:
        msg = f"dedup takes at most {_INT32_MAX} ids (int32 inverse), got {n}"
        raise ValueError(msg)
    unique, inverse, _ = dedup_bags(
        arr, np.zeros(1, dtype=np.int64), np.full((1, 1), n, dtype=np.int32), n
    )
    return unique, inverse


def _column(table: pa.Table, name: str, role: str) -> pa.ChunkedArray:
    i = table.schema.get_field_index(name)  # -1 if absent or ambiguous
    if i < 0:
        how = "is twice in" if name in table.column_names else "is not a column of"
        msg = f"{role} field {name!r} {how} the batch (columns: {table.column_names})"
        raise KeyError(msg)
    return table.column(i)


def _as_float64(col: pa.ChunkedArray, name: str, role: str, fill: float | None) -> F64:
    """A numeric column as a fresh float64 array, nulls replaced by ``fill``.

    Reads the Arrow value buffers directly: a pyarrow cast plus fill_null costs
    three times as much, and dense columns are a large share of a batch's time.
    """
    t = col.type
    if not (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_null(t)
    ):
        msg = f"{role} field {name!r} must be numeric, but its column has Arrow type {t}"
        raise TypeError(msg)
    if col.null_count and fill is None:
        why = "a label is never filled" if role == "label" else "the field has no fill"
        msg = (
            f"{role} field {name!r} is missing in {col.null_count} records and {why}: "
            f"validation must drop those records"
        )
        raise ValueError(msg)
    out = np.empty(len(col), dtype=np.float64)
    at = 0
    for chunk in col.chunks:
        n = len(chunk)
        dst = out[at : at + n]
        at += n
        if n == 0:
            continue
        if chunk.null_count == n:  # includes pa.null()
            dst[:] = fill
            continue
        if pa.types.is_boolean(t):  # bit-packed values: let Arrow unpack them
            dst[:] = pc.cast(chunk, pa.float64()).to_numpy(zero_copy_only=False)
        else:
            values = np.frombuffer(chunk.buffers()[1], dtype=t.to_pandas_dtype())
            dst[:] = values[chunk.offset : chunk.offset + n]
        if chunk.null_count and fill is not None:  # fill is set: checked above
            bits = np.frombuffer(chunk.buffers()[0], dtype=np.uint8)
            valid = np.unpackbits(bits, count=chunk.offset + n, bitorder="little")
            np.putmask(dst, valid[chunk.offset :] == 0, fill)
    return out


def label_matrix(table: pa.Table, spec: FeatureSpec) -> F32:
    """The labels as float32 ``[B, T]``, in spec order (booleans read as 0/1).

    >>> from connectors.spec import FeatureSpec
    >>> spec = FeatureSpec(labels=["click", "buy"])
    >>> label_matrix(pa.table({"buy": [False, True], "click": [1, 1]}), spec).tolist()
    [[1.0, 0.0], [1.0, 1.0]]
    """
    out = np.empty((table.num_rows, len(spec.labels)), dtype=np.float32)
    fill = None if spec.labels_required else math.nan
    for j, name in enumerate(spec.labels):
        out[:, j] = _as_float64(_column(table, name, "label"), name, "label", fill)
    return out


def dense_matrix(table: pa.Table, spec: FeatureSpec) -> F32:
    """The dense features as float32 ``[B, D]``, in spec order.

    Per field: nulls become ``fill``, then ``transform`` applies (``log1p``, or
    ``signed_log1p`` = sign(x) * log1p(|x|)), then values are clipped to
    ``[clip_min, clip_max]``. Ranges and NaNs are validation's job: a record
    out of ``[min_value, max_value]`` never reaches here. The arithmetic is
    float64, rounded to float32 once at the end.

    >>> from connectors.spec import FeatureSpec
    >>> spec = FeatureSpec.model_validate({"labels": ["y"], "dense": [
    ...     {"name": "n", "fill": -3.0, "transform": "signed_log1p", "clip_min": -1.0}]})
    >>> dense_matrix(pa.table({"n": [None, 0.0, float(np.e - 1)]}), spec).round(3).tolist()
    [[-1.0], [0.0], [1.0]]
    """
    out = np.empty((table.num_rows, len(spec.dense)), dtype=np.float32)
    for j, d in enumerate(spec.dense):
        x = _as_float64(_column(table, d.name, "dense"), d.name, "dense", d.fill)
        transform_dense(x, d)
        out[:, j] = x
    return out


def transform_dense(x: F64, d: DenseField) -> None:
    """``d``'s transform, then its clipping, applied to filled values ``x`` in place.

    In place because ``x`` is the caller's, and each temporary of 10^5 doubles
    costs as much as the operation.

    >>> from connectors.spec import DenseField
    >>> x = np.array([-1.0, 0.0, 3.0])
    >>> transform_dense(x, DenseField(name="n", transform="signed_log1p", clip_max=1.0))
    >>> x.round(3).tolist()
    [-0.693, 0.0, 1.0]
    """
    if d.transform == "log1p":
        np.log1p(x, out=x)
    elif d.transform == "signed_log1p":
        sign = np.sign(x)
        np.log1p(np.abs(x, out=x), out=x)
        np.multiply(x, sign, out=x)
    if d.clip_min is not None or d.clip_max is not None:
        np.clip(x, d.clip_min, d.clip_max, out=x)


def build_batch(table: pa.Table, spec: FeatureSpec) -> PreparedBatch:
    """Labels, dense features and deduplicated sparse ids of a validated table.

    One ``TableBatch`` per embedding table (``spec.tables()`` order), with its
    fields in spec order, sample-major bags and ``rows=None`` (the store lookup
    fills them). ``source``, ``partition``, ``start`` and ``end`` are left at
    their defaults for the caller to set.

    >>> import pyarrow as pa
    >>> from connectors.spec import FeatureSpec
    >>> spec = FeatureSpec.model_validate({"labels": ["y"], "sparse": [
    ...     {"name": "tags", "table": "tags", "type": "list_int", "pooling": "mean"}]})
    >>> t = build_batch(pa.table({"y": [1.0, 0.0], "tags": [[5, 6, 5], None]}), spec)
    >>> tb = t.tables["tags"]
    >>> len(t), tb.offsets.tolist(), tb.inverse.tolist(), len(tb.unique_ids), tb.pooling
    (2, [0, 3, 3], [0, 1, 0], 2, ('mean',))
    """
    num_rows = table.num_rows
    tables: dict[str, TableBatch] = {}
    for name, fields in spec.tables().items():
        specs = [spec.field(f) for f in fields]
        hashers = [FieldHasher(s.name, _column(table, s.name, "sparse"), s.type) for s in specs]
        bound = sum(h.bound for h in hashers)
        if bound > _INT32_MAX or num_rows * len(fields) >= _INT32_MAX:
            msg = (
                f"table {name!r} gets {bound} ids in {num_rows} x {len(fields)} bags, "
                f"more than int32 offsets hold: make the batch smaller"
            )
            raise ValueError(msg)
        ids = np.empty(bound, dtype=np.uint64)
        lengths = np.empty((len(fields), num_rows), dtype=np.int32)
        starts = np.empty(len(fields), dtype=np.int64)
        pos = 0
        for f, h in enumerate(hashers):
            starts[f] = pos
            pos = h.into(ids, pos, lengths[f])
        unique, inverse, offsets = dedup_bags(ids, starts, lengths, pos)
        tables[name] = TableBatch(
            fields=fields,
            unique_ids=unique,
            inverse=inverse,
            offsets=offsets,
            pooling=tuple(s.pooling for s in specs),
        )
    return PreparedBatch(
        labels=label_matrix(table, spec),
        dense=dense_matrix(table, spec),
        tables=tables,
    )
