"""Validation of decoded records against a ``FeatureSpec``, vectorised with pyarrow.compute.

Every codec ends with :func:`check` and the columnar sources (Parquet, synthetic)
call :func:`validate` on their Arrow tables directly. A table goes through two
passes, each over the fields in spec order (labels, dense, sparse):

1. the *type pass* casts every column to the spec's type (labels and dense to
   float64, sparse to string / int64 / list<string> / list<int64>); a value
   whose type cannot be cast that way makes its record bad;
2. the *value pass* checks the cast values: labels present, finite and in
   ``[0, 1]``; dense values finite, within ``[min_value, max_value]`` and
   present when ``fill`` is None; lists no longer than ``max_len``.

A record is reported once, with the first problem found in that order, so a
record with a string label and a list that is too long counts as
``label_wrong_type`` only. Codecs report decoding problems (``not_json``,
``bad_ipc``...) before both passes. The reasons, with what they mean, are the
keys of :data:`REASONS`.

Decisions:

- Columns that are not spec fields are ignored (an extra JSON key, an extra
  Parquet column), so producers can add fields before the spec uses them.
- Types are strict: a string is not a number (``"3"`` and ``"NaN"`` in a dense
  field are ``dense_wrong_type``), a bool is not a number, a float is not an int
  (``3.0`` in an int field is ``sparse_wrong_type``), an int is not a string,
  and a scalar is not a list. Strict types keep one record's meaning the same
  in every codec and make a producer bug visible at once instead of hashing
  ``3`` and ``"3"`` to different ids.
- NaN and ±Inf are bad (``label_not_finite``, ``dense_not_finite``), however
  they arrive: a ``NaN`` literal, a number too large for a double such as
  ``1e999`` (read as Inf), or ``nan``/``inf`` text in a TSV file.
- A missing or null dense value is kept as null (``fill`` is applied later by
  the pipeline) unless ``fill`` is None, which makes it ``missing_dense``.
- A missing or null sparse value is a null in the output table, meaning an
  empty bag; a null *inside* a list is ``sparse_wrong_type``.

The good table holds the spec columns in spec order and ``__position``:

>>> import pyarrow as pa
>>> from connectors.spec import FeatureSpec
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"],
...     "dense": [{"name": "price", "min_value": 0}],
...     "sparse": [{"name": "user", "table": "users"}],
... })
>>> table = pa.table({
...     "click": [1.0, 0.0, 2.0, None],
...     "price": [3.5, -1.0, 1.0, 1.0],
...     "user": ["a", "b", "c", "d"],
... })
>>> good, bad = validate(table, spec, positions=np.array([10, 11, 12, 13]))
>>> good.to_pylist()
[{'click': 1.0, 'price': 3.5, 'user': 'a', '__position': 10}]
>>> [(b.position, b.reason, b.field) for b in bad]
[(11, 'dense_below_min', 'price'), (12, 'label_out_of_range', 'click'), (13, 'null_label', 'click')]
>>> bad[0].detail
"dense field 'price' is -1.0, below min_value 0.0"
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from connectors.spec import DenseField, FeatureSpec, SparseField
from connectors.types import BadRecord, RawChunk

POSITION = "__position"
"""The int64 column of a good table that holds each record's source position."""

INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)

REASONS: dict[str, str] = {
    # Before decoding: the payload as bytes.
    "empty_payload": "the payload has no bytes",
    "oversize": "the payload is larger than spec.max_record_bytes (it is not decoded)",
    # Decoding: the payload is not a record of the codec's format.
    "not_utf8": "the payload, or a string value, is not valid UTF-8",
    "not_json": "the payload is not JSON (syntax error, truncated, trailing data)",
    "not_object": "the payload is JSON but not an object (an array, a number, null...)",
    "duplicate_field": "a spec field appears twice in one JSON object",
    "bad_line": "a TSV payload that is not one line (it holds a newline)",
    "wrong_column_count": "a TSV line with more or fewer columns than configured",
    "bad_ipc": "the payload is not a readable, valid Arrow IPC stream",
    # Type pass.
    "label_wrong_type": "a label is not a number (a string, bool, list or object)",
    "dense_wrong_type": "a dense value is not a number (a string, bool, list or object)",
    "sparse_wrong_type": (
        "a sparse value of the wrong type: not a string for a string field, not an int for "
        "an int field, not a list (or a list with elements of the wrong type or null) for a "
        "list field"
    ),
    "int_overflow": "an int, or a list_int element, outside the int64 range",
    # Value pass.
    "missing_label": "a label field is absent",
    "null_label": "a label field is null",
    "label_not_finite": "a label is NaN or ±Inf",
    "label_out_of_range": "a label is outside [0, 1]",
    "missing_dense": "a dense field with fill=None is absent or null",
    "dense_not_finite": "a dense value is NaN or ±Inf",
    "dense_below_min": "a dense value is below the field's min_value",
    "dense_above_max": "a dense value is above the field's max_value",
    "list_too_long": "a list field holds more values than its max_len",
}
"""Every reason a record can be bad for, with what it means."""


class Problem(NamedTuple):
    """Why row ``row`` of a checked table is bad (before it becomes a ``BadRecord``)."""

    row: int
    reason: str
    field: str | None
    detail: str


@dataclass
class Checked:
    """What :func:`check` finds: the table cast to the spec's types, and its bad rows.

    ``table`` has every row of the input (bad ones included) and the spec's
    columns only; ``good[i]`` says whether row ``i`` passed; ``problems`` has
    one entry per bad row, in row order.
    """

    table: pa.Table
    good: npt.NDArray[np.bool_]
    problems: list[Problem]


_SPARSE_TYPES: Final[Mapping[str, pa.DataType]] = MappingProxyType(
    {
        "string": pa.string(),
        "int": pa.int64(),
        "list_string": pa.list_(pa.string()),
        "list_int": pa.list_(pa.int64()),
    }
)


def sparse_type(field: SparseField) -> pa.DataType:
    """The Arrow type of a sparse field's column.

    >>> from connectors.spec import SparseField
    >>> sparse_type(SparseField(name="tags", table="t", type="list_int"))
    ListType(list<item: int64>)
    """
    return _SPARSE_TYPES[field.type]


def spec_schema(spec: FeatureSpec, *, position: bool = False) -> pa.Schema:
    """The schema of a good table: labels, dense, sparse (and ``__position`` if asked).

    >>> spec = FeatureSpec(labels=["y"], sparse=[{"name": "u", "table": "t", "type": "int"}])
    >>> spec_schema(spec, position=True).names
    ['y', 'u', '__position']
    """
    fields = [pa.field(name, pa.float64()) for name in spec.labels]
    fields += [pa.field(d.name, pa.float64()) for d in spec.dense]
    fields += [pa.field(s.name, sparse_type(s)) for s in spec.sparse]
    if position:
        fields.append(pa.field(POSITION, pa.int64()))
    return pa.schema(fields)


def count_reasons(bad: Iterable[BadRecord]) -> dict[str, int]:
    """How many bad records there are per reason, sorted by reason.

    >>> r = BadRecord("s", "p", 0, "not_json", None, "x")
    >>> count_reasons([r, r])
    {'not_json': 2}
    """
    return dict(sorted(Counter(b.reason for b in bad).items()))


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened to ``limit`` characters for detail sentences.

    >>> show("x" * 100, limit=10)
    "'xxxxxx..."
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(table: pa.Table, spec: FeatureSpec, marker: Marker | None = None) -> Checked:
    """Cast ``table`` to the spec's types and find its bad rows (see the module docstring).

    Columns that are not spec fields are ignored; a spec field without a
    column is absent in every row. ``marker`` may hold problems a codec found
    first; those rows keep them.

    >>> spec = FeatureSpec(labels=["y"], sparse=[{"name": "u", "table": "t", "type": "int"}])
    >>> c = check(pa.table({"y": [1, 0], "u": pa.array([1, 2**63], pa.uint64())}), spec)
    >>> c.good.tolist(), c.problems[0].reason, c.table.schema.types
    ([True, False], 'int_overflow', [DataType(double), DataType(int64)])
    """
    n = table.num_rows
    if marker is None:
        marker = Marker(n)
    elif marker.bad.shape[0] != n:
        msg = f"the marker has {marker.bad.shape[0]} rows for a table of {n} rows"
        raise ValueError(msg)
    columns: dict[str, pa.ChunkedArray] = {}
    absent: set[str] = set()
    # The type pass, over every field, before any value is looked at.
    for name in spec.labels:
        columns[name] = _coerce_number(table, name, "label", marker, absent)
    for d in spec.dense:
        columns[d.name] = _coerce_number(table, d.name, "dense", marker, absent)
    for s in spec.sparse:
        columns[s.name] = _coerce_sparse(table, s, marker, absent)
    # The value pass.
    for name in spec.labels:
        # Scored records' labels are not used: absent or null they read as NaN.
        if spec.labels_required:
            _check_label(columns[name], name, name in absent, marker)
    for d in spec.dense:
        _check_dense(columns[d.name], d, marker)
    for s in spec.sparse:
        if s.type.startswith("list_"):
            _check_list_length(columns[s.name], s, marker)
    schema = spec_schema(spec)
    out = pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
    marker.problems.sort(key=lambda p: p.row)
    return Checked(out, ~marker.bad, marker.problems)


def validate(
    table: pa.Table,
    spec: FeatureSpec,
    raw: RawChunk | None = None,
    *,
    rows: npt.NDArray[np.int64] | None = None,
    positions: npt.NDArray[np.int64] | None = None,
    source: str | None = None,
    partition: str | None = None,
) -> tuple[pa.Table, list[BadRecord]]:
    """The good rows of ``table`` (spec columns and ``__position``) and the bad ones.

    ``raw`` is the chunk the rows came from, when there is one: it gives the
    source, the partition, the positions and the payload bytes of the bad
    records. ``rows[i]`` is the record of ``raw`` that row ``i`` came from
    (by default row ``i`` is record ``i``). Without ``raw``, positions come from
    ``positions``, else a ``__position`` column, else the row numbers; and a bad
    record's ``raw`` bytes are its row as a JSON line, which
    ``JsonLinesCodec`` reads back.

    >>> spec = FeatureSpec(labels=["y"])
    >>> good, bad = validate(pa.table({"y": [0.5, float("nan")]}), spec, source="pq")
    >>> good.num_rows, bad[0].reason, bad[0].position, bad[0].raw
    (1, 'label_not_finite', 1, b'{"y":NaN}')
    """
    n = table.num_rows
    checked = check(table, spec)
    row_index = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    if row_index.shape[0] != n:
        msg = f"rows has {row_index.shape[0]} entries for a table of {n} rows"
        raise ValueError(msg)
    if positions is not None:
        pos = np.asarray(positions, np.int64)
    elif raw is not None:
        pos = np.asarray(raw.positions, np.int64)[row_index]
    elif POSITION in table.column_names:
        pos = table.column(POSITION).to_numpy().astype(np.int64, copy=False)
    else:
        pos = row_index
    if pos.shape[0] != n:
        msg = f"positions has {pos.shape[0]} entries for a table of {n} rows"
        raise ValueError(msg)
    src = source if source is not None else (raw.chunk.source if raw is not None else "")
    part = partition if partition is not None else (raw.chunk.partition if raw is not None else "")
    payloads = raw.payloads if raw is not None else None

    def raw_bytes(row: int) -> bytes:
        if payloads is not None:
            return bytes(payloads[int(row_index[row])])
        return row_json(table.slice(row, 1))

    bad = [
        BadRecord(src, part, int(pos[p.row]), p.reason, p.field, p.detail, raw_bytes(p.row))
        for p in checked.problems
    ]
    return with_positions(checked.table, checked.good, pos), bad


def with_positions(
    table: pa.Table, good: npt.NDArray[np.bool_], positions: npt.NDArray[np.int64]
) -> pa.Table:
    """``table``'s good rows with their positions as the ``__position`` column.

    >>> with_positions(pa.table({"y": [1.0, 2.0]}), np.array([False, True]), np.array([7, 8]))
    ... # doctest: +NORMALIZE_WHITESPACE
    pyarrow.Table
    y: double
    __position: int64
    ----
    y: [[2]]
    __position: [[8]]
    """
    out = table.append_column(POSITION, pa.array(np.asarray(positions, np.int64)))
    if bool(good.all()):
        return out
    return out.filter(pa.array(good))


def row_json(row: pa.Table) -> bytes:
    """A one-row table as a compact JSON line (NaN and Inf as the literals ``NaN``, ``Infinity``).

    >>> row_json(pa.table({"y": [1.0], "u": ["a"]}))
    b'{"y":1.0,"u":"a"}'
    """
    record = {k: v for k, v in row.to_pylist()[0].items() if k != POSITION}
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=str).encode()


# --- the passes ---------------------------------------------------------------------------


class Marker:
    """Collects the problems of ``n`` rows; a row is reported for its first problem only.

    Codecs use one to report their own type problems (a TSV cell that is not a
    number) before :func:`check` adds the rest.

    >>> m = Marker(3)
    >>> m.mark(np.array([False, True, True]), "not_json", "x", None, lambda v: "first")
    >>> m.mark(pa.array([True, True, False]), "oversize", "x", None, lambda v: "second")
    >>> [(p.row, p.detail) for p in sorted(m.problems)]
    [(0, 'second'), (1, 'first'), (2, 'first')]
    """

    def __init__(self, n: int) -> None:
        self.bad = np.zeros(n, dtype=np.bool_)
        self.problems: list[Problem] = []

    def mark(
        self,
        mask: pa.ChunkedArray | pa.Array | npt.NDArray[np.bool_],
        reason: str,
        field: str,
        values: pa.ChunkedArray | pa.Array | None,
        describe: Callable[[Any], str],
    ) -> None:
        """Report the rows where ``mask`` is true (null counts as false)."""
        if isinstance(mask, np.ndarray):
            if not mask.any():
                return
            hits = mask
        else:
            # pc.any skips nulls and costs one pass: the common case stops here.
            if not pc.any(mask).as_py():
                return
            hits = _to_numpy_bool(mask)
        new = np.flatnonzero(hits & ~self.bad)
        if new.shape[0] == 0:
            return
        self.bad[new] = True
        shown = values.take(pa.array(new)).to_pylist() if values is not None else [None] * len(new)
        self.problems.extend(
            Problem(int(i), reason, field, describe(v)) for i, v in zip(new, shown, strict=True)
        )


def _to_numpy_bool(mask: pa.ChunkedArray | pa.Array) -> npt.NDArray[np.bool_]:
    filled = pc.fill_null(mask, False)
    if isinstance(filled, pa.ChunkedArray):
        filled = filled.combine_chunks() if filled.num_chunks != 1 else filled.chunk(0)
    return np.asarray(filled.to_numpy(zero_copy_only=False), dtype=np.bool_)


def arrow_kind(t: pa.DataType) -> str:
    """A short name for an Arrow type in detail sentences ("string", "list", "object"...).

    >>> arrow_kind(pa.large_string()), arrow_kind(pa.struct([("a", pa.int8())]))
    ('string', 'object')
    """
    if _is_text(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if _is_list(t):
        return "list"
    if pa.types.is_struct(t) or pa.types.is_map(t):
        return "object"
    return str(t)


def _is_list(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_binary(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


def _column(table: pa.Table, name: str) -> pa.ChunkedArray | None:
    # The schema's index first: ``column_names`` builds a list of every name, which
    # for a request of one record cost more than checking its values.
    i = table.schema.get_field_index(name)  # -1: absent, or named twice
    if i < 0:
        if name not in table.column_names:
            return None
        col = table.column(name)  # twice: the error names it
    else:
        col = table.column(i)
    if pa.types.is_dictionary(col.type):
        # Parquet writes strings dictionary-encoded; the values are what we check.
        col = col.cast(col.type.value_type)
    return col


def _wrong_type(
    col: pa.ChunkedArray, marker: Marker, reason: str, field: str, what: str, wanted: str
) -> None:
    """Mark the non-null rows of a column whose type is wrong."""
    kind = arrow_kind(col.type)
    marker.mark(
        col.is_valid(),
        reason,
        field,
        col,
        lambda v: f"{what} is a {kind} ({show(v)}); {wanted}",
    )


def _coerce_number(
    table: pa.Table, name: str, role: str, marker: Marker, absent: set[str]
) -> pa.ChunkedArray:
    """A label or dense column as float64; other types make their non-null rows bad."""
    n = table.num_rows
    col = _column(table, name)
    if col is None:
        absent.add(name)
        return pa.chunked_array([pa.nulls(n, pa.float64())])
    t = col.type
    if pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_decimal(t):
        # Ints beyond 2**53 round to the nearest double, as a JSON number would.
        return col.cast(pa.float64(), safe=False)
    if pa.types.is_null(t):
        return col.cast(pa.float64())
    what = f"label {name!r}" if role == "label" else f"dense field {name!r}"
    wanted = "labels are numbers in [0, 1]" if role == "label" else "dense fields are numbers"
    _wrong_type(col, marker, f"{role}_wrong_type", name, what, wanted)
    return pa.chunked_array([pa.nulls(n, pa.float64())])


def _coerce_sparse(
    table: pa.Table, field: SparseField, marker: Marker, absent: set[str]
) -> pa.ChunkedArray:
    n = table.num_rows
    target = sparse_type(field)
    nulls = pa.chunked_array([pa.nulls(n, target)])
    col = _column(table, field.name)
    if col is None:
        absent.add(field.name)
        return nulls
    what = f"sparse field {field.name!r} (type {field.type})"
    t = col.type
    if pa.types.is_null(t):
        return col.cast(target)
    if field.type == "string":
        if _is_text(t):
            return col.cast(target)
        if _is_binary(t):
            return utf8_or_null(
                col,
                marker,
                field.name,
                "not_utf8",
                lambda v: f"{what} holds {show(v)}, not valid UTF-8",
            )
        _wrong_type(col, marker, "sparse_wrong_type", field.name, what, "it takes a string")
        return nulls
    if field.type == "int":
        if pa.types.is_integer(t):
            return _int_to_int64(col, marker, field.name, what)
        _wrong_type(col, marker, "sparse_wrong_type", field.name, what, "it takes an int")
        return nulls
    # A list field.
    elem_wanted = "string" if field.type == "list_string" else "int"
    if not _is_list(t):
        _wrong_type(col, marker, "sparse_wrong_type", field.name, what, "it takes a list")
        return nulls
    elem = t.value_type
    if pa.types.is_null(elem):
        return col.cast(target)
    ok_elem = (
        (_is_text(elem) or _is_binary(elem))
        if field.type == "list_string"
        else pa.types.is_integer(elem)
    )
    if not ok_elem:
        kind = arrow_kind(elem)
        marker.mark(
            pc.greater(pc.list_value_length(col), 0),
            "sparse_wrong_type",
            field.name,
            col,
            lambda v: f"{what} is a list of {kind}s ({show(v)}); it takes a list of {elem_wanted}s",
        )
        return nulls
    return _coerce_list(col, field, marker, what)


def utf8_or_null(
    col: pa.ChunkedArray,
    marker: Marker,
    field: str,
    reason: str,
    describe: Callable[[Any], str],
) -> pa.ChunkedArray:
    """``col`` as strings; a value that is not UTF-8 is marked bad (``describe`` says how)."""
    try:
        return col.cast(pa.string())
    except pa.ArrowInvalid:
        pass
    # Some value is not UTF-8: find which, in Python (only when one is broken).
    broken = _not_utf8(col.to_pylist())
    marker.mark(broken, reason, field, col, describe)
    kept = pc.if_else(pa.array(~broken), col, pa.scalar(None, col.type))
    return kept.cast(pa.string())


def _not_utf8(values: Sequence[bytes | None]) -> npt.NDArray[np.bool_]:
    """Which of ``values`` are not null and not UTF-8."""
    return np.array([v is not None and not is_utf8(v) for v in values], dtype=np.bool_)


def is_utf8(value: bytes) -> bool:
    """Whether ``value`` decodes as UTF-8."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _int_to_int64(col: pa.ChunkedArray, marker: Marker, field: str, what: str) -> pa.ChunkedArray:
    if pa.types.is_uint64(col.type):
        over = pc.greater(col, pa.scalar(INT64_MAX, pa.uint64()))
        marker.mark(over, "int_overflow", field, col, lambda v: f"{what} is {v}, beyond int64")
        col = pc.if_else(over, pa.scalar(None, pa.uint64()), col)
    return col.cast(pa.int64())


def _coerce_list(
    col: pa.ChunkedArray, field: SparseField, marker: Marker, what: str
) -> pa.ChunkedArray:
    """A list column with good element types: check its elements, cast to the target type."""
    target = sparse_type(field)
    # list_parent_indices is per chunk, so work on one chunk.
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_list_view(arr.type) or pa.types.is_large_list_view(arr.type):
        # Rebuilt by hand: pyarrow 26's cast from list_view gives an invalid array.
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
        offsets = np.zeros(len(arr) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arr = pa.LargeListArray.from_arrays(
            pa.array(offsets), pc.list_flatten(arr), mask=arr.is_null()
        )
    elif pa.types.is_fixed_size_list(arr.type):
        arr = arr.cast(pa.list_(arr.type.value_type))
    flat = pc.list_flatten(arr)
    n = len(arr)
    problem = np.zeros(n, dtype=np.bool_)
    parents: npt.NDArray[np.int64] | None = None

    def mark_rows(
        elements: npt.NDArray[np.bool_], reason: str, describe: Callable[[Any], str]
    ) -> None:
        """Mark the rows holding an element where ``elements`` is true."""
        nonlocal parents, problem
        if parents is None:
            parents = pc.list_parent_indices(arr).to_numpy()
        hit = np.zeros(n, dtype=np.bool_)
        hit[parents[elements]] = True
        marker.mark(hit, reason, field.name, arr, describe)
        problem |= hit

    if flat.null_count:
        mark_rows(
            _to_numpy_bool(flat.is_null()),
            "sparse_wrong_type",
            lambda v: f"{what} holds a null element ({show(v)}); list elements are not null",
        )
    elem = arr.type.value_type
    if _is_binary(elem):
        try:
            arr.cast(pa.list_(pa.string()))
        except pa.ArrowInvalid:
            mark_rows(
                _not_utf8(flat.to_pylist()),
                "not_utf8",
                lambda v: f"{what} holds {show(v)}, with an element not valid UTF-8",
            )
    if pa.types.is_uint64(elem):
        over = _to_numpy_bool(pc.greater(flat, pa.scalar(INT64_MAX, pa.uint64())))
        if over.any():
            mark_rows(
                over,
                "int_overflow",
                lambda v: f"{what} holds {show(v)}, with an element beyond int64",
            )
    if problem.any():
        # The rows just reported are bad: null them so the cast below cannot fail on them.
        arr = pc.if_else(pa.array(problem), pa.scalar(None, arr.type), arr)
    return pa.chunked_array([arr.cast(target, safe=False)])


def _check_label(col: pa.ChunkedArray, name: str, absent: bool, marker: Marker) -> None:
    if absent:
        marker.mark(
            np.ones(len(col), dtype=np.bool_),
            "missing_label",
            name,
            None,
            lambda _v: f"label {name!r} is absent",
        )
        return
    if col.null_count:
        marker.mark(col.is_null(), "null_label", name, None, lambda _v: f"label {name!r} is null")
    marker.mark(
        pc.invert(pc.is_finite(col)),
        "label_not_finite",
        name,
        col,
        lambda v: f"label {name!r} is {v!r}; labels are finite numbers in [0, 1]",
    )
    marker.mark(
        pc.or_(pc.less(col, 0.0), pc.greater(col, 1.0)),
        "label_out_of_range",
        name,
        col,
        lambda v: f"label {name!r} is {v!r}, outside [0, 1]",
    )


def _check_dense(col: pa.ChunkedArray, d: DenseField, marker: Marker) -> None:
    name = d.name
    if d.fill is None:
        marker.mark(
            col.is_null(),
            "missing_dense",
            name,
            None,
            lambda _v: f"dense field {name!r} is absent or null and has no fill value (fill=None)",
        )
    marker.mark(
        pc.invert(pc.is_finite(col)),
        "dense_not_finite",
        name,
        col,
        lambda v: f"dense field {name!r} is {v!r}; dense values must be finite",
    )
    lo, hi = d.min_value, d.max_value
    if lo is not None:
        marker.mark(
            pc.less(col, lo),
            "dense_below_min",
            name,
            col,
            lambda v: f"dense field {name!r} is {v!r}, below min_value {lo!r}",
        )
    if hi is not None:
        marker.mark(
            pc.greater(col, hi),
            "dense_above_max",
            name,
            col,
            lambda v: f"dense field {name!r} is {v!r}, above max_value {hi!r}",
        )


def _check_list_length(col: pa.ChunkedArray, field: SparseField, marker: Marker) -> None:
    lengths = pc.list_value_length(col)
    marker.mark(
        pc.greater(lengths, field.max_len),
        "list_too_long",
        field.name,
        lengths,
        lambda v: f"sparse field {field.name!r} has {v} values, more than max_len {field.max_len}",
    )


def problems_to_bad(
    problems: Sequence[Problem],
    record_of_row: npt.NDArray[np.int64],
    raw: RawChunk,
    raw_of_row: Callable[[int], bytes] | None = None,
) -> list[BadRecord]:
    """``BadRecord`` s for problems found in rows that came from records of ``raw``.

    ``record_of_row[row]`` is the record (index into ``raw.positions`` and
    ``raw.payloads``) of each row; ``raw_of_row`` gives a row's raw bytes when
    they are not its record's payload (a row of a multi-row Arrow payload).
    """
    src, part = raw.chunk.source, raw.chunk.partition
    out = []
    for p in problems:
        rec = int(record_of_row[p.row])
        if raw_of_row is not None:
            data = raw_of_row(p.row)
        elif raw.payloads is not None:
            data = bytes(raw.payloads[rec])
        else:
            data = b""
        out.append(BadRecord(src, part, int(raw.positions[rec]), p.reason, p.field, p.detail, data))
    return out
