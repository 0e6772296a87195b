"""The JSON lines codec, :class:`JsonLinesCodec`: one JSON object per payload.

Its default engine reads a chunk with the compiled scanner of
:mod:`connectors.codecs.json_scan` (whose docstring says why there is one) and
:mod:`connectors.codecs.json_columns`; the
``arrow`` engine reads it with ``pyarrow.json``. Either leaves the records it
does not take to ``json.loads`` (the Python path, at the end of this module),
which names why a record is bad.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.json as pa_json

from connectors.codecs.json_columns import scan_json
from connectors.codecs.steps import (
    drop_position,
    finish,
    join,
    none_good,
    payloads_of,
    relabel,
    screen,
    utf8_ok,
)
from connectors.spec import FeatureSpec, SparseField
from connectors.types import BadRecord, RawChunk
from connectors.validate import INT64_MAX, INT64_MIN, Problem, check, is_utf8, show, spec_schema

_PLACEHOLDER = b"{}"
_ROW_HINT = re.compile(r"^JSON parse error: .* in row (\d+)$")


@dataclass(frozen=True)
class JsonLinesCodec:
    """One JSON object per payload; unknown keys are ignored.

    Decoding joins a chunk's payloads with newlines and checks that the whole
    buffer is UTF-8 at once. Then, with ``engine="numba"`` (the default):

    1. a compiled scanner reads, in one pass, every record that is a JSON object
       whose spec fields hold values of the right type — strings (escapes
       included), numbers, ints within int64, lists of those, nulls — and whose
       other keys hold any JSON (checked, then skipped). Numbers beyond the
       53-bit fast path are cast by Arrow, whose parser ``pyarrow.json`` uses,
       so every float is correctly rounded. The scanner leaves a record to step
       2 at the first thing it does not take: a wrong type, a syntax error, a
       duplicated spec key, a ``NaN`` literal, an escaped key. It releases the GIL.
    2. ``json.loads`` reads each record left: it names why the record is bad
       (not UTF-8, not JSON, not an object, a duplicated spec key, a value of the
       wrong type) or gives the row of a good one the scanner did not take.

    With ``engine="arrow"``, ``pyarrow.json`` with an explicit schema built from
    the spec reads the records instead of the scanner, in segments of about
    ``segment_bytes``. When a segment fails, Arrow's error names the row it
    stopped at: the rows before it are read again, that row goes to step 2,
    and the reading goes on after it (a failure that names no row halves the
    segment); records that do not start with ``{`` and end with ``}`` go to step
    2 directly (Arrow's reader crashes on a first value of ``null``). It is
    slower than the scanner, the more so with bad records
    (``benchmarks/decode_micro.py``); it is the reference the tests hold the
    scanner to. Arrow
    also takes the non-standard ``Inf``, ``-Inf`` and ``-NaN``, which
    ``json.loads`` and so the default engine do not (``not_json``).

    Every row is then checked by :func:`connectors.validate.check`. A bad
    record costs one ``json.loads``; good ones are read in bulk.

    JSON specifics: ``NaN``, ``Infinity`` and ``-Infinity`` literals are read
    (and are bad values); a number too large for a double (``1e999``) is read
    as ±Inf and is bad; an int beyond int64 in an int field is ``int_overflow``;
    a null label is ``null_label``, an absent one ``missing_label``; a null dense
    value is a missing one; a spec key given twice is ``duplicate_field``, any
    other key given twice is ignored. ``encode`` writes compact JSON with null
    values and NaN/Inf as the literals above.

    >>> from connectors.spec import FeatureSpec
    >>> tags = {"name": "tags", "table": "t", "type": "list_int"}
    >>> spec = FeatureSpec(labels=["y"], sparse=[tags])
    >>> codec = JsonLinesCodec()
    >>> payloads = codec.encode(pa.table({"y": [1.0, 0.0], "tags": [[1, 2], None]}))
    >>> payloads
    [b'{"y":1.0,"tags":[1,2]}', b'{"y":0.0,"tags":null}']
    >>> from connectors.types import Chunk, RawChunk
    >>> raw = RawChunk(Chunk("s", "p", 0, 3), np.arange(3), [*payloads, b'{"y":0,"tags":[1.5]}'])
    >>> good, bad = codec.decode(raw, spec)
    >>> good.column("tags").to_pylist(), bad[0].reason
    ([[1, 2], None], 'sparse_wrong_type')
    >>> bad[0].detail
    "sparse field 'tags' (type list_int) is a list of floats ([1.5]); it takes a list of ints"
    """

    engine: Literal["numba", "arrow"] = "numba"
    segment_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.engine not in ("numba", "arrow"):
            msg = f"engine must be 'numba' or 'arrow', got {self.engine!r}"
            raise ValueError(msg)
        if not isinstance(self.segment_bytes, int) or self.segment_bytes < 1:
            msg = f"segment_bytes must be a positive int, got {self.segment_bytes!r}"
            raise ValueError(msg)

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good records of ``raw`` and the bad ones (see the class docstring)."""
        payloads = payloads_of(raw, "json")
        n = len(payloads)
        if n == 0:
            return none_good(raw, spec, {})
        schema = spec_schema(spec)
        lens, early = screen(payloads, spec)
        joined, starts, _ = join(payloads, dict.fromkeys(early, _PLACEHOLDER), lens)
        slow: set[int] = set()  # records for json.loads
        if not utf8_ok(joined):
            slow.update(i for i in range(n) if i not in early and not is_utf8(payloads[i]))
        parts: list[tuple[pa.Table, npt.NDArray[np.int64]]] = []
        skip = np.zeros(n, dtype=np.bool_)
        skip[[*early, *slow]] = True
        if self.engine == "numba":
            table, index, left = scan_json(joined, starts, skip, spec, schema)
            parts.append((table, index))
            # What the scanner leaves is bad, or rare (an escaped key): Python reads it.
            slow.update(left.tolist())
        else:
            left = np.flatnonzero(~skip)
            tables, within, failed = _read_json_arrow(
                [payloads[i] for i in left.tolist()], schema, self.segment_bytes
            )
            parts += [(t, left[w]) for t, w in zip(tables, within, strict=True)]
            slow.update(left[failed].tolist())
        rows: list[dict[str, Any]] = []
        row_index: list[int] = []
        for i in sorted(slow):
            verdict = _classify_json(payloads[i], spec)
            if isinstance(verdict, Problem):
                early[i] = verdict._replace(row=i)
            else:
                rows.append(verdict)
                row_index.append(i)
        if rows:
            parts.append(
                (pa.Table.from_pylist(rows, schema=schema), np.array(row_index, dtype=np.int64))
            )
        table, index = _merge(parts, schema)
        checked = check(table, spec)

        def absent(p: Problem) -> str | None:
            # Arrow reads an absent key and a null alike: look at the payload to tell.
            obj = _loads_or_none(payloads[int(index[p.row])])
            if isinstance(obj, dict) and p.field not in obj:
                return f"label {p.field!r} is absent"
            return None

        relabel(checked, "null_label", "missing_label", absent)
        return finish(raw, checked, index, early)

    def plain_objects(
        self, payloads: Sequence[bytes], spec: FeatureSpec
    ) -> list[dict[str, Any]] | None:
        """Each payload as a dict when every one is plainly a JSON object; else None.

        For a few records (a prediction server's request), Python's parser
        beats building Arrow columns; :class:`pipeline.plain.PlainBatchBuilder`
        takes the dicts from here. "Plainly": non-empty, at most
        ``max_record_bytes``, UTF-8, one JSON object from its first byte to its
        last, no key given twice. None sends the caller to :meth:`decode`, which
        names what is wrong; the values are not looked at here.

        >>> spec = FeatureSpec(labels=["y"])
        >>> JsonLinesCodec().plain_objects([b'{"y": 1}', b'{"u": [1]}'], spec)
        [{'y': 1}, {'u': [1]}]
        >>> JsonLinesCodec().plain_objects([b'{"y": 1, "y": 0}'], spec) is None
        True
        """
        out: list[dict[str, Any]] = []
        limit = spec.max_record_bytes
        for payload in payloads:
            if (
                type(payload) is not bytes
                or len(payload) > limit
                or payload[:1] != b"{"
                or payload[-1:] != b"}"
            ):
                return None
            try:
                obj = json.loads(payload.decode("utf-8"), object_pairs_hook=_object)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                return None
            if type(obj) is not _Object or obj.duplicates:
                return None
            out.append(obj)
        return out

    def encode(self, table: pa.Table) -> list[bytes]:
        """One compact JSON object per row.

        >>> JsonLinesCodec().encode(pa.table({"y": [float("nan")], "u": ["é"]}))
        [b'{"y":NaN,"u":"\\xc3\\xa9"}']
        """
        table = drop_position(table)
        names = table.column_names
        # Column by column, then zipped: several times faster than Table.to_pylist.
        columns = [c.to_pylist() for c in table.columns]
        rows = zip(*columns, strict=True) if columns else [()] * table.num_rows
        dumps = json.JSONEncoder(
            separators=(",", ":"), ensure_ascii=False, default=_not_json
        ).encode
        return [dumps(dict(zip(names, row, strict=True))).encode() for row in rows]


def _merge(
    parts: list[tuple[pa.Table, npt.NDArray[np.int64]]], schema: pa.Schema
) -> tuple[pa.Table, npt.NDArray[np.int64]]:
    """Tables of rows with their record indices, as one table in record order."""
    parts = [(t, i) for t, i in parts if t.num_rows]
    if not parts:
        return schema.empty_table(), np.zeros(0, dtype=np.int64)
    if len(parts) == 1:
        table, index = parts[0]
    else:
        table = pa.concat_tables([t for t, _ in parts])
        index = np.concatenate([i for _, i in parts])
    if index.shape[0] > 1 and bool((np.diff(index) < 0).any()):
        order = np.argsort(index, kind="stable")
        table, index = table.take(pa.array(order)), index[order]
    return table, index


def _read_json_arrow(
    payloads: Sequence[bytes], schema: pa.Schema, segment_bytes: int
) -> tuple[list[pa.Table], list[npt.NDArray[np.int64]], list[int]]:
    """``pyarrow.json`` reading: tables, the payloads (indices) each holds, and failures."""
    n = len(payloads)
    # Arrow's reader must only see records that start with "{" (a first value of `null` crashes
    # it) and end with "}" (so that two records can never read as one).
    outside = [i for i, p in enumerate(payloads) if not _braced(p)]
    joined, starts, _ = join(payloads, dict.fromkeys(outside, _PLACEHOLDER))
    buffer = pa.py_buffer(joined)
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    # Segment edges fall on payload starts, about segment_bytes apart.
    cuts = np.searchsorted(starts, np.arange(segment_bytes, len(joined), segment_bytes))
    edges = np.unique(np.concatenate([[0], cuts, [n]])).tolist()
    done: list[tuple[int, pa.Table]] = []
    failed: list[int] = []
    todo = [(edges[k], edges[k + 1]) for k in range(len(edges) - 1) if edges[k] < edges[k + 1]]
    while todo:
        lo, hi = todo.pop()
        start, size = int(starts[lo]), int(starts[hi] - 1 - starts[lo])
        hint: int | None = None
        try:
            # One block per call, so that an error's row number counts from `lo`.
            table = pa_json.read_json(
                pa.BufferReader(buffer.slice(start, size)),
                read_options=pa_json.ReadOptions(use_threads=False, block_size=size + 64),
                parse_options=options,
            )
        except pa.ArrowInvalid as e:
            table = None
            found = _ROW_HINT.match(str(e))
            hint = int(found.group(1)) if found else None
        if table is not None and table.num_rows == hi - lo:
            done.append((lo, table))
        elif hi - lo == 1:
            failed.append(lo)
        elif table is None and hint is not None:
            # A hint past the end (trailing garbage is reported on the next row) means the last.
            k = lo + min(hint, hi - lo - 1)
            todo += [(a, b) for a, b in [(k + 1, hi), (k, k + 1), (lo, k)] if a < b]
        else:
            # No row named, or a payload holding several objects: halve.
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]
    done.sort(key=lambda d: d[0])
    keep = np.ones(n, dtype=np.bool_)
    keep[outside] = False
    tables, indices = [], []
    for lo, read in done:
        index = np.arange(lo, lo + read.num_rows, dtype=np.int64)
        mask = keep[index]
        tables.append(read if mask.all() else read.filter(pa.array(mask)))
        indices.append(index[mask])
    return tables, indices, sorted([*failed, *outside])


def _braced(payload: bytes) -> bool:
    if payload[:1] == b"{" and payload[-1:] == b"}":
        return True
    stripped = payload.strip(b" \t\r\n")
    return stripped[:1] == b"{" and stripped[-1:] == b"}"


def _not_json(value: Any) -> Any:
    msg = f"cannot write {type(value).__name__} value {show(value)} as JSON"
    raise TypeError(msg)


# --- the Python path: json.loads names the problem ------------------------------------------


class _Object(dict[str, Any]):
    """A decoded JSON object that remembers its duplicated keys."""

    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        obj.duplicates = tuple(k for k, c in Counter(k for k, _ in pairs).items() if c > 1)
    return obj


def _loads_or_none(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


_JSON_KINDS = {
    type(None): "null",
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    list: "list",
    _Object: "object",
    dict: "object",
}


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _classify_json(payload: bytes, spec: FeatureSpec) -> Problem | dict[str, Any]:
    """The Python path: why a payload is bad, or its row (spec fields, Arrow-ready values).

    Only decoding and type problems are found here; values are checked with
    every other row by ``check``, so a record gets the same verdict on either path.
    """
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        return Problem(
            -1,
            "not_utf8",
            None,
            f"byte {e.start} ({payload[e.start : e.start + 1]!r}) of the payload is not UTF-8",
        )
    try:
        obj = json.loads(text, object_pairs_hook=_object)
    except (ValueError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        return Problem(
            -1, "not_json", None, f"the payload is not JSON ({reason}): {show(text, 60)}"
        )
    if not isinstance(obj, dict):
        return Problem(
            -1,
            "not_object",
            None,
            f"the payload is a JSON {_kind(obj)} ({show(obj, 60)}), not an object",
        )
    names = [*spec.labels, *(d.name for d in spec.dense), *(s.name for s in spec.sparse)]
    for name in getattr(obj, "duplicates", ()):
        if name in names:
            return Problem(
                -1, "duplicate_field", name, f"field {name!r} appears more than once in the object"
            )
    row: dict[str, Any] = {}
    for name in spec.labels:
        value = _json_number(obj.get(name))
        if isinstance(value, _Wrong):
            v = obj[name]
            return Problem(
                -1,
                "label_wrong_type",
                name,
                f"label {name!r} is a {_kind(v)} ({show(v)}); labels are numbers in [0, 1]",
            )
        row[name] = value
    for d in spec.dense:
        value = _json_number(obj.get(d.name))
        if isinstance(value, _Wrong):
            v = obj[d.name]
            return Problem(
                -1,
                "dense_wrong_type",
                d.name,
                f"dense field {d.name!r} is a {_kind(v)} ({show(v)}); dense fields are numbers",
            )
        row[d.name] = value
    for s in spec.sparse:
        v = obj.get(s.name)
        problem = _json_sparse_problem(v, s)
        if problem is not None:
            return problem
        row[s.name] = v
    return row


class _Wrong:
    """Marks a value that is not a JSON number."""


_WRONG = _Wrong()


def _json_number(value: Any) -> float | _Wrong | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return _WRONG
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            # Arrow reads an integer literal too large for a double as ±Inf; so do we.
            return math.copysign(math.inf, value)
    if isinstance(value, float):
        return value
    return _WRONG


def _json_sparse_problem(value: Any, field: SparseField) -> Problem | None:
    what = f"sparse field {field.name!r} (type {field.type})"
    if value is None:
        return None
    if field.type == "string":
        if isinstance(value, str):
            return _surrogate_problem(value, field.name, what)
        return Problem(
            -1,
            "sparse_wrong_type",
            field.name,
            f"{what} is a {_kind(value)} ({show(value)}); it takes a string",
        )
    if field.type == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            if INT64_MIN <= value <= INT64_MAX:
                return None
            return Problem(-1, "int_overflow", field.name, f"{what} is {show(value)}, beyond int64")
        return Problem(
            -1,
            "sparse_wrong_type",
            field.name,
            f"{what} is a {_kind(value)} ({show(value)}); it takes an int",
        )
    if not isinstance(value, list):
        return Problem(
            -1,
            "sparse_wrong_type",
            field.name,
            f"{what} is a {_kind(value)} ({show(value)}); it takes a list",
        )
    want = "string" if field.type == "list_string" else "int"
    for e in value:
        if e is None:
            return Problem(
                -1,
                "sparse_wrong_type",
                field.name,
                f"{what} holds a null element ({show(value)}); list elements are not null",
            )
        if want == "string" and isinstance(e, str):
            problem = _surrogate_problem(e, field.name, what)
            if problem is not None:
                return problem
            continue
        if want == "int" and isinstance(e, int) and not isinstance(e, bool):
            if not INT64_MIN <= e <= INT64_MAX:
                return Problem(
                    -1,
                    "int_overflow",
                    field.name,
                    f"{what} holds {show(value)}, with an element beyond int64",
                )
            continue
        return Problem(
            -1,
            "sparse_wrong_type",
            field.name,
            f"{what} is a list of {_kind(e)}s ({show(value)}); it takes a list of {want}s",
        )
    return None


def _surrogate_problem(value: str, field: str, what: str) -> Problem | None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate escape such as "\\ud800": JSON allows it, UTF-8 cannot hold it.
        return Problem(
            -1,
            "not_utf8",
            field,
            f"{what} holds {show(value)}, a lone surrogate that is not valid UTF-8",
        )
    return None
