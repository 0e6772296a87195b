"""A few records held as Python objects, straight to the batch ``build_batch`` makes.

A prediction server's request is often one record. On the columnar path
(decode to Arrow, :func:`connectors.validate.check`, :func:`pipeline.batch.build_batch`)
its cost is per field, not per record: a cast, a check and a hash call for each
of some 40 fields of a Criteo-like record. :class:`PlainBatchBuilder`
takes records already parsed (``JsonLinesCodec.plain_objects``) and builds the
same ``PreparedBatch`` in one pass over their values, with the training path's
hash (:class:`pipeline.hashing.ValueHasher`), dedup (``dedup_tables``) and dense
transforms (``transform_dense``).

It only ever accepts. A record holding anything it is not sure of (a value of
another type than its field's, a bool, a null inside a list, an int beyond
int64 or a number field's int beyond 2**53, a number outside its field's range,
NaN or infinity, a list over ``max_len``, a missing value without a fill, a
string that is not valid Unicode) makes it return None: the caller then takes
the columnar path, which decides and names what is wrong. So the two paths
cannot disagree about which records are good, and the tests hold this one to
the columnar one value for value.

>>> from connectors.spec import FeatureSpec
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"], "labels_required": False,
...     "dense": [{"name": "price", "transform": "log1p"}],
...     "sparse": [{"name": "user", "table": "ids"}, {"name": "item", "table": "ids"}],
... })
>>> builder = PlainBatchBuilder(spec)
>>> batch = builder.build([{"price": 0, "user": "u1", "item": "i1"}, {"user": "u1"}])
>>> batch.dense.tolist(), batch.tables["ids"].offsets.tolist(), batch.tables["ids"].inverse.tolist()
([[0.0], [0.0]], [0, 1, 2, 3, 3], [0, 1, 0])
>>> builder.build([{"user": 7}]) is None  # an int in a string field: the columnar path says why
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.spec import FeatureSpec, SparseField
from pipeline.batch import dedup_tables, transform_dense
from pipeline.hashing import ValueHasher
from pipeline.types import FlatIds, PreparedBatch, TableBatch

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
# Ints a double holds exactly: beyond them the columnar path rounds through Arrow's
# cast, and this path does not try to round the same way.
_EXACT = 1 << 53


def _number(value: object) -> float | None:
    """``value`` as a float when it is plainly a finite number (not a bool); else None."""
    kind = type(value)
    if kind is float:
        x: float = value  # type: ignore[assignment]
        return x if math.isfinite(x) else None
    if kind is int:
        i: int = value  # type: ignore[assignment]
        return float(i) if -_EXACT <= i <= _EXACT else None
    return None


def _plain_value(value: object, kind: str) -> bool:
    if kind == "string":
        return type(value) is str
    return type(value) is int and _INT64_MIN <= value <= _INT64_MAX


class PlainBatchBuilder:
    """Builds ``build_batch``'s batch from plainly good records, or answers None."""

    def __init__(self, spec: FeatureSpec) -> None:
        self.spec = spec
        tables = spec.tables()
        # Sparse fields table by table, so that each table's values lie side by side.
        self.sparse_fields: list[SparseField] = [
            spec.field(f) for fs in tables.values() for f in fs
        ]
        self.hasher = ValueHasher([s.name for s in self.sparse_fields])
        self._tables: list[tuple[str, tuple[str, ...], tuple[str, ...], int]] = []
        first = 0
        for name, fields in tables.items():
            pooling = tuple(spec.field(f).pooling for f in fields)
            self._tables.append((name, fields, pooling, first))
            first += len(fields)
        self._firsts = np.array([f for *_, f in self._tables] + [first], dtype=np.int64)

    def build(self, records: Sequence[Mapping[str, object]]) -> PreparedBatch | None:
        """The batch of ``records`` (parsed objects), or None when one is not plainly good."""
        labels = self._labels(records)
        dense = self._dense(records)
        if labels is None or dense is None:
            return None
        field_of: list[int] = []
        values: list[str | int] = []
        lengths: list[int] = []  # field-major: lengths[f * B + b]
        for f, s in enumerate(self.sparse_fields):
            name, kind = s.name, s.type
            single = not kind.startswith("list_")
            element = kind.removeprefix("list_")
            for record in records:
                value = record.get(name)
                if value is None:
                    lengths.append(0)
                elif single:
                    if not _plain_value(value, kind):
                        return None
                    values.append(value)  # type: ignore[arg-type]
                    field_of.append(f)
                    lengths.append(1)
                else:
                    if type(value) is not list or len(value) > s.max_len:
                        return None
                    for v in value:
                        if not _plain_value(v, element):
                            return None
                    values.extend(value)
                    field_of.extend([f] * len(value))
                    lengths.append(len(value))
        try:
            ids = self.hasher.ids(field_of, values)
        except UnicodeEncodeError:  # a lone surrogate: not UTF-8, the columnar path says so
            return None
        n = len(records)
        per_field = np.asarray(lengths, dtype=np.int32).reshape(len(self.sparse_fields), n)
        return self.assemble(ids, per_field, labels, dense)

    def assemble(
        self,
        ids: npt.NDArray[np.uint64],
        per_field: npt.NDArray[np.int32],
        labels: npt.NDArray[np.float32],
        dense: npt.NDArray[np.float32],
    ) -> PreparedBatch:
        """The batch of checked records: ``ids`` of every sparse value, field by field
        (``sparse_fields`` order) and record by record within a field; ``per_field``:
        ``[fields, records]``, how many values each record gives each field."""
        tables = self.tables_of(self.flat_ids(ids, per_field))
        return PreparedBatch(labels=labels, dense=dense, tables=tables)

    def flat_ids(self, ids: npt.NDArray[np.uint64], per_field: npt.NDArray[np.int32]) -> FlatIds:
        """Every table's deduplicated ids (see :meth:`assemble` for the arguments)."""
        starts, table_starts = _field_starts(per_field, self._firsts)
        unique, unique_at, inverse, offsets, offsets_at = dedup_tables(
            ids, starts, per_field, self._firsts
        )
        return FlatIds(unique, unique_at, inverse, table_starts, offsets, offsets_at, self._firsts)

    def tables_of(self, flat: FlatIds) -> dict[str, TableBatch]:
        """One ``TableBatch`` per table, views of ``flat``'s arrays."""
        tables: dict[str, TableBatch] = {}
        u, i, o = flat.unique_at, flat.inverse_at, flat.offsets_at
        for t, (name, fields, pooling, _) in enumerate(self._tables):
            tables[name] = TableBatch(
                fields,
                flat.unique[u[t] : u[t + 1]],
                flat.inverse[i[t] : i[t + 1]],
                flat.offsets[o[t] : o[t + 1]],
                pooling=pooling,
            )
        return tables

    @property
    def table_names(self) -> list[str]:
        """The tables, in the order of :class:`FlatIds`."""
        return [name for name, *_ in self._tables]

    def _labels(self, records: Sequence[Mapping[str, object]]) -> np.ndarray | None:
        required = self.spec.labels_required
        rows = []
        for record in records:
            row = []
            for name in self.spec.labels:
                value = record.get(name)
                if value is None and not required:
                    row.append(math.nan)
                    continue
                x = _number(value)
                if x is None or (required and not 0.0 <= x <= 1.0):
                    return None
                row.append(x)
            rows.append(row)
        return np.array(rows, dtype=np.float32).reshape(len(records), len(self.spec.labels))

    def _dense(self, records: Sequence[Mapping[str, object]]) -> np.ndarray | None:
        rows = []
        for record in records:
            row = []
            for d in self.spec.dense:
                value = record.get(d.name)
                if value is None:
                    if d.fill is None:
                        return None
                    row.append(d.fill)
                    continue
                x = _number(value)
                if (
                    x is None
                    or (d.min_value is not None and x < d.min_value)
                    or (d.max_value is not None and x > d.max_value)
                ):
                    return None
                row.append(x)
            rows.append(row)
        x64 = np.array(rows, dtype=np.float64).reshape(len(records), len(self.spec.dense))
        for j, d in enumerate(self.spec.dense):
            transform_dense(x64[:, j], d)
        return x64.astype(np.float32)


@nb.njit(nogil=True, cache=True)
def _field_starts(
    per_field: npt.NDArray[np.int32], firsts: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Where each field's ids start (``[F + 1]``, the last the end) given each field's
    count per sample (``[F, B]``), and where each table's (its first field's) start:
    one call where numpy took four, each paid for again by a request that finds the
    caches cold.

    >>> starts, tables = _field_starts(np.array([[1, 2], [0, 1], [3, 0]], np.int32),
    ...                                np.array([0, 2, 3]))
    >>> starts.tolist(), tables.tolist()
    ([0, 3, 4, 7], [0, 4, 7])
    """
    starts = np.zeros(per_field.shape[0] + 1, dtype=np.int64)
    for f in range(per_field.shape[0]):
        n = 0
        for b in range(per_field.shape[1]):
            n += per_field[f, b]
        starts[f + 1] = starts[f] + n
    tables = np.empty(firsts.shape[0], dtype=np.int64)
    for t in range(firsts.shape[0]):
        tables[t] = starts[firsts[t]]
    return starts, tables
