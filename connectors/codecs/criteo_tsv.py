"""The Criteo TSV codec, :class:`CriteoTsvCodec`: tab-separated lines read by ``pyarrow.csv``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from connectors.codecs.steps import (
    drop_position,
    finish,
    join,
    none_good,
    payloads_of,
    relabel,
    screen,
)
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, RawChunk
from connectors.validate import Marker, Problem, check, show, utf8_or_null

# Subsets of what Arrow's string-to-number casts accept: values matching them are
# cast in bulk; others are tried one by one, so Arrow decides in every case.
_FLOAT_TEXT = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$"
_INT_TEXT = r"^-?[0-9]+$"
_NEWLINE, _CR = ord("\n"), ord("\r")


@dataclass(frozen=True)
class CriteoTsvCodec:
    """Criteo lines: tab-separated columns, an empty column is a missing value.

    ``columns`` names the columns in order; by default the first label, then the
    spec's dense fields, then its sparse fields (``label, I1..I13, C1..C26`` for
    a Criteo spec). Columns that are not spec fields are read and ignored;
    every label must be a column. List fields cannot be read from TSV.

    Decoding joins the payloads with newlines and reads them with
    ``pyarrow.csv`` (no quoting: ``"`` is an ordinary character), every column
    as bytes; each column is then cast to its spec type in bulk. Numbers are
    what Arrow's cast accepts, without surrounding spaces: ``1``, ``-2.5e3``,
    ``nan``, ``inf`` (bad values, but numbers), and for int fields decimal or
    ``0x`` hex digits; a value that fails the cast makes its record
    ``label_wrong_type``, ``dense_wrong_type``, ``sparse_wrong_type`` or
    ``int_overflow`` (digits beyond int64). A line with a different number of
    columns is ``wrong_column_count``; a payload holding a newline (other than
    one at its end, which is dropped) is ``bad_line``; an empty label column is
    ``missing_label``.

    >>> from connectors.spec import FeatureSpec
    >>> c1 = {"name": "c1", "table": "t"}
    >>> spec = FeatureSpec(labels=["y"], dense=[{"name": "i1"}], sparse=[c1])
    >>> codec = CriteoTsvCodec()
    >>> codec.encode(pa.table({"y": [1.0], "i1": [None], "c1": ["68fd1e64"]}))
    [b'1\\t\\t68fd1e64']
    >>> from connectors.types import Chunk, RawChunk
    >>> raw = RawChunk(Chunk("s", "p", 0, 3), np.arange(3), [b"1\\t\\tab", b"0\\tx\\tcd", b"1\\t2"])
    >>> good, bad = codec.decode(raw, spec)
    >>> good.to_pylist()
    [{'y': 1.0, 'i1': None, 'c1': 'ab', '__position': 0}]
    >>> for b in bad:
    ...     print(b.position, b.reason, "-", b.detail)
    1 dense_wrong_type - dense field 'i1' is 'x', not a number
    2 wrong_column_count - the line has 2 columns, not 3
    """

    columns: Sequence[str] | None = None  # kept as a tuple

    def __post_init__(self) -> None:
        if self.columns is None:
            return
        if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
            msg = f"columns must be a list of column names, got {self.columns!r}"
            raise ValueError(msg)
        columns = tuple(self.columns)
        twice = sorted(c for c, k in Counter(columns).items() if k > 1)
        if not columns or twice:
            msg = f"columns must name each column once, got {list(columns)!r}"
            raise ValueError(msg)
        object.__setattr__(self, "columns", columns)

    def column_names(self, spec: FeatureSpec) -> tuple[str, ...]:
        """The TSV columns, in order, for ``spec``.

        >>> from connectors.spec import FeatureSpec
        >>> CriteoTsvCodec().column_names(FeatureSpec(labels=["y", "z"], dense=[{"name": "a"}]))
        ('y', 'a')
        """
        if self.columns is not None:
            return tuple(self.columns)
        return (spec.labels[0], *(d.name for d in spec.dense), *(s.name for s in spec.sparse))

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good records of ``raw`` and the bad ones (see the class docstring)."""
        names = self.column_names(spec)
        _check_columns(names, spec)
        payloads = payloads_of(raw, "criteo_tsv")
        n = len(payloads)
        if n == 0:
            return none_good(raw, spec, {})
        _, early = screen(payloads, spec)
        # A placeholder line of empty columns reads as a row of nulls, keeping rows aligned.
        placeholder = b"\t" * (len(names) - 1)
        replaced = dict.fromkeys(early, placeholder)
        joined = _one_line_each(payloads, early, replaced, placeholder)
        table, invalid = _read_tsv(joined, names, spec)
        for i, p in invalid.items():
            if i not in replaced:
                early[i] = p
        index = np.setdiff1d(
            np.arange(n, dtype=np.int64), np.fromiter(invalid, np.int64, len(invalid))
        )
        drop = np.zeros(n, dtype=np.bool_)
        drop[list(replaced)] = True
        keep = ~drop[index]
        if not keep.all():
            table, index = table.filter(pa.array(keep)), index[keep]
        marker = Marker(table.num_rows)
        typed = _typed_columns(table, spec, marker)
        checked = check(pa.table(typed) if typed else pa.table({}), spec, marker)
        relabel(
            checked,
            "null_label",
            "missing_label",
            lambda p: f"label {p.field!r} is empty (missing)",
        )
        return finish(raw, checked, index, early)

    def encode(self, table: pa.Table) -> list[bytes]:
        """One tab-separated line per row (in ``columns`` order, else the table's).

        >>> CriteoTsvCodec().encode(pa.table({"y": [0.0], "i": [2.5], "c": [None], "n": [7]}))
        [b'0\\t2.5\\t\\t7']
        """
        table = drop_position(table)
        names = self.columns if self.columns is not None else tuple(table.column_names)
        columns = [
            table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
            for c in names
        ]
        out = []
        for values in zip(*columns, strict=True):
            cells = [_tsv_cell(v, c) for v, c in zip(values, names, strict=True)]
            out.append("\t".join(cells).encode())
        return out


def _check_columns(names: Sequence[str], spec: FeatureSpec) -> None:
    """Refuse a spec the columns cannot serve: a list field, or a label not among them."""
    for s in spec.sparse:
        if s.name in names and s.type.startswith("list_"):
            msg = (
                f"the criteo_tsv codec cannot read list field {s.name!r} (type {s.type}): "
                "a TSV column holds one value"
            )
            raise ValueError(msg)
    missing = [name for name in spec.labels if name not in names]
    if missing:
        msg = (
            f"labels {missing} are not among the TSV columns {list(names)}: "
            "name every column with the codec's `columns` option"
        )
        raise ValueError(msg)


def _one_line_each(
    payloads: Sequence[bytes],
    early: dict[int, Problem],
    replaced: dict[int, bytes],
    placeholder: bytes,
) -> bytes:
    """The payloads joined by newlines, one line each: a line's own newline dropped, a
    payload holding another one bad (``early``) and ``placeholder`` in its place."""
    n = len(payloads)
    joined, starts, lens = join(payloads, replaced)
    view = np.frombuffer(joined, dtype=np.uint8)
    ends = view[np.maximum(starts[:-1] + lens - 1, 0)]
    trailing = np.flatnonzero(((ends == _NEWLINE) | (ends == _CR)) & (lens > 0))
    work: dict[int, bytes] = {}
    for i in trailing.tolist():
        if i in early:
            continue
        # A line's own newline is not part of the record.
        line = payloads[i][:-2] if payloads[i].endswith(b"\r\n") else payloads[i][:-1]
        if line:
            work[i] = line
        else:
            early[i] = Problem(i, "empty_payload", None, "the payload is only a newline")
            replaced[i] = placeholder
    if work or trailing.shape[0]:
        joined, starts, lens = join(payloads, {**work, **replaced})
        view = np.frombuffer(joined, dtype=np.uint8)
    if np.count_nonzero(view == _NEWLINE) != n - 1 or joined.find(b"\r") >= 0:
        for i in range(n):
            line = work.get(i, payloads[i])
            if i not in replaced and (b"\n" in line or b"\r" in line):
                early[i] = Problem(
                    i,
                    "bad_line",
                    None,
                    f"the payload holds a newline, so it is not one TSV line: {show(line, 60)}",
                )
                replaced[i] = placeholder
        joined, starts, lens = join(payloads, {**work, **replaced})
    return joined


def _read_tsv(
    joined: bytes, names: Sequence[str], spec: FeatureSpec
) -> tuple[pa.Table, dict[int, Problem]]:
    """The spec's columns of the joined lines, as bytes, and the lines of the wrong
    column count (skipped by the reader), by index."""
    invalid: dict[int, Problem] = {}

    def on_invalid(row: Any) -> str:
        i = int(row.number) - 1
        invalid[i] = Problem(
            i,
            "wrong_column_count",
            None,
            f"the line has {row.actual_columns} columns, not {row.expected_columns}",
        )
        return "skip"

    spec_names = {*spec.labels, *(d.name for d in spec.dense), *(s.name for s in spec.sparse)}
    table = pa_csv.read_csv(
        pa.BufferReader(pa.py_buffer(joined)),
        read_options=pa_csv.ReadOptions(column_names=list(names), use_threads=False),
        parse_options=pa_csv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            escape_char=False,
            double_quote=False,
            newlines_in_values=False,
            ignore_empty_lines=False,
            invalid_row_handler=on_invalid,
        ),
        convert_options=pa_csv.ConvertOptions(
            # Bytes first: the casts below decide row by row (a typed read fails whole).
            column_types=dict.fromkeys(names, pa.binary()),
            include_columns=[c for c in names if c in spec_names],
            null_values=[""],
            strings_can_be_null=True,
        ),
    )
    return table, invalid


def _typed_columns(table: pa.Table, spec: FeatureSpec, marker: Marker) -> dict[str, pa.Array]:
    """The byte columns cast to the spec's types; a value that does not cast is marked."""
    typed = {}
    for name in spec.labels:
        typed[name] = _text_to_float(
            table.column(name), marker, name, f"label {name!r}", "label_wrong_type"
        )
    for d in spec.dense:
        if d.name in table.column_names:
            typed[d.name] = _text_to_float(
                table.column(d.name),
                marker,
                d.name,
                f"dense field {d.name!r}",
                "dense_wrong_type",
            )
    for s in spec.sparse:
        if s.name in table.column_names:
            what = f"sparse field {s.name!r} (type {s.type})"
            col = table.column(s.name)
            typed[s.name] = (
                _text_to_int(col, marker, s.name, what)
                if s.type == "int"
                else _text_to_string(col, marker, s.name, what, "not_utf8")
            )
    return typed


def _tsv_cell(value: Any, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        # Integral floats print as ints ("1", not "1.0"), as Criteo labels and counts do.
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(value)
    text = str(value)
    if "\t" in text or "\n" in text or "\r" in text:
        msg = f"column {column!r} holds {show(value)}: a TSV cell cannot hold a tab or newline"
        raise ValueError(msg)
    return text


def _text_to_string(
    col: pa.ChunkedArray, marker: Marker, field: str, what: str, reason: str
) -> pa.ChunkedArray:
    return utf8_or_null(
        col, marker, field, reason, lambda v: f"{what} is {show(v)}, not valid UTF-8"
    )


def _text_to_float(
    col: pa.ChunkedArray, marker: Marker, field: str, what: str, reason: str
) -> pa.ChunkedArray:
    text = _text_to_string(col, marker, field, what, reason)
    try:
        return text.cast(pa.float64())
    except pa.ArrowInvalid:
        pass
    ok = _castable(text, _FLOAT_TEXT, pa.float64())
    marker.mark(
        pc.and_(text.is_valid(), pc.invert(ok)),
        reason,
        field,
        text,
        lambda v: f"{what} is {show(v)}, not a number",
    )
    return pc.if_else(ok, text, pa.scalar(None, pa.string())).cast(pa.float64())


def _text_to_int(col: pa.ChunkedArray, marker: Marker, field: str, what: str) -> pa.ChunkedArray:
    text = _text_to_string(col, marker, field, what, "sparse_wrong_type")
    try:
        return text.cast(pa.int64())
    except pa.ArrowInvalid:
        pass
    digits = pc.match_substring_regex(text, _INT_TEXT)
    ok = _castable(text, _INT_TEXT, pa.int64())
    # Digits that do not cast are beyond int64; anything else that does not cast is not an int.
    over = pc.and_(digits, pc.invert(ok))
    marker.mark(over, "int_overflow", field, text, lambda v: f"{what} is {v}, beyond int64")
    marker.mark(
        pc.and_(text.is_valid(), pc.invert(ok)),
        "sparse_wrong_type",
        field,
        text,
        lambda v: f"{what} is {show(v)}, not an int",
    )
    return pc.if_else(ok, text, pa.scalar(None, pa.string())).cast(pa.int64())


def _castable(text: pa.ChunkedArray, pattern: str, target: pa.DataType) -> pa.Array:
    """Which values Arrow casts to ``target``: the common syntax in bulk, the rest one by one."""
    arr = text.combine_chunks() if text.num_chunks != 1 else text.chunk(0)
    likely = pc.fill_null(pc.match_substring_regex(arr, pattern), False).to_numpy(
        zero_copy_only=False
    )
    ok = np.array(likely, dtype=np.bool_)
    try:
        pc.if_else(pa.array(ok), arr, pa.scalar(None, pa.string())).cast(target)
    except pa.ArrowInvalid:
        # Some matching value does not cast (an int beyond int64): try those one by one too.
        ok[:] = False
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    for i in np.flatnonzero(valid & ~ok):
        try:
            arr[int(i)].cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
        ok[i] = True
    return pa.array(ok)
