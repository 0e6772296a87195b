"""Codecs: record payloads to Arrow tables of good records, and bad records to dead-letter.

Three codecs share one protocol, :class:`Codec`:

- :class:`JsonLinesCodec` (the default): one JSON object per payload, all the
  payloads of a chunk read at once by a compiled scanner (or ``pyarrow.json``);
- :class:`CriteoTsvCodec`: Criteo lines ``label \\t I1..I13 \\t C1..C26``, read by
  ``pyarrow.csv``;
- :class:`ArrowIpcCodec`: each payload an Arrow IPC stream of one or more rows.

``decode`` returns a table of the good records only (the columns of
:func:`connectors.validate.spec_schema` and ``__position``, in record order)
and one :class:`~connectors.types.BadRecord` per bad record, in record order.
It never raises for a bad record; it raises ``ValueError`` for a bad
configuration (a TSV codec asked to read a list field). The reasons are listed
in :data:`connectors.validate.REASONS`.

``encode`` turns a table into payloads, one per row (``ArrowIpcCodec`` can
pack several rows per payload); it is for test data and ``streamrec produce``.

Why a hand-written JSON scanner rather than a library: measured against
well-kept libraries, each put in the scanner's place with the rest
of ``JsonLinesCodec.decode`` unchanged, and each checked to give the scanner's
good table and bad records on the timed records and on awkward ones. Events
per second on 100,000 Criteo-like records (590 bytes each) in one chunk; "1%
bad" has one record in 100 bad (a string label, or a truncated payload)::

    reader                              clean   vs scanner    1% bad   vs scanner
    scanner (numba, the default)      411-438k     1.00      386-394k     1.00
    pyarrow.json, engine="arrow"      240-251k     0.57-0.58  82-91k      0.21-0.24
    pyarrow.json, whole chunk [1]     235-242k     0.55-0.57  29-30k      0.07-0.08
    orjson 3.13 per record [2]        100-105k     0.24       84-96k      0.21-0.25
    pysimdjson 7.0 per record [2]      73-74k      0.17-0.18  70-71k      0.18
    json.loads loop, fewer checks      75-104k     0.18-0.24

    [1] a chunk that fails goes record by record to json.loads
    [2] spec fields by itemgetter, columns by pyarrow.array; neither library
        reports a spec key given twice (duplicate_field), as the scanner does

2-core machine shared with other work, one core, best of 7 round-robin runs,
two runs (the ranges): ``python benchmarks/decode_micro.py --repeats 7``
(``pip install -e ".[bench]"`` for orjson and pysimdjson). No library comes
within 10% of the scanner, so it stays; per-record libraries pay Python's
per-record and per-value costs, which the scanner's single pass does not.

>>> import numpy as np
>>> from connectors.types import Chunk, RawChunk
>>> from pipeline.spec import FeatureSpec
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"], "dense": [{"name": "price"}],
...     "sparse": [{"name": "user", "table": "users"}],
... })
>>> payloads = [b'{"click": 1, "price": 2.5, "user": "u1"}', b'{"click": "yes"}', b'{"cl']
>>> raw = RawChunk(Chunk("kafka", "events/0", 40, 43), np.arange(40, 43), payloads)
>>> good, bad = make_codec("json").decode(raw, spec)
>>> good.to_pylist()
[{'click': 1.0, 'price': 2.5, 'user': 'u1', '__position': 40}]
>>> [(b.position, b.reason) for b in bad]
[(41, 'label_wrong_type'), (42, 'not_json')]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.ipc as pa_ipc
import pyarrow.json as pa_json

from connectors.types import BadRecord, RawChunk
from connectors.validate import (
    INT64_MAX,
    INT64_MIN,
    POSITION,
    Checked,
    Marker,
    Problem,
    check,
    is_utf8,
    problems_to_bad,
    show,
    spec_schema,
    utf8_or_null,
    with_positions,
)
from pipeline.spec import FeatureSpec, SparseField

CodecName = Literal["json", "criteo_tsv", "arrow"]


class Codec(Protocol):
    """Payload bytes to a table of good records and a list of bad ones, and back."""

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good records of ``raw`` (spec columns and ``__position``) and the bad ones."""
        ...

    def encode(self, table: pa.Table) -> list[bytes]:
        """Payloads for the rows of ``table`` (a ``__position`` column is left out)."""
        ...


def make_codec(name: CodecName, **options: Any) -> Codec:
    """The codec called ``name``, with its options (unknown options are an error).

    >>> make_codec("criteo_tsv", columns=["y", "a", "b"])
    CriteoTsvCodec(columns=('y', 'a', 'b'))
    >>> make_codec("json", colums=["y"])
    Traceback (most recent call last):
    ...
    ValueError: codec 'json' has no option 'colums'; its options: ['engine', 'segment_bytes']
    """
    codecs: dict[str, type[JsonLinesCodec] | type[CriteoTsvCodec] | type[ArrowIpcCodec]] = {
        "json": JsonLinesCodec,
        "criteo_tsv": CriteoTsvCodec,
        "arrow": ArrowIpcCodec,
    }
    cls = codecs.get(name)
    if cls is None:
        msg = f"unknown codec {name!r}; the codecs are {sorted(codecs)}"
        raise ValueError(msg)
    allowed = sorted(f.name for f in dataclasses.fields(cls))
    for option in options:
        if option not in allowed:
            msg = f"codec {name!r} has no option {option!r}; its options: {allowed}"
            raise ValueError(msg)
    return cls(**options)


# --- shared steps -------------------------------------------------------------------------


def _payloads_of(raw: RawChunk, codec: str) -> Sequence[bytes]:
    if raw.payloads is None:
        msg = (
            f"chunk {raw.chunk.name} holds an Arrow table, not payloads: the {codec} codec "
            "decodes payloads (check a table with connectors.validate.validate)"
        )
        raise ValueError(msg)
    if len(raw.payloads) != len(raw.positions):
        msg = (
            f"chunk {raw.chunk.name} has {len(raw.payloads)} payloads "
            f"but {len(raw.positions)} positions"
        )
        raise ValueError(msg)
    return raw.payloads


def _screen(
    payloads: Sequence[bytes], spec: FeatureSpec
) -> tuple[npt.NDArray[np.int64], dict[int, Problem]]:
    """Payload lengths, and the empty and oversize payloads (which are not decoded)."""
    n = len(payloads)
    lens = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    early: dict[int, Problem] = {}
    for i in np.flatnonzero(lens == 0):
        early[int(i)] = Problem(int(i), "empty_payload", None, "the payload is empty (0 bytes)")
    limit = spec.max_record_bytes
    for i in np.flatnonzero(lens > limit):
        early[int(i)] = Problem(
            int(i),
            "oversize",
            None,
            f"the payload is {int(lens[i]):,} bytes, over max_record_bytes {limit:,}",
        )
    return lens, early


def _join(
    payloads: Sequence[bytes],
    replaced: dict[int, bytes],
    lens: npt.NDArray[np.int64] | None = None,
) -> tuple[bytes, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Payloads joined by newlines (some replaced), each one's start offset and length.

    ``starts`` has one more entry than there are payloads: where a payload after
    the last would start. ``lens`` saves measuring the payloads again.
    """
    if replaced:
        work = list(payloads)
        for i, p in replaced.items():
            work[i] = p
        payloads = work
    joined = b"\n".join(payloads)
    if lens is None or replaced:
        lens = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
    starts = np.zeros(len(payloads) + 1, dtype=np.int64)
    np.cumsum(lens + 1, out=starts[1:])
    return joined, starts, lens


def _utf8_ok(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, checked by Arrow's (SIMD) validator without a copy."""
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64))
    text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(data)])
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _finish(
    raw: RawChunk,
    checked: Checked,
    record_of_row: npt.NDArray[np.int64],
    early: dict[int, Problem],
    raw_of_row: Callable[[int], bytes] | None = None,
) -> tuple[pa.Table, list[BadRecord]]:
    """The good table with positions, and every bad record (early ones too) in record order."""
    positions = np.asarray(raw.positions, dtype=np.int64)[record_of_row]
    good = with_positions(checked.table, checked.good, positions)
    late = problems_to_bad(checked.problems, record_of_row, raw, raw_of_row)
    keyed = [
        (int(record_of_row[p.row]), p.row, b) for p, b in zip(checked.problems, late, strict=True)
    ]
    if early:
        keyed += [
            (i, -1, b)
            for i, b in zip(
                early,
                problems_to_bad(list(early.values()), np.arange(len(raw), dtype=np.int64), raw),
                strict=True,
            )
        ]
    keyed.sort(key=lambda k: (k[0], k[1]))
    return good, [b for _, _, b in keyed]


def _relabel(
    checked: Checked, reason: str, new_reason: str, new_detail: Callable[[Problem], str | None]
) -> None:
    """Rewrite some problems of ``reason`` (when ``new_detail`` gives a sentence)."""
    for k, p in enumerate(checked.problems):
        if p.reason == reason:
            detail = new_detail(p)
            if detail is not None:
                checked.problems[k] = p._replace(reason=new_reason, detail=detail)


def _none_good(
    raw: RawChunk, spec: FeatureSpec, early: dict[int, Problem]
) -> tuple[pa.Table, list[BadRecord]]:
    """No good records: an empty good table, and the ``early`` problems in record order."""
    bad = problems_to_bad(
        [early[i] for i in sorted(early)], np.arange(len(raw), dtype=np.int64), raw
    )
    return spec_schema(spec, position=True).empty_table(), bad


def _drop_position(table: pa.Table) -> pa.Table:
    return table.drop_columns([POSITION]) if POSITION in table.column_names else table


# --- JSON lines ---------------------------------------------------------------------------

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
    2 directly (Arrow's reader crashes on a first value of ``null``). It reads
    Criteo-like records at about 0.57x the scanner's rate on one core (0.2x
    with 1% bad records; the table in the module docstring); it is the
    reference the tests hold the scanner to. Arrow
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

    >>> from pipeline.spec import FeatureSpec
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
        payloads = _payloads_of(raw, "json")
        n = len(payloads)
        if n == 0:
            return _none_good(raw, spec, {})
        schema = spec_schema(spec)
        lens, early = _screen(payloads, spec)
        joined, starts, _ = _join(payloads, dict.fromkeys(early, _PLACEHOLDER), lens)
        slow: set[int] = set()  # records for json.loads
        if not _utf8_ok(joined):
            slow.update(i for i in range(n) if i not in early and not is_utf8(payloads[i]))
        parts: list[tuple[pa.Table, npt.NDArray[np.int64]]] = []
        skip = np.zeros(n, dtype=np.bool_)
        skip[[*early, *slow]] = True
        if self.engine == "numba":
            table, index, left = _scan_json(joined, starts, skip, spec, schema)
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

        _relabel(checked, "null_label", "missing_label", absent)
        return _finish(raw, checked, index, early)

    def encode(self, table: pa.Table) -> list[bytes]:
        """One compact JSON object per row.

        >>> JsonLinesCodec().encode(pa.table({"y": [float("nan")], "u": ["é"]}))
        [b'{"y":NaN,"u":"\\xc3\\xa9"}']
        """
        table = _drop_position(table)
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
    joined, starts, _ = _join(payloads, dict.fromkeys(outside, _PLACEHOLDER))
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


# --- the JSON scanner (numba) -------------------------------------------------------------
#
# The scanner reads the records whose spec fields it can read exactly and leaves any other
# record (status 1) to json.loads, which names the problem. Its helpers return early
# rather than `break` out of loops: numba compiles the early-return form several times faster.

_K_FLOAT, _K_STRING, _K_INT, _K_LIST_STRING, _K_LIST_INT = 0, 1, 2, 3, 4
_KINDS = {
    "string": _K_STRING,
    "int": _K_INT,
    "list_string": _K_LIST_STRING,
    "list_int": _K_LIST_INT,
}
_QUOTE, _BACKSLASH = 34, 92
_SIMPLE_ESCAPES = (34, 92, 47, 98, 102, 110, 114, 116)  # \" \\ \/ \b \f \n \r \t
_MAX_DEPTH = 64  # nesting of skipped values; deeper records go to json.loads
_POW10 = np.array([10.0**k for k in range(23)])
_TWO53 = np.uint64(1 << 53)
_I64_MAX = np.uint64(INT64_MAX)
_I64_NEG = np.uint64(1 << 63)
_FNV_OFFSET, _FNV_PRIME = 14695981039346656037, 1099511628211


@nb.njit(nogil=True, cache=True, inline="always")
def _ws(buf: Any, p: int, end: int) -> int:
    while p < end:
        c = buf[p]
        if c != 32 and c != 9 and c != 10 and c != 13:  # noqa: PLR1714 (numba: no sets)
            return p
        p += 1
    return p


@nb.njit(nogil=True, cache=True, inline="always")
def _string(buf: Any, p: int, end: int) -> int:
    """``p`` at an opening quote: the position after the closing one.

    -1 for a control byte or an unterminated string; ``-2 - q`` (with ``q``
    the position after the quote) when the string has escapes, which are
    checked later, by ``_escapes_ok``, for the few records that have any: a
    check here would slow the common case.
    """
    p += 1
    esc = False
    while p < end:
        c = buf[p]
        if c == _QUOTE:
            return -3 - p if esc else p + 1
        if c == _BACKSLASH:
            esc = True
            p += 2
            continue
        if c < 32:
            return -1
        p += 1
    return -1


@nb.njit(nogil=True, cache=True, inline="always")
def _string_end(buf: Any, p: int, end: int, esc: Any) -> int:
    """``_string`` that notes escapes in ``esc[0]``: the position after the string, or -1."""
    q = _string(buf, p, end)
    if q < -1:
        esc[0] = 1
        return -2 - q
    return q


@nb.njit(nogil=True, cache=True, inline="always")
def _hex4(buf: Any, p: int) -> int:
    v = 0
    for k in range(4):
        c = buf[p + k]
        if 48 <= c <= 57:
            d = c - 48
        elif 97 <= c <= 102:
            d = c - 87
        elif 65 <= c <= 70:
            d = c - 55
        else:
            return -1
        v = v * 16 + d
    return v


@nb.njit(nogil=True, cache=True)
def _escapes_ok(buf: Any, p: int, end: int) -> bool:
    """Whether every escape in the strings of a scanned record is valid JSON and UTF-8.

    A lone surrogate (``\\ud800``) is not: UTF-8 cannot hold it (json.loads says so).
    """
    inside = False
    while p < end:
        c = buf[p]
        if c == _QUOTE:
            inside = not inside
            p += 1
            continue
        if c != _BACKSLASH or not inside:
            p += 1
            continue
        e = buf[p + 1]
        if e in _SIMPLE_ESCAPES:
            p += 2
            continue
        if e != 117 or p + 6 > end:  # not \uXXXX
            return False
        v = _hex4(buf, p + 2)
        if v < 0 or 0xDC00 <= v <= 0xDFFF:
            return False
        if 0xD800 <= v <= 0xDBFF:
            if p + 12 > end or buf[p + 6] != _BACKSLASH or buf[p + 7] != 117:
                return False
            w = _hex4(buf, p + 8)
            if not 0xDC00 <= w <= 0xDFFF:
                return False
            p += 12
        else:
            p += 6
    return True


@nb.njit(nogil=True, cache=True, inline="always")
def _number(buf: Any, p: int, end: int) -> tuple[int, bool, bool, np.uint64, int, bool]:
    """A JSON number at ``p``: (end or -1, is an int, negative, digits, exponent, exact).

    The value is ``digits * 10**exponent``; ``exact`` is false when there were
    more than 19 significant digits (the later ones were dropped).
    """
    neg = False
    w = np.uint64(0)
    if p < end and buf[p] == 45:
        neg = True
        p += 1
    if p >= end:
        return -1, False, neg, w, 0, False
    nd = 0
    e10 = 0
    exact = True
    is_int = True
    c = buf[p]
    if c == 48:
        p += 1
        if p < end and 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False  # a leading zero
    elif 49 <= c <= 57:
        while p < end and 48 <= buf[p] <= 57:
            if nd < 19:
                w = w * np.uint64(10) + np.uint64(buf[p] - 48)
                nd += 1
            else:
                e10 += 1
                exact = False
            p += 1
    else:
        return -1, False, neg, w, 0, False
    if p < end and buf[p] == 46:
        is_int = False
        p += 1
        if p >= end or not 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False
        while p < end and 48 <= buf[p] <= 57:
            d = buf[p] - 48
            if nd < 19:
                if w > np.uint64(0) or d > 0:
                    nd += 1
                w = w * np.uint64(10) + np.uint64(d)
                e10 -= 1
            elif d != 0:
                exact = False
            p += 1
    if p < end and (buf[p] == 101 or buf[p] == 69):
        is_int = False
        p += 1
        sign = 1
        if p < end and (buf[p] == 43 or buf[p] == 45):
            if buf[p] == 45:
                sign = -1
            p += 1
        if p >= end or not 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False
        ex = 0
        while p < end and 48 <= buf[p] <= 57:
            if ex < 100000:
                ex = ex * 10 + (buf[p] - 48)
            p += 1
        e10 += sign * ex
    return p, is_int, neg, w, e10, exact


@nb.njit(nogil=True, cache=True, inline="always")
def _exact_float(neg: bool, w: np.uint64, e10: int, exact: bool) -> tuple[bool, float]:
    """``digits * 10**e10`` when one IEEE operation rounds it correctly (Clinger's fast path)."""
    if not exact:
        return False, 0.0
    if w == np.uint64(0):
        return True, -0.0 if neg else 0.0
    if w > _TWO53 or e10 > 22 or e10 < -22:
        return False, 0.0
    v = float(w)
    v = v * _POW10[e10] if e10 >= 0 else v / _POW10[-e10]
    return True, -v if neg else v


@nb.njit(nogil=True, cache=True, inline="always")
def _int64(neg: bool, w: np.uint64) -> tuple[bool, Any]:
    if neg:
        if w > _I64_NEG:
            return False, 0
        if w == np.uint64(0):
            return True, 0
        return True, -np.int64(w - np.uint64(1)) - 1
    if w > _I64_MAX:
        return False, 0
    return True, np.int64(w)


@nb.njit(nogil=True, cache=True, inline="always")
def _literal(buf: Any, p: int, end: int, word: Any) -> int:
    """The position after ``word`` at ``p``, or -1."""
    k: int = word.shape[0]
    if p + k > end:
        return -1
    for j in range(k):
        if buf[p + j] != word[j]:
            return -1
    return p + k


_NULL = np.frombuffer(b"null", dtype=np.uint8).copy()
_TRUE = np.frombuffer(b"true", dtype=np.uint8).copy()
_FALSE = np.frombuffer(b"false", dtype=np.uint8).copy()


@nb.njit(nogil=True, cache=True, inline="always")
def _object_key(buf: Any, p: int, end: int, esc: Any) -> int:
    """From a key's opening quote at ``p``: the position after its ``:``, or -1."""
    if p >= end or buf[p] != _QUOTE:
        return -1
    p = _string_end(buf, p, end, esc)
    if p < 0:
        return -1
    p = _ws(buf, p, end)
    if p >= end or buf[p] != 58:  # ':'
        return -1
    return p + 1


@nb.njit(nogil=True, cache=True)
def _skip_value(buf: Any, p: int, end: int, stack: Any, esc: Any) -> int:
    """Check and pass over any JSON value at ``p`` (an unknown key's); -1 if it is not JSON.

    Sets ``esc[0]`` when a string in it has escapes.
    """
    depth = 0
    while True:
        p = _ws(buf, p, end)
        if p >= end:
            return -1
        c = buf[p]
        if c == 123 or c == 91:  # noqa: PLR1714 ({ or [)
            if depth >= stack.shape[0]:
                return -1
            stack[depth] = c
            depth += 1
            p = _ws(buf, p + 1, end)
            if p < end and buf[p] == c + 2:  # } or ]
                depth -= 1
                p += 1
            elif c == 123:
                p = _object_key(buf, p, end, esc)
                if p < 0:
                    return -1
                continue
            else:
                continue
        elif c == _QUOTE:
            p = _string_end(buf, p, end, esc)
        elif c == 45 or 48 <= c <= 57:
            p, _, _, _, _, _ = _number(buf, p, end)
        elif c == 116:
            p = _literal(buf, p, end, _TRUE)
        elif c == 102:
            p = _literal(buf, p, end, _FALSE)
        elif c == 110:
            p = _literal(buf, p, end, _NULL)
        else:
            return -1
        if p < 0:
            return -1
        # After a value: close containers, or go on to the next value.
        more = False
        while depth > 0 and not more:
            p = _ws(buf, p, end)
            if p >= end:
                return -1
            c = buf[p]
            top = stack[depth - 1]
            if c == top + 2:  # the matching } or ]
                depth -= 1
                p += 1
            elif c == 44:
                p += 1
                more = True
                if top == 123:
                    p = _object_key(buf, _ws(buf, p, end), end, esc)
                    if p < 0:
                        return -1
            else:
                return -1
        if not more:
            return p


@nb.njit(nogil=True, cache=True, inline="always")
def _field_of(buf: Any, s: int, e: int, keys: Any, key_off: Any, table: Any, mask: int) -> int:
    """The spec field named by the key bytes ``buf[s:e]``, or -1 (FNV-1a, linear probing)."""
    h = np.uint64(_FNV_OFFSET)
    for k in range(s, e):
        h = (h ^ np.uint64(buf[k])) * np.uint64(_FNV_PRIME)
    slot = np.int64(h & np.uint64(mask))
    while True:
        f: int = table[slot]
        if f < 0:
            return -1
        if _same(buf, s, e, keys, key_off[f], key_off[f + 1]):
            return f
        slot = (slot + 1) & mask


@nb.njit(nogil=True, cache=True, inline="always")
def _same(buf: Any, s: int, e: int, keys: Any, ks: int, ke: int) -> bool:
    if ke - ks != e - s:
        return False
    for k in range(e - s):  # noqa: SIM110 (numba compiles loops, not generators)
        if keys[ks + k] != buf[s + k]:
            return False
    return True


@nb.njit(nogil=True, cache=True)
def _scan_record(
    buf: Any, p: int, end: int, i: int, kind: Any, slot: Any, keys: Any, key_off: Any,
    table: Any, mask: int, seen: Any, stack: Any, fval: Any, fstate: Any, fspan: Any,
    ival: Any, istate: Any, sspan: Any, sstate: Any, lfirst: Any, lcount: Any, lstate: Any,
    lints: Any, lstrs: Any, used: Any, esc: Any,
) -> int:  # fmt: skip
    """Read record ``i`` (bytes ``p..end``): 0 when read, 1 to leave it, 2 when out of list room.

    Sets ``esc[0]`` when a string in the record has escapes (unchecked so far).
    """
    p = _ws(buf, p, end)
    if p >= end or buf[p] != 123:
        return 1
    p = _ws(buf, p + 1, end)
    if p < end and buf[p] == 125:
        return 0 if _ws(buf, p + 1, end) == end else 1
    while True:
        if p >= end or buf[p] != _QUOTE:
            return 1
        q = _string(buf, p, end)
        if q < 0:
            return 1  # keys with escapes are left to json.loads
        f = _field_of(buf, p + 1, q - 1, keys, key_off, table, mask)
        p = _ws(buf, q, end)
        if p >= end or buf[p] != 58:
            return 1
        p = _ws(buf, p + 1, end)
        if p >= end:
            return 1
        if f < 0:
            p = _skip_value(buf, p, end, stack, esc)
            if p < 0:
                return 1
        else:
            if seen[f] == i:
                return 1  # a spec key twice
            seen[f] = i
            k = kind[f]
            j = slot[f]
            c = buf[p]
            if c == 110:
                p = _literal(buf, p, end, _NULL)
                if p < 0:
                    return 1
            elif k == _K_FLOAT:
                if c != 45 and not 48 <= c <= 57:
                    return 1
                q, _, neg, w, e10, exact = _number(buf, p, end)
                if q < 0:
                    return 1
                good, v = _exact_float(neg, w, e10, exact)
                if good:
                    fval[i, j] = v
                    fstate[i, j] = 1
                else:
                    fspan[i, j, 0] = p
                    fspan[i, j, 1] = q
                    fstate[i, j] = 2
                p = q
            elif k == _K_STRING:
                if c != _QUOTE:
                    return 1
                q = _string(buf, p, end)
                if q == -1:
                    return 1
                if q < -1:
                    q = -2 - q
                    esc[0] = 1
                    sstate[i, j] = 2
                else:
                    sstate[i, j] = 1
                sspan[i, j, 0] = p + 1
                sspan[i, j, 1] = q - 1
                p = q
            elif k == _K_INT:
                if c != 45 and not 48 <= c <= 57:
                    return 1
                q, is_int, neg, w, _, exact = _number(buf, p, end)
                if q < 0 or not is_int or not exact:
                    return 1
                fits, v = _int64(neg, w)
                if not fits:
                    return 1
                ival[i, j] = v
                istate[i, j] = 1
                p = q
            else:
                if c != 91:
                    return 1
                p = _ws(buf, p + 1, end)
                first = used[0] if k == _K_LIST_INT else used[1]
                count = 0
                if p < end and buf[p] == 93:
                    p += 1
                else:
                    while True:
                        if p >= end:
                            return 1
                        c = buf[p]
                        if k == _K_LIST_INT:
                            if c != 45 and not 48 <= c <= 57:
                                return 1
                            q, is_int, neg, w, _, exact = _number(buf, p, end)
                            if q < 0 or not is_int or not exact:
                                return 1
                            fits, v = _int64(neg, w)
                            if not fits:
                                return 1
                            if used[0] >= lints.shape[0]:
                                return 2
                            lints[used[0]] = v
                            used[0] += 1
                        else:
                            if c != _QUOTE:
                                return 1
                            q = _string(buf, p, end)
                            if q == -1:
                                return 1
                            if used[1] >= lstrs.shape[0]:
                                return 2
                            lstrs[used[1], 2] = 0
                            if q < -1:
                                q = -2 - q
                                esc[0] = 1
                                lstrs[used[1], 2] = 1
                            lstrs[used[1], 0] = p + 1
                            lstrs[used[1], 1] = q - 1
                            used[1] += 1
                        count += 1
                        p = _ws(buf, q, end)
                        if p < end and buf[p] == 44:
                            p = _ws(buf, p + 1, end)
                        elif p < end and buf[p] == 93:
                            p += 1
                            break
                        else:
                            return 1
                lfirst[i, j] = first
                lcount[i, j] = count
                lstate[i, j] = 1
        p = _ws(buf, p, end)
        if p < end and buf[p] == 44:
            p = _ws(buf, p + 1, end)
        elif p < end and buf[p] == 125:
            return 0 if _ws(buf, p + 1, end) == end else 1
        else:
            return 1


@nb.njit(nogil=True, cache=True)
def _scan_records(
    buf: Any, starts: Any, skip: Any, kind: Any, slot: Any, keys: Any, key_off: Any,
    table: Any, mask: int, status: Any, fval: Any, fstate: Any, fspan: Any, ival: Any,
    istate: Any, sspan: Any, sstate: Any, lfirst: Any, lcount: Any, lstate: Any,
    lints: Any, lstrs: Any,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """Scan every record not skipped; returns the list element stores and their use."""
    n = starts.shape[0] - 1
    seen = np.full(kind.shape[0], -1, np.int64)
    stack = np.empty(_MAX_DEPTH, np.int64)  # open containers of a skipped value
    used = np.zeros(2, np.int64)
    esc = np.zeros(1, np.int64)
    for i in range(n):
        if skip[i]:
            status[i] = 2
            continue
        while True:
            before0, before1 = used[0], used[1]
            esc[0] = 0
            r = _scan_record(
                buf, starts[i], starts[i + 1] - 1, i, kind, slot, keys, key_off, table, mask,
                seen, stack, fval, fstate, fspan, ival, istate, sspan, sstate, lfirst, lcount,
                lstate, lints, lstrs, used, esc,
            )  # fmt: skip
            if r == 0 and esc[0] and not _escapes_ok(buf, starts[i], starts[i + 1] - 1):
                r = 1
            if r != 2:
                break
            # Out of room for list elements: grow, and read the record again.
            used[0], used[1] = before0, before1
            seen[:] = -1
            if used[0] + 1 >= lints.shape[0]:
                lints = np.concatenate((lints, np.empty(lints.shape[0] + 1024, np.int64)))
            if used[1] + 1 >= lstrs.shape[0]:
                lstrs = np.concatenate((lstrs, np.empty((lstrs.shape[0] + 1024, 3), np.int64)))
        status[i] = r
    return lints, lstrs, used


@nb.njit(nogil=True, cache=True)
def _unescape(buf: Any, s: int, e: int, data: Any, o: int) -> int:
    """Decode the escaped string bytes ``buf[s:e]`` (already checked) into ``data[o:]``."""
    p = s
    while p < e:
        c = buf[p]
        if c != _BACKSLASH:
            data[o] = c
            o += 1
            p += 1
            continue
        x = buf[p + 1]
        if x != 117:
            # \b \f \n \r \t, or the character itself (\" \\ \/).
            if x == 98:
                data[o] = 8
            elif x == 102:
                data[o] = 12
            elif x == 110:
                data[o] = 10
            elif x == 114:
                data[o] = 13
            elif x == 116:
                data[o] = 9
            else:
                data[o] = x
            o += 1
            p += 2
            continue
        v = _hex4(buf, p + 2)
        p += 6
        if 0xD800 <= v <= 0xDBFF:
            v = 0x10000 + ((v - 0xD800) << 10) + (_hex4(buf, p + 2) - 0xDC00)
            p += 6
        if v < 0x80:
            data[o] = v
            o += 1
        elif v < 0x800:
            data[o] = 0xC0 | (v >> 6)
            data[o + 1] = 0x80 | (v & 0x3F)
            o += 2
        elif v < 0x10000:
            data[o] = 0xE0 | (v >> 12)
            data[o + 1] = 0x80 | ((v >> 6) & 0x3F)
            data[o + 2] = 0x80 | (v & 0x3F)
            o += 3
        else:
            data[o] = 0xF0 | (v >> 18)
            data[o + 1] = 0x80 | ((v >> 12) & 0x3F)
            data[o + 2] = 0x80 | ((v >> 6) & 0x3F)
            data[o + 3] = 0x80 | (v & 0x3F)
            o += 4
    return o


@nb.njit(nogil=True, cache=True)
def _unescaped_length(buf: Any, s: int, e: int) -> int:
    """The UTF-8 length of the escaped string bytes ``buf[s:e]`` (already checked)."""
    p = s
    n = 0
    while p < e:
        if buf[p] != _BACKSLASH:
            n += 1
            p += 1
        elif buf[p + 1] != 117:
            n += 1
            p += 2
        else:
            v = _hex4(buf, p + 2)
            p += 6
            if 0xD800 <= v <= 0xDBFF:
                n += 4
                p += 6
            else:
                n += 1 if v < 0x80 else 2 if v < 0x800 else 3
    return n


@nb.njit(nogil=True, cache=True)
def _string_offsets(span: Any, state: Any, rows: Any, buf: Any) -> tuple[Any, Any, Any]:
    """Where each string goes: per-column offsets, each column's base in one buffer, and
    ``dest[k, j]``, the position of row ``rows[k]``'s string of column ``j`` in that buffer.

    Lengths are decoded ones (escapes shrink a string).
    """
    m = rows.shape[0]
    ns = state.shape[1]
    totals = np.zeros(ns, np.int64)
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            st = state[r, j]
            if st == 1:
                totals[j] += span[r, j, 1] - span[r, j, 0]
            elif st == 2:
                totals[j] += _unescaped_length(buf, span[r, j, 0], span[r, j, 1])
    base = np.zeros(ns + 1, np.int64)
    for j in range(ns):
        base[j + 1] = base[j] + totals[j]
    if ns and totals.max() >= 1 << 31:
        # Beyond Arrow's int32 string offsets: the caller raises.
        return np.zeros((0, 0), np.int32), base, np.zeros((0, 0), np.int64)
    offsets = np.zeros((ns, m + 1), np.int32)
    dest = np.empty((m, ns), np.int64)
    cur = base[:ns].copy()
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            dest[k, j] = cur[j]
            st = state[r, j]
            if st == 1:
                cur[j] += span[r, j, 1] - span[r, j, 0]
            elif st == 2:
                cur[j] += _unescaped_length(buf, span[r, j, 0], span[r, j, 1])
            offsets[j, k + 1] = cur[j] - base[j]
    return offsets, base, dest


@nb.njit(nogil=True, cache=True)
def _copy_strings(buf: Any, span: Any, state: Any, rows: Any, dest: Any, data: Any) -> None:
    """Copy (decoding escapes) ``span[r, j]`` to ``data[dest[k, j]:]``, row by row.

    Walking the records in order, all columns at once, reads the source buffer once.
    """
    m = rows.shape[0]
    ns = state.shape[1]
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            st = state[r, j]
            if st == 1:
                s = span[r, j, 0]
                o = dest[k, j]
                for q in range(span[r, j, 1] - s):
                    data[o + q] = buf[s + q]
            elif st == 2:
                _unescape(buf, span[r, j, 0], span[r, j, 1], data, dest[k, j])


def _gather(
    buf: npt.NDArray[np.uint8],
    span: npt.NDArray[np.int64],
    state: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.int64],
) -> list[pa.Array]:
    """String columns from spans: column ``j`` holds ``span[r, j]`` for each row ``r`` of ``rows``.

    ``state[r, j]`` is 0 for null, 1 for plain bytes, 2 for a JSON string with escapes.
    """
    offsets, base, dest = _string_offsets(span, state, rows, buf)
    ns = state.shape[1]
    if offsets.shape[0] != ns:
        msg = "a string column of this chunk holds 2 GiB or more: read smaller chunks"
        raise ValueError(msg)
    data = np.empty(int(base[-1]), dtype=np.uint8)
    _copy_strings(buf, span, state, rows, dest, data)
    valid = state[rows] > 0
    return [_string_array(offsets[j], data[base[j] : base[j + 1]], valid[:, j]) for j in range(ns)]


def _key_table(
    names: Sequence[str],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
    """The spec's keys for ``_field_of``: bytes, offsets, an open-addressing table and its mask."""
    encoded = [name.encode() for name in names]
    keys = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    key_off = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in encoded], out=key_off[1:])
    size = 1 << max(4, (4 * len(names)).bit_length())
    table = np.full(size, -1, dtype=np.int64)
    for f, key in enumerate(encoded):
        h = _FNV_OFFSET
        for byte in key:
            h = ((h ^ byte) * _FNV_PRIME) & 0xFFFF_FFFF_FFFF_FFFF
        slot = h & (size - 1)
        while table[slot] >= 0:
            slot = (slot + 1) & (size - 1)
        table[slot] = f
    return keys, key_off, table, size - 1


def _string_array(
    offsets: npt.NDArray[np.int32], data: npt.NDArray[np.uint8], valid: npt.NDArray[np.bool_]
) -> pa.Array:
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.string(), valid.shape[0], buffers)


def _scan_json(
    joined: bytes,
    starts: npt.NDArray[np.int64],
    skip: npt.NDArray[np.bool_],
    spec: FeatureSpec,
    schema: pa.Schema,
) -> tuple[pa.Table, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The scanner: a table of the records it read, their indices, and those it left."""
    n = starts.shape[0] - 1
    floats = [*spec.labels, *(d.name for d in spec.dense)]
    by_kind: dict[int, list[SparseField]] = {k: [] for k in _KINDS.values()}
    for s in spec.sparse:
        by_kind[_KINDS[s.type]].append(s)
    names = [*floats, *(s.name for k in _KINDS.values() for s in by_kind[k])]
    kind = np.array(
        [_K_FLOAT] * len(floats) + [k for k in _KINDS.values() for _ in by_kind[k]], dtype=np.int64
    )
    # A field's column in the arrays of its kind; both list kinds share the list arrays.
    n_string_lists = len(by_kind[_K_LIST_STRING])
    slot = np.array(
        [
            *range(len(floats)),
            *range(len(by_kind[_K_STRING])),
            *range(len(by_kind[_K_INT])),
            *range(n_string_lists),
            *range(n_string_lists, n_string_lists + len(by_kind[_K_LIST_INT])),
        ],
        dtype=np.int64,
    )
    keys, key_off, table, mask = _key_table(names)
    nf, ns, ni = len(floats), len(by_kind[_K_STRING]), len(by_kind[_K_INT])
    nl = len(by_kind[_K_LIST_STRING]) + len(by_kind[_K_LIST_INT])
    buf = np.frombuffer(joined, dtype=np.uint8)
    status = np.zeros(n, dtype=np.uint8)
    # Values and spans are only read where their state (0: absent or null) says they were set.
    fval = np.empty((n, nf))
    fstate = np.zeros((n, nf), dtype=np.uint8)
    fspan = np.empty((n, nf, 2), dtype=np.int64)
    ival = np.empty((n, ni), dtype=np.int64)
    istate = np.zeros((n, ni), dtype=np.uint8)
    sspan = np.empty((n, ns, 2), dtype=np.int64)
    sstate = np.zeros((n, ns), dtype=np.uint8)
    lfirst = np.empty((n, nl), dtype=np.int64)
    lcount = np.empty((n, nl), dtype=np.int64)
    lstate = np.zeros((n, nl), dtype=np.uint8)
    lints, lstrs, _ = _scan_records(
        buf, starts, skip, kind, slot, keys, key_off, table, mask, status, fval, fstate, fspan,
        ival, istate, sspan, sstate, lfirst, lcount, lstate,
        np.empty(1024, dtype=np.int64), np.empty((1024, 3), dtype=np.int64),
    )  # fmt: skip
    # Numbers beyond the fast path: Arrow's parser, the one pyarrow.json uses, reads them.
    hard_rows, hard_cols = np.nonzero((fstate == 2) & (status == 0)[:, None])
    if hard_rows.shape[0]:
        spans = np.ascontiguousarray(fspan[hard_rows, hard_cols][:, None, :])
        m = len(hard_rows)
        (texts,) = _gather(buf, spans, np.ones((m, 1), np.uint8), np.arange(m))
        try:
            fval[hard_rows, hard_cols] = texts.cast(pa.float64()).to_numpy(zero_copy_only=False)
            fstate[hard_rows, hard_cols] = 1
        except pa.ArrowInvalid:
            status[hard_rows] = 1  # not expected for JSON numbers; json.loads decides
    ok = status == 0
    rows = np.flatnonzero(ok)
    columns: dict[str, pa.Array] = {}
    for j, name in enumerate(floats):
        valid = fstate[rows, j] > 0
        columns[name] = pa.array(fval[rows, j], mask=~valid)
    for j, s in enumerate(by_kind[_K_INT]):
        valid = istate[rows, j] > 0
        columns[s.name] = pa.array(ival[rows, j], mask=~valid)
    if ns:
        for s, arr in zip(by_kind[_K_STRING], _gather(buf, sspan, sstate, rows), strict=True):
            columns[s.name] = arr
    lists = [*by_kind[_K_LIST_STRING], *by_kind[_K_LIST_INT]]
    for j, s in enumerate(lists):
        valid = lstate[rows, j] > 0
        counts = np.where(valid, lcount[rows, j], 0)
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        # Element k of the column is element (k - offsets[row]) of its row, from lfirst[row].
        firsts = np.repeat(lfirst[rows, j] - offsets[:-1], counts) + np.arange(offsets[-1])
        if s.type == "list_int":
            values = pa.array(lints[firsts], type=pa.int64())
        else:
            elems = lstrs[firsts]
            state = (1 + elems[:, 2:3]).astype(np.uint8)
            # Contiguous spans: the kernels are then compiled for one array layout only.
            spans = np.ascontiguousarray(elems[:, None, :2])
            (values,) = _gather(buf, spans, state, np.arange(len(firsts)))
        columns[s.name] = pa.ListArray.from_arrays(
            pa.array(offsets).cast(pa.int32()), values, mask=pa.array(~valid)
        )
    out = pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
    return out, rows.astype(np.int64), np.flatnonzero(status == 1)


def _braced(payload: bytes) -> bool:
    if payload[:1] == b"{" and payload[-1:] == b"}":
        return True
    stripped = payload.strip(b" \t\r\n")
    return stripped[:1] == b"{" and stripped[-1:] == b"}"


def _not_json(value: Any) -> Any:
    msg = f"cannot write {type(value).__name__} value {show(value)} as JSON"
    raise TypeError(msg)


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


# --- Criteo TSV ---------------------------------------------------------------------------

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

    >>> from pipeline.spec import FeatureSpec
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

        >>> from pipeline.spec import FeatureSpec
        >>> CriteoTsvCodec().column_names(FeatureSpec(labels=["y", "z"], dense=[{"name": "a"}]))
        ('y', 'a')
        """
        if self.columns is not None:
            return tuple(self.columns)
        return (spec.labels[0], *(d.name for d in spec.dense), *(s.name for s in spec.sparse))

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good records of ``raw`` and the bad ones (see the class docstring)."""
        names = self.column_names(spec)
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
        payloads = _payloads_of(raw, "criteo_tsv")
        n = len(payloads)
        if n == 0:
            return _none_good(raw, spec, {})
        _, early = _screen(payloads, spec)
        # A placeholder line of empty columns reads as a row of nulls, keeping rows aligned.
        placeholder = b"\t" * (len(names) - 1)
        replaced = dict.fromkeys(early, placeholder)
        joined, starts, lens = _join(payloads, replaced)
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
            joined, starts, lens = _join(payloads, {**work, **replaced})
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
            joined, starts, lens = _join(payloads, {**work, **replaced})
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
        checked = check(pa.table(typed) if typed else pa.table({}), spec, marker)
        _relabel(
            checked,
            "null_label",
            "missing_label",
            lambda p: f"label {p.field!r} is empty (missing)",
        )
        return _finish(raw, checked, index, early)

    def encode(self, table: pa.Table) -> list[bytes]:
        """One tab-separated line per row (in ``columns`` order, else the table's).

        >>> CriteoTsvCodec().encode(pa.table({"y": [0.0], "i": [2.5], "c": [None], "n": [7]}))
        [b'0\\t2.5\\t\\t7']
        """
        table = _drop_position(table)
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


# --- Arrow IPC ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrowIpcCodec:
    """Each payload an Arrow IPC stream of one or more rows, of any schema.

    A payload that is not a readable, valid stream is ``bad_ipc``; its rows'
    columns are cast to the spec's types like any Arrow table (see
    :mod:`connectors.validate`: an int64 column for a string field makes each
    non-null row ``sparse_wrong_type``). Every row of a payload has the payload's
    position; a bad row is dead-lettered as a one-row IPC stream of its own
    (the payload's other rows may be good). A stream with no rows holds no
    records. ``max_record_bytes`` applies to the whole payload, before reading
    it. ``encode`` packs ``rows_per_payload`` rows in each payload.

    >>> from pipeline.spec import FeatureSpec
    >>> spec = FeatureSpec(labels=["y"], sparse=[{"name": "u", "table": "t", "type": "int"}])
    >>> codec = ArrowIpcCodec(rows_per_payload=2)
    >>> payloads = codec.encode(pa.table({"y": [1.0, 7.0, 0.0], "u": [5, 6, 7]}))
    >>> len(payloads)
    2
    >>> from connectors.types import Chunk, RawChunk
    >>> raw = RawChunk(Chunk("s", "p", 10, 13), np.array([10, 11, 12]), [*payloads, b"junk"])
    >>> good, bad = codec.decode(raw, spec)
    >>> good.to_pylist()
    [{'y': 1.0, 'u': 5, '__position': 10}, {'y': 0.0, 'u': 7, '__position': 11}]
    >>> [(b.position, b.reason) for b in bad]
    [(10, 'label_out_of_range'), (12, 'bad_ipc')]
    """

    rows_per_payload: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.rows_per_payload, int) or self.rows_per_payload < 1:
            msg = f"rows_per_payload must be a positive int, got {self.rows_per_payload!r}"
            raise ValueError(msg)

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good rows of ``raw``'s streams and the bad ones (see the class docstring)."""
        payloads = _payloads_of(raw, "arrow")
        n = len(payloads)
        _, early = _screen(payloads, spec)
        # Tables of one schema are checked together: one check per schema, not per payload.
        groups: dict[pa.Schema, list[tuple[int, pa.Table]]] = {}
        for i in range(n):
            if i in early:
                continue
            try:
                table = _read_ipc(payloads[i])
            except (pa.ArrowException, OSError, ValueError) as e:
                early[i] = Problem(
                    i,
                    "bad_ipc",
                    None,
                    f"the payload is not a valid Arrow IPC stream: {show(str(e), 160)}",
                )
                continue
            if table.num_rows:
                groups.setdefault(table.schema, []).append((i, table))
        if not groups:
            return _none_good(raw, spec, early)
        parts: list[tuple[Checked, npt.NDArray[np.int64], npt.NDArray[np.int64], pa.Table]] = []
        for members in groups.values():
            originals = pa.concat_tables([t for _, t in members])
            record = np.concatenate([np.full(t.num_rows, i, dtype=np.int64) for i, t in members])
            within = np.concatenate([np.arange(t.num_rows, dtype=np.int64) for _, t in members])
            parts.append((check(originals, spec), record, within, originals))
        # Merge the groups back into record order, rows of a payload in their order.
        record = np.concatenate([p[1] for p in parts])
        within = np.concatenate([p[2] for p in parts])
        order = np.lexsort((within, record))
        table = pa.concat_tables([p[0].table for p in parts]).take(pa.array(order))
        good = np.concatenate([p[0].good for p in parts])[order]
        # Row k of the groups, concatenated, is row k - starts[g] of group g.
        starts = np.cumsum([0, *(p[1].shape[0] for p in parts)])
        problems = [
            p._replace(row=p.row + int(starts[g]))
            for g, part in enumerate(parts)
            for p in part[0].problems
        ]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        moved = [p._replace(row=int(rank[p.row])) for p in problems]

        def raw_of_row(row: int) -> bytes:
            k = int(order[row])
            g = int(np.searchsorted(starts, k, side="right")) - 1
            return _write_ipc(parts[g][3].take([k - int(starts[g])]))

        checked = Checked(table, good, sorted(moved))
        return _finish(raw, checked, record[order], early, raw_of_row)

    def encode(self, table: pa.Table) -> list[bytes]:
        """IPC streams of ``rows_per_payload`` rows each.

        >>> p = ArrowIpcCodec().encode(pa.table({"y": [1.0, 0.0]}))
        >>> len(p), pa.ipc.open_stream(p[1]).read_all().to_pylist()
        (2, [{'y': 0.0}])
        """
        table = _drop_position(table)
        k, n = self.rows_per_payload, table.num_rows
        # `take` copies the rows: a slice would carry its arrays' whole buffers into the stream.
        return [_write_ipc(table.take(np.arange(i, min(i + k, n)))) for i in range(0, n, k)]


def _read_ipc(payload: bytes) -> pa.Table:
    with pa_ipc.open_stream(pa.py_buffer(payload)) as reader:
        table = reader.read_all()
    # Full validation catches corrupt offsets and broken UTF-8 before any kernel reads them.
    table.validate(full=True)
    return table.replace_schema_metadata(None)


def _write_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa_ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
