"""Decode throughput of the codecs on Criteo-like records, one core; the JSON scanner
against well-kept JSON libraries.

    python benchmarks/decode_micro.py [--records 100000] [--repeats 5] [--json out.json]

Records have 1 label, 13 dense fields (ints, 10% missing, written as ``null``)
and 26 string fields (8 hex digits), as Criteo's. Figures are events per
second, the best of ``--repeats`` runs, each decoding all ``--records`` as one
chunk. Each JSON figure also has a ``_1pct_bad`` variant, where one record in
100 is bad (alternately a string label and a truncated, unparsable payload).

Every JSON decoder below is the whole of ``JsonLinesCodec.decode`` (screening,
the UTF-8 check, ``json.loads`` naming the bad records, ``check``, positions):
only the bulk reader of the good records differs, so that each figure is what
the codec would do with that reader. Before timing, each decoder's good table
and bad records are asserted equal to the scanner's, on the timed records and
on a sample of awkward ones (wrong types, bools, nulls, missing and unknown
keys, NaN, 1e999, big ints, escapes, lone surrogates, not UTF-8, not JSON, not
an object), so that a reader that skips a check cannot win.

- ``json_scanner_events_per_s``: ``JsonLinesCodec.decode``, its numba scanner;
- ``pyarrow_json_events_per_s``: ``JsonLinesCodec(engine="arrow")``:
  ``pyarrow.json.read_json`` with an explicit schema over segments of the
  joined chunk; a failing segment is read again around the row Arrow names;
- ``pyarrow_json_lean_events_per_s``: one ``read_json`` over the whole chunk;
  if it fails, every record of the chunk goes to the per-record path;
- ``orjson_events_per_s``: ``orjson.loads`` per record, the spec fields taken
  with one ``itemgetter``, columns built by ``pyarrow.array`` per column (a
  column that fails to convert is checked value by value; ``true``/``false``
  in a record sends it to the value-by-value check, as Arrow takes bools as
  numbers);
- ``simdjson_events_per_s``: the same with one reused pysimdjson
  ``Parser().parse`` and its lazy objects (``recursive=True``, a whole dict
  per record, is slower);
- ``<lib>_vs_scanner`` (and ``_1pct_bad``): the ratio to the scanner's figure;
- ``python_baseline_events_per_s``: a per-record ``json.loads`` loop that
  builds columns and checks the labels, as a pandas-style decoder does (not
  checked against the scanner: it does less);
- ``criteo_tsv_decode_events_per_s``, ``arrow_decode_events_per_s``: the other
  codecs (Arrow payloads of 1,000 rows).

``orjson`` and ``pysimdjson`` are optional (``pip install -e ".[bench]"``); a
library that is not installed is skipped, and the output says so. Neither
reports a spec key given twice: the libraries keep one of the values, where
the codec names the record ``duplicate_field`` (not in the sample).

Arrow and numpy may start threads; the pyarrow readers are told not to use them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import operator
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.json as pa_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import CRITEO_DENSE, CRITEO_SPARSE, criteo_spec, print_figures, write_json

import connectors.codecs.json_lines as json_lines_module
from connectors.codecs import ArrowIpcCodec, Codec, CriteoTsvCodec, JsonLinesCodec
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, RawChunk

Reader = Callable[
    [bytes, npt.NDArray[np.int64], npt.NDArray[np.bool_], FeatureSpec, pa.Schema],
    tuple[pa.Table, npt.NDArray[np.int64], npt.NDArray[np.int64]],
]


def criteo_table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, Any] = {"label": rng.integers(0, 2, n).astype(np.float64)}
    for d in CRITEO_DENSE:
        values = rng.integers(0, 1000, n).astype(np.float64)
        cols[d] = pa.array(values, mask=rng.random(n) < 0.1)
    for s in CRITEO_SPARSE:
        cols[s] = [f"{v:08x}" for v in rng.integers(0, 2**32, n).tolist()]
    return pa.table(cols)


def with_bad(payloads: list[bytes], every: int = 100) -> list[bytes]:
    """One payload in ``every`` made bad: alternately a string label, and a truncated record."""
    out = list(payloads)
    for k, i in enumerate(range(0, len(out), every)):
        if k % 2 == 0:
            out[i] = b'{"label":"1"' + out[i][len(b'{"label":1.0') :]
        else:
            out[i] = out[i][: len(out[i]) // 2]
    return out


def awkward_records() -> list[bytes]:
    """Records that each exercise one check (the scanner's verdict is the reference)."""
    base = {"label": 1, **dict.fromkeys(CRITEO_DENSE, 3), **dict.fromkeys(CRITEO_SPARSE, "ab")}

    def rec(**changes: Any) -> bytes:
        return json.dumps({**base, **changes}, separators=(",", ":")).encode()

    def literal(key: str, text: bytes) -> bytes:
        rest = json.dumps({k: v for k, v in base.items() if k != key}).encode()
        return rest[:-1] + b',"' + key.encode() + b'":' + text + b"}"

    return [
        rec(),
        rec(label="1"),
        rec(label=True),
        rec(label=None),
        rec(I1=False),
        rec(I2="7"),
        rec(I3=[1]),
        rec(I4={"x": 1}),
        rec(I5=2**60 + 1),
        rec(I6=2**64 + 1),
        rec(I7=1.0000000000000002),
        rec(I8=-0.0),
        rec(C1=1),
        rec(C2=True),
        rec(C3=["a"]),
        rec(C4="é\n\u2028"),
        rec(C5='q"\\/'),
        rec(C6="true"),
        rec(extra={"deep": [1, [2, {"x": None}]]}, more="s"),
        rec(label=2),
        rec(I9=-5),
        json.dumps({k: v for k, v in base.items() if k not in ("I1", "C1")}).encode(),
        json.dumps({k: v for k, v in base.items() if k != "label"}).encode(),
        literal("I1", b"NaN"),
        literal("I2", b"1e999"),
        literal("I3", b"-Infinity"),
        literal("C7", b'"\\ud800"'),
        literal("C8", b'"\\u00e9\\t\\""'),
        b"  " + rec() + b"\n",
        rec()[:20] + b"\xff\xfe" + rec()[22:],
        rec()[:-1],
        b"[1, 2]",
        b"null",
        b"",
        b"{}",
        b'{"label": 0}',
        rec(),
    ]


def best_rate(fn: Callable[[], object], n: int, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def python_baseline(payloads: list[bytes]) -> dict[str, list[Any]]:
    """Per-record json.loads into columns with a label check: what a pandas-style reader does."""
    names = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
    cols: dict[str, list[Any]] = {k: [] for k in names}
    for p in payloads:
        rec = json.loads(p)
        label = rec.get("label")
        if not isinstance(label, (int, float)) or not 0 <= label <= 1:
            continue
        for k in names:
            cols[k].append(rec.get(k))
    return cols


# --- library readers: drop-in replacements for the codec's scanner step ----------------------
#
# A reader gets what connectors.codecs.json_scan.scan_json gets (the joined payloads, their
# starts, the records to skip) and returns what it returns: a table of the records it read (the
# spec schema), their indices, and the records it leaves to json.loads (which names the problem).


class _Bad:
    """Marks a value of the wrong type for its column."""


_BAD = _Bad()


def _as_float(value: Any) -> Any:
    if value is None or type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    return _BAD


def _as_str(value: Any) -> Any:
    return value if value is None or type(value) is str else _BAD


def _columns(
    rows: list[tuple[Any, ...]], schema: pa.Schema, careful: set[int]
) -> tuple[list[pa.Array], npt.NDArray[np.bool_]]:
    """Arrays of ``rows`` (one per schema field) and which rows hold a value of a wrong type.

    A column is converted by Arrow at once; one that fails, and the rows in ``careful``
    (those holding a bool, which Arrow would take as a number), are checked value by value.
    """
    m = len(rows)
    bad = np.zeros(m, dtype=np.bool_)
    arrays: list[pa.Array] = []
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in schema]
    for field, col in zip(schema, cols, strict=True):
        is_float = pa.types.is_floating(field.type)
        if is_float and careful:
            for j in careful:
                if type(col[j]) is bool:
                    bad[j] = True
        try:
            arrays.append(pa.array(col, type=field.type))
            continue
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            pass
        values = list(map(_as_float if is_float else _as_str, col))
        for j, v in enumerate(values):
            if v is _BAD:
                bad[j] = True
                values[j] = None
        arrays.append(pa.array(values, type=field.type))
    return arrays, bad


def _occurrences(data: bytes, word: bytes) -> list[int]:
    found: list[int] = []
    k = data.find(word)
    while k >= 0:
        found.append(k)
        k = data.find(word, k + 1)
    return found


RowOf = Callable[[memoryview], "tuple[Any, ...] | None"]


def _orjson_rows(names: list[str]) -> RowOf:
    """A record's spec values (None: not an object); a ValueError when it is not JSON."""
    import orjson

    loads = orjson.loads
    get = operator.itemgetter(*names) if len(names) > 1 else lambda o: (o[names[0]],)

    def row_of(payload: memoryview) -> tuple[Any, ...] | None:
        obj = loads(payload)
        if type(obj) is not dict:
            return None
        try:
            row: tuple[Any, ...] = get(obj)
        except KeyError:
            row = tuple(map(obj.get, names))
        return row

    return row_of


def _simdjson_rows(names: list[str]) -> RowOf:
    """As ``_orjson_rows``, with one reused pysimdjson parser and its lazy objects.

    A spec value that is a lazy array or object is replaced by ``_BAD`` (no spec
    field takes one here): the parser cannot be reused while one is alive.
    """
    import simdjson

    parser = simdjson.Parser()
    lazy = {simdjson.Object, simdjson.Array}
    get = operator.itemgetter(*names) if len(names) > 1 else lambda o: (o[names[0]],)

    def row_of(payload: memoryview) -> tuple[Any, ...] | None:
        obj = parser.parse(payload)
        if type(obj) is not simdjson.Object:
            return None
        try:
            row: tuple[Any, ...] = get(obj)
        except KeyError:
            row = tuple(map(obj.get, names))
        if not lazy.isdisjoint(map(type, row)):
            row = tuple(_BAD if type(v) in lazy else v for v in row)
        return row

    return row_of


def _per_record_reader(rows_of: Callable[[list[str]], RowOf]) -> Reader:
    def read(
        joined: bytes,
        starts: npt.NDArray[np.int64],
        skip: npt.NDArray[np.bool_],
        spec: FeatureSpec,
        schema: pa.Schema,
    ) -> tuple[pa.Table, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if any(not pa.types.is_floating(f.type) and not pa.types.is_string(f.type) for f in schema):
            msg = "the benchmark's library readers handle float and string fields only"
            raise NotImplementedError(msg)
        row_of = rows_of(schema.names)
        view = memoryview(joined)
        bounds = starts.tolist()
        rows: list[tuple[Any, ...]] = []
        index: list[int] = []
        left: list[int] = []
        for i in np.flatnonzero(~skip).tolist():
            try:
                row = row_of(view[bounds[i] : bounds[i + 1] - 1])
            except ValueError:  # orjson.JSONDecodeError and simdjson's errors are ValueErrors
                row = None
            if row is None:
                left.append(i)
            else:
                rows.append(row)
                index.append(i)
        # Records holding a bool literal: their numbers are checked one by one.
        pos = np.array(index, dtype=np.int64)
        literal = [k for word in (b"true", b"false") for k in _occurrences(joined, word)]
        careful: set[int] = set()
        if literal:
            rec = np.searchsorted(starts, np.array(literal), side="right") - 1
            careful = set(np.flatnonzero(np.isin(pos, rec)).tolist())
        arrays, bad = _columns(rows, schema, careful)
        table = pa.Table.from_arrays(arrays, schema=schema)
        if bad.any():
            table = table.filter(pa.array(~bad))
            left += pos[bad].tolist()
        return table, pos[~bad], np.array(sorted(left), dtype=np.int64)

    return read


_OPEN, _CLOSE = ord("{"), ord("}")


def _arrow_lean_reader(
    joined: bytes,
    starts: npt.NDArray[np.int64],
    skip: npt.NDArray[np.bool_],
    spec: FeatureSpec,
    schema: pa.Schema,
) -> tuple[pa.Table, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One ``read_json`` over the chunk; when it fails, every record goes to json.loads."""
    n = starts.shape[0] - 1
    todo = np.flatnonzero(~skip)
    bounds = starts.tolist()
    braced = all(
        joined[bounds[i]] == _OPEN and joined[bounds[i + 1] - 2] == _CLOSE for i in todo.tolist()
    )
    if braced:
        try:
            table = pa_json.read_json(
                pa.BufferReader(pa.py_buffer(joined)),
                read_options=pa_json.ReadOptions(use_threads=False, block_size=len(joined) + 64),
                parse_options=pa_json.ParseOptions(
                    explicit_schema=schema, unexpected_field_behavior="ignore"
                ),
            )
        except pa.ArrowInvalid:
            table = None
        if table is not None and table.num_rows == n:
            return table.take(pa.array(todo)), todo, np.zeros(0, dtype=np.int64)
    return schema.empty_table(), np.zeros(0, dtype=np.int64), todo


@contextlib.contextmanager
def scanner_replaced(reader: Reader) -> Iterator[None]:
    """``JsonLinesCodec.decode`` with ``reader`` in place of the scanner, for the block."""
    # Replaced where JsonLinesCodec.decode looks it up: in its own module.
    original = json_lines_module.scan_json
    json_lines_module.scan_json = reader
    try:
        yield
    finally:
        json_lines_module.scan_json = original


def library_readers() -> tuple[dict[str, Reader], list[str]]:
    """The readers whose library is installed, and a note for each one that is not."""
    readers: dict[str, Reader] = {"pyarrow_json_lean": _arrow_lean_reader}
    skipped: list[str] = []
    if importlib.util.find_spec("orjson") is not None:
        readers["orjson"] = _per_record_reader(_orjson_rows)
    else:
        skipped.append("orjson: not installed (pip install orjson), skipped")
    if importlib.util.find_spec("simdjson") is not None:
        readers["simdjson"] = _per_record_reader(_simdjson_rows)
    else:
        skipped.append("simdjson: not installed (pip install pysimdjson), skipped")
    return readers, skipped


# --- agreement and timing -------------------------------------------------------------------


def _same(
    a: tuple[pa.Table, list[BadRecord]], b: tuple[pa.Table, list[BadRecord]], what: str
) -> None:
    if not a[0].equals(b[0]):
        msg = f"{what}: the good table differs from the scanner's"
        raise AssertionError(msg)
    if a[1] != b[1]:
        diff = next(((x, y) for x, y in zip(a[1], b[1], strict=False) if x != y), None)
        msg = (
            f"{what}: the bad records differ from the scanner's ({len(a[1])}, {len(b[1])}): {diff}"
        )
        raise AssertionError(msg)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args()


class Bench:
    """The records of one run, as one chunk, and the decoders compared on them."""

    def __init__(self, n: int, repeats: int) -> None:
        self.n, self.repeats = n, repeats
        self.spec = criteo_spec()
        self.table = criteo_table(n)
        self.chunk = Chunk("bench", "events/0", 0, n)
        self.json_payloads = JsonLinesCodec().encode(self.table)
        self.bad = with_bad(self.json_payloads)
        self.sets = {"": self.raw_of(self.json_payloads), "_1pct_bad": self.raw_of(self.bad)}
        readers, self.skipped = library_readers()
        # name: (codec, the reader in place of the scanner, or None for the codec as it is)
        self.decoders: dict[str, tuple[JsonLinesCodec, Reader | None]] = {
            "json_scanner": (JsonLinesCodec(), None),
            "pyarrow_json": (JsonLinesCodec(engine="arrow"), None),
            **{name: (JsonLinesCodec(), reader) for name, reader in readers.items()},
        }

    def raw_of(self, payloads: Sequence[bytes]) -> RawChunk:
        return RawChunk(self.chunk, np.arange(len(payloads), dtype=np.int64), list(payloads))

    def rate(self, codec: Codec, payloads: list[bytes]) -> float:
        """A codec's best rate over the run's records (``payloads``: them, encoded)."""
        raw = self.raw_of(payloads)
        good, _ = codec.decode(raw, self.spec)  # warm up, and check
        assert good.num_rows > 0
        return best_rate(lambda: codec.decode(raw, self.spec), self.n, self.repeats)

    def decoding(self, name: str, raw: RawChunk) -> Callable[[], tuple[pa.Table, list[BadRecord]]]:
        codec, reader = self.decoders[name]
        spec = self.spec
        if reader is None:
            return lambda: codec.decode(raw, spec)

        def run() -> tuple[pa.Table, list[BadRecord]]:
            with scanner_replaced(reader):
                result: tuple[pa.Table, list[BadRecord]] = codec.decode(raw, spec)
            return result

        return run


def check_agreement(b: Bench) -> None:
    """The scanner's verdicts are the reference every other decoder must give."""
    samples = [b.raw_of(b.json_payloads), b.raw_of(b.bad), b.raw_of(awkward_records())]
    expected = [b.decoding("json_scanner", raw)() for raw in samples]
    for name in b.decoders:
        for what, raw, want in zip(
            ["clean", "1pct_bad", "awkward"], samples, expected, strict=True
        ):
            got = b.decoding(name, raw)()
            _same(want, got, f"{name} on the {what} records")


def json_rates(b: Bench, figures: dict[str, Any]) -> None:
    """Round-robin: every decoder once per round, so that a burst of load elsewhere on the
    machine slows them alike; each figure is the best of its rounds."""
    runs = {
        f"{name}{suffix}": b.decoding(name, raw)
        for name in b.decoders
        for suffix, raw in b.sets.items()
    }
    best = dict.fromkeys(runs, math.inf)
    for _ in range(b.repeats):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    for key, seconds in best.items():
        figures[f"{key}_events_per_s"] = b.n / seconds
    for name in list(b.decoders)[1:]:
        for suffix in b.sets:
            figures[f"{name}_vs_scanner{suffix}"] = (
                figures[f"{name}{suffix}_events_per_s"]
                / figures[f"json_scanner{suffix}_events_per_s"]
            )


def other_rates(b: Bench, figures: dict[str, Any]) -> None:
    """The per-record Python baseline and the other codecs."""
    figures["python_baseline_events_per_s"] = best_rate(
        lambda: python_baseline(b.json_payloads), b.n, max(1, b.repeats // 2)
    )
    figures["json_vs_baseline"] = (
        figures["json_scanner_events_per_s"] / figures["python_baseline_events_per_s"]
    )
    figures["criteo_tsv_decode_events_per_s"] = b.rate(
        CriteoTsvCodec(), CriteoTsvCodec().encode(b.table)
    )
    figures["arrow_decode_events_per_s"] = b.rate(
        ArrowIpcCodec(), ArrowIpcCodec(rows_per_payload=1000).encode(b.table)
    )


def main() -> None:
    args = parse_args()
    b = Bench(args.records, args.repeats)
    figures: dict[str, Any] = {
        "records": b.n,
        "json_bytes_per_record": sum(map(len, b.json_payloads)) / b.n,
    }
    check_agreement(b)
    json_rates(b, figures)
    other_rates(b, figures)
    figures["skipped"] = b.skipped
    for note in b.skipped:
        print(f"skipped {note}")
    print_figures(
        {k: v for k, v in figures.items() if k != "skipped"},
        lambda v: f"{v:>14,.2f}" if isinstance(v, float) and v < 100 else f"{v:>14,.1f}",
        width=40,
        sep=" ",
    )
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
