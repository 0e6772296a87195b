"""Codecs: bad records of every kind mixed into good ones, a contract suite, and an oracle.

The acceptance tests send each kind of bad record (with a good one before it)
and check the exact count per reason, and that every good record arrives, in
order, with its values and position. The contract suite runs the same checks
on every codec; the property test compares the JSON codec, both engines, with
a reference written from the documented rules.
"""

from __future__ import annotations

import json
import math
import pickle
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.codecs import (
    ArrowIpcCodec,
    Codec,
    CriteoTsvCodec,
    JsonLinesCodec,
    make_codec,
)
from connectors.deadletter import CountingDeadLetterSink, JsonlDeadLetterSink, read_dead_letters
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, RawChunk
from connectors.validate import POSITION, REASONS, count_reasons, spec_schema
from tests.support.bad_records import I64_MAX, JSON_BAD, SPEC, base, j, value_reason

# Criteo TSV has no list fields.
TSV_SPEC = FeatureSpec.model_validate(
    {
        "labels": ["label"],
        "dense": [{"name": "I1", "min_value": 0, "max_value": 100}, {"name": "I2", "fill": None}],
        "sparse": [{"name": "C1", "table": "c1"}, {"name": "C2", "table": "c2", "type": "int"}],
        "max_record_bytes": 128,
    }
)
FIELDS = ["click", "price", "age", "user", "item", "tags", "cats"]
JSON_ENGINES = [JsonLinesCodec(), JsonLinesCodec(engine="arrow", segment_bytes=1 << 12)]


def chunk_of(payloads: list[bytes], first: int = 1000, step: int = 3) -> RawChunk:
    """A chunk with gaps between positions, as compacted Kafka partitions have."""
    positions = np.arange(first, first + step * len(payloads), step, dtype=np.int64)
    end = int(positions[-1]) + 1 if len(payloads) else first
    return RawChunk(Chunk("kafka", "events/3", first, end), positions, payloads)


def good_record(i: int) -> dict[str, Any]:
    """A good record whose fields vary with ``i`` (some absent or null)."""
    rec: dict[str, Any] = {"click": i % 2, "age": float(i % 90)}
    if i % 3:
        rec["price"] = round(i * 1.25, 2) % 1000
    if i % 4:
        rec["user"] = f"u{i}"
    if i % 5 == 1:
        rec["user"] = None
    if i % 2:
        rec["item"] = i * 7919 - 10**6
    if i % 3 != 2:
        rec["tags"] = [f"t{j}" for j in range(i % 4)]
    if i % 5:
        rec["cats"] = list(range(i % 3))
    return rec


def expected_row(rec: dict[str, Any]) -> dict[str, Any]:
    """The decoded row of a good record: floats for labels and dense, None for absent."""
    row = {f: rec.get(f) for f in FIELDS}
    for f in ("click", "price", "age"):
        value = row[f]
        if value is not None:
            row[f] = float(value)
    return row


def rows_of(table: pa.Table) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != POSITION} for r in table.to_pylist()]


def assert_decoded(
    codec: Codec,
    spec: FeatureSpec,
    cases: list[tuple[bytes, str | None]],
    expected_good: list[dict[str, Any]],
) -> list[BadRecord]:
    """Decode; check the counts per reason, and the good rows, in order, with their positions."""
    raw = chunk_of([p for p, _ in cases])
    good, bad = codec.decode(raw, spec)
    want = Counter(r for _, r in cases if r is not None)
    assert count_reasons(bad) == dict(sorted(want.items())), [
        (b.position, b.reason, b.detail) for b in bad
    ]
    # Each bad record is the case sent at its position, with its raw bytes.
    bad_at = {int(raw.positions[k]): (p, r) for k, (p, r) in enumerate(cases) if r is not None}
    for b in bad:
        payload, reason = bad_at[b.position]
        assert (b.reason, b.raw) == (reason, payload), b
        assert (b.source, b.partition) == ("kafka", "events/3")
        assert b.detail
    good_positions = [int(raw.positions[k]) for k, (_, r) in enumerate(cases) if r is None]
    assert good.column(POSITION).to_pylist() == good_positions
    assert good.schema == spec_schema(spec, position=True)
    assert rows_of(good) == expected_good
    return bad


def first_of_each_reason(bad: list[BadRecord]) -> dict[str, BadRecord]:
    """The first bad record of each reason."""
    by_reason: dict[str, BadRecord] = {}
    for b in bad:
        by_reason.setdefault(b.reason, b)
    return by_reason


# --- JSON lines -----------------------------------------------------------------------------


# Good records written in unusual ways, with the row each must give.
JSON_ODD_GOOD: list[tuple[bytes, dict[str, Any]]] = [
    (
        json.dumps(base(tags=["x"]), indent=2).encode(),  # pretty-printed: holds newlines
        expected_row(base(tags=["x"])),
    ),
    (b'  \t{"click":0,"age":1}\r\n', expected_row({"click": 0, "age": 1})),
    (
        b'{"click":1,"age":2,"user":"caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\\\ \\/ \\n\\t"}',
        expected_row({"click": 1, "age": 2, "user": 'café 😀 "q" \\ / \n\t'}),
    ),
    (
        '{"click":1,"age":2,"user":"€ naïve 😀"}'.encode(),
        expected_row({"click": 1, "age": 2, "user": "€ naïve 😀"}),
    ),
    (b'{"cl\\u0069ck":1,"age":3}', expected_row({"click": 1, "age": 3})),  # an escaped key
    (
        b'{"meta":{"a":[1,{"b":null}],"s":"x\\"}"},"z":true,"n":-1.5e-3,"click":0,"age":4,"e":[]}',
        expected_row({"click": 0, "age": 4}),  # unknown keys, nested, are ignored
    ),
    (
        b'{"click":1,"age":5,"price":null,"user":null,"item":null,"tags":null,"cats":null}',
        expected_row({"click": 1, "age": 5}),
    ),
    (
        b'{"click":1,"age":0.30000000000000004,"price":123.45678901234567}',
        expected_row({"click": 1, "age": 0.30000000000000004, "price": 123.45678901234567}),
    ),
    (
        b'{"click":0.25,"age":1e-320,"price":1E+2,"item":9223372036854775807}',
        expected_row({"click": 0.25, "age": 1e-320, "price": 100.0, "item": I64_MAX}),
    ),
    (
        b'{"click":1,"age":12345678901234567890123,"item":-9223372036854775808}',
        expected_row({"click": 1, "age": 1.2345678901234568e22, "item": -(2**63)}),
    ),
    (
        b'{"click":1,"age":-0.0,"price":0e10,"tags":[],"cats":[]}',
        expected_row({"click": 1, "age": -0.0, "price": 0.0, "tags": [], "cats": []}),
    ),
    (
        b'{ "click" : 1 , "age" : 6 , "tags" : [ "a" , "b\\u0021" ] , "cats" : [ -1 , 0 ] }',
        expected_row({"click": 1, "age": 6, "tags": ["a", "b!"], "cats": [-1, 0]}),
    ),
]


def json_cases() -> tuple[list[tuple[bytes, str | None]], list[dict[str, Any]]]:
    """Each bad record after a good one, then the odd good ones."""
    cases: list[tuple[bytes, str | None]] = []
    expected = []
    for k, (payload, reason) in enumerate(JSON_BAD):
        rec = good_record(k)
        cases += [(j(rec), None), (payload, reason)]
        expected.append(expected_row(rec))
    for payload, row in JSON_ODD_GOOD:
        cases.append((payload, None))
        expected.append(row)
    return cases, expected


@pytest.mark.parametrize("codec", JSON_ENGINES, ids=["numba", "arrow"])
def test_json_acceptance(codec: JsonLinesCodec) -> None:
    cases, expected = json_cases()
    # 56 kinds of bad record, for the 19 reasons a JSON payload can have.
    assert len(JSON_BAD) == 56
    assert len({r for _, r in JSON_BAD}) == 19
    bad = assert_decoded(codec, SPEC, cases, expected)
    # Details name the field and the value.
    by_reason = first_of_each_reason(bad)
    assert by_reason["label_out_of_range"].detail == "label 'click' is 1.5, outside [0, 1]"
    assert by_reason["dense_wrong_type"].field == "price"
    assert "'3'" in by_reason["dense_wrong_type"].detail
    assert "-0.5" in by_reason["dense_below_min"].detail
    assert "9223372036854775808" in by_reason["int_overflow"].detail
    assert by_reason["not_json"].field is None


def test_json_engines_agree_on_everything() -> None:
    cases, _ = json_cases()
    raw = chunk_of([p for p, _ in cases] * 3)
    (good_a, bad_a), (good_b, bad_b) = (c.decode(raw, SPEC) for c in JSON_ENGINES)
    assert good_a.equals(good_b)
    assert bad_a == bad_b


def test_json_missing_and_null_label_are_told_apart() -> None:
    payloads = [j(base(click=...)), j(base(click=None)), j({"age": 1, "click": None, "x": 1})]
    _, bad = JsonLinesCodec().decode(chunk_of(payloads), SPEC)
    assert [b.reason for b in bad] == ["missing_label", "null_label", "null_label"]
    assert bad[0].detail == "label 'click' is absent"


# --- Criteo TSV -----------------------------------------------------------------------------

TSV_BAD: list[tuple[bytes, str]] = [
    (b"", "empty_payload"),
    (b"\n", "empty_payload"),
    (b"1\t5\t7\t" + b"a" * 130 + b"\t1", "oversize"),
    (b"1\t5\t7\tab\n0\t1\t2\tcd\t3", "bad_line"),
    (b"1\t5\t7\tab\r1", "bad_line"),
    (b"1\t5", "wrong_column_count"),
    (b"1\t5\t7\tab\t1\textra", "wrong_column_count"),
    (b"1\t5\t7\t\xff\t1", "not_utf8"),
    (b"\t5\t7\tab\t1", "missing_label"),
    (b"x\t5\t7\tab\t1", "label_wrong_type"),
    (b"1.5\t5\t7\tab\t1", "label_out_of_range"),
    (b"nan\t5\t7\tab\t1", "label_not_finite"),
    (b"1\tabc\t7\tab\t1", "dense_wrong_type"),
    (b"1\t 5\t7\tab\t1", "dense_wrong_type"),  # no spaces around numbers
    (b"1\t\xff\t7\tab\t1", "dense_wrong_type"),
    (b"1\t5\tinf\tab\t1", "dense_not_finite"),
    (b"1\t5\t1e999\tab\t1", "dense_not_finite"),
    (b"1\t-1\t7\tab\t1", "dense_below_min"),
    (b"1\t101\t7\tab\t1", "dense_above_max"),
    (b"1\t5\t\tab\t1", "missing_dense"),
    (b"1\t5\t7\tab\t1.5", "sparse_wrong_type"),
    (b"1\t5\t7\tab\tx1", "sparse_wrong_type"),
    (b"1\t5\t7\tab\t99999999999999999999", "int_overflow"),
    (b"1\t5\t7\tab\t-9223372036854775809", "int_overflow"),
]
TSV_GOOD: list[tuple[bytes, dict[str, Any]]] = [
    (b"1\t5\t7\t68fd1e64\t12", {"label": 1.0, "I1": 5.0, "I2": 7.0, "C1": "68fd1e64", "C2": 12}),
    (b"0\t\t3\t\t", {"label": 0.0, "I1": None, "I2": 3.0, "C1": None, "C2": None}),
    (b'0.5\t2.5e1\t-3\t"q"\t-7\n', {"label": 0.5, "I1": 25.0, "I2": -3.0, "C1": '"q"', "C2": -7}),
    (b"1\t0\t1\tcaf\xc3\xa9\t0\r\n", {"label": 1.0, "I1": 0.0, "I2": 1.0, "C1": "café", "C2": 0}),
    (
        b"0\t100\t1\tx\t9223372036854775807",
        {"label": 0.0, "I1": 100.0, "I2": 1.0, "C1": "x", "C2": I64_MAX},
    ),
]


def test_criteo_tsv_acceptance() -> None:
    cases: list[tuple[bytes, str | None]] = []
    expected = []
    for k, (payload, reason) in enumerate(TSV_BAD):
        payload_good, row = TSV_GOOD[k % len(TSV_GOOD)]
        cases += [(payload_good, None), (payload, reason)]
        expected.append(row)
    bad = assert_decoded(CriteoTsvCodec(), TSV_SPEC, cases, expected)
    by_reason = first_of_each_reason(bad)
    assert by_reason["dense_wrong_type"].detail == "dense field 'I1' is 'abc', not a number"
    assert by_reason["wrong_column_count"].detail == "the line has 2 columns, not 5"
    assert by_reason["missing_label"].detail == "label 'label' is empty (missing)"


def test_criteo_tsv_columns_option() -> None:
    # Columns named in another order, with one the spec does not use.
    codec = CriteoTsvCodec(columns=["C1", "label", "skip", "I1", "I2", "C2"])
    good, bad = codec.decode(chunk_of([b"ab\t1\tzzz\t5\t6\t7", b"ab\t1\t5\t6\t7"]), TSV_SPEC)
    assert rows_of(good) == [{"label": 1.0, "I1": 5.0, "I2": 6.0, "C1": "ab", "C2": 7}]
    assert [b.reason for b in bad] == ["wrong_column_count"]
    assert codec.encode(good) == [b"ab\t1\t\t5\t6\t7"]


def test_criteo_tsv_rejects_specs_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="cannot read list field 'tags'"):
        CriteoTsvCodec().decode(chunk_of([b"1"]), SPEC)
    with pytest.raises(ValueError, match=r"labels \[.label.\] are not among the TSV columns"):
        CriteoTsvCodec(columns=["I1", "I2"]).decode(chunk_of([b"1\t2"]), TSV_SPEC)
    with pytest.raises(ValueError, match="columns must name each column once"):
        CriteoTsvCodec(columns=["a", "a"])


# --- Arrow IPC ------------------------------------------------------------------------------


def ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


ARROW_SPEC = SPEC.model_copy(update={"max_record_bytes": 1 << 16})


def test_arrow_ipc_acceptance() -> None:
    good_rows = [base(tags=["a"], cats=[1]), base(click=0, user=None), base(item=-5)]
    good_table = pa.Table.from_pylist(good_rows, schema=spec_schema(SPEC))
    good_payload = ipc(good_table)
    n = 2
    cases: list[tuple[bytes, list[str | None]]] = [
        (good_payload, [None, None, None]),
        (b"", ["empty_payload"]),
        (b"junk", ["bad_ipc"]),
        (good_payload[: len(good_payload) // 2], ["bad_ipc"]),
        (ipc(pa.table({"click": ["x"] * 70_000})), ["oversize"]),
        # Row-level problems: the payload's other rows are good.
        (
            ipc(pa.table({"click": ["1", None], "age": [1.0, 2.0]})),
            ["label_wrong_type", "null_label"],
        ),
        (ipc(pa.table({"age": [1.0] * n})), ["missing_label"] * n),
        (ipc(pa.table({"click": [1.0, math.nan], "age": [1.0, 2.0]})), [None, "label_not_finite"]),
        (
            ipc(
                pa.table(
                    {"click": [1, 1], "age": [1, 1], "item": pa.array([1, 2**63], pa.uint64())}
                )
            ),
            [None, "int_overflow"],
        ),
        (
            ipc(pa.table({"click": [1, 1], "age": [1, 1], "tags": [["a"], ["a", "b", "c", "d"]]})),
            [None, "list_too_long"],
        ),
        (
            ipc(pa.table({"click": [1, 1], "age": [1, 1], "cats": [[1, None], [2]]})),
            ["sparse_wrong_type", None],
        ),
        (
            ipc(pa.table({"click": [1, 1], "age": [1, 1], "user": [3, None]})),
            ["sparse_wrong_type", None],
        ),
        (
            # Other Arrow types that cast: int32, float32, dictionary and large strings, list<int8>.
            ipc(
                pa.table(
                    {
                        "click": pa.array([1], pa.int32()),
                        "age": pa.array([2.5], pa.float32()),
                        "user": pa.array(["d"]).dictionary_encode(),
                        "tags": pa.array([["l"]], pa.list_(pa.large_string())),
                        "cats": pa.array([[3]], pa.list_(pa.int8())),
                        "extra": pa.array([{"a": 1}]),
                    }
                )
            ),
            [None],
        ),
        (ipc(pa.table({"click": pa.array([], pa.float64())})), []),  # no rows, no records
    ]
    raw = chunk_of([p for p, _ in cases])
    good, bad = ArrowIpcCodec().decode(raw, ARROW_SPEC)
    want = Counter(r for _, rs in cases for r in rs if r is not None)
    assert count_reasons(bad) == dict(sorted(want.items()))
    want_positions = [
        int(raw.positions[k]) for k, (_, rs) in enumerate(cases) for r in rs if r is None
    ]
    assert good.column(POSITION).to_pylist() == want_positions
    assert rows_of(good)[:3] == [expected_row(r) for r in good_rows]
    assert rows_of(good)[3:] == [
        expected_row({"click": 1, "age": 1}),
        expected_row({"click": 1, "age": 1, "item": 1}),
        expected_row({"click": 1, "age": 1, "tags": ["a"]}),
        expected_row({"click": 1, "age": 1, "cats": [2]}),
        expected_row({"click": 1, "age": 1}),
        expected_row({"click": 1, "age": 2.5, "user": "d", "tags": ["l"], "cats": [3]}),
    ]
    # A bad row is dead-lettered as a one-row stream of its own; a bad payload as itself.
    overflow = next(b for b in bad if b.reason == "int_overflow")
    assert pa.ipc.open_stream(overflow.raw).read_all().column("item").to_pylist() == [2**63]
    assert next(b for b in bad if b.reason == "bad_ipc").raw == b"junk"


# --- the contract suite ---------------------------------------------------------------------


def good_table(spec: FeatureSpec, n: int, seed: int = 0) -> pa.Table:
    """``n`` good records for ``spec``, drawn at random (some values null)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, Any] = {}
    for name in spec.labels:
        cols[name] = rng.integers(0, 2, n).astype(np.float64)
    for d in spec.dense:
        lo = d.min_value if d.min_value is not None else -1e6
        hi = d.max_value if d.max_value is not None else 1e6
        values = rng.uniform(lo, hi, n)
        mask = rng.random(n) < 0.2 if d.fill is not None else None
        cols[d.name] = pa.array(values, mask=mask)
    for s in spec.sparse:
        mask = rng.random(n) < 0.2
        if s.type == "string":
            cols[s.name] = pa.array([f"{v:x}é" for v in rng.integers(0, 2**40, n)], mask=mask)
        elif s.type == "int":
            cols[s.name] = pa.array(rng.integers(-(2**62), 2**62, n), mask=mask)
        else:
            lengths = rng.integers(0, s.max_len + 1, n)
            lists = [
                [f"v{x}" if s.type == "list_string" else int(x) for x in rng.integers(0, 99, k)]
                for k in lengths
            ]
            cols[s.name] = pa.array(lists, type=spec_schema(spec).field(s.name).type, mask=mask)
    return pa.table(cols).cast(spec_schema(spec))


CONTRACT: list[tuple[str, Codec, FeatureSpec, Callable[[int], bytes]]] = [
    ("json-numba", JsonLinesCodec(), SPEC, lambda i: b'{"click":' + str(i).encode()),
    ("json-arrow", JsonLinesCodec(engine="arrow"), SPEC, lambda i: b"[" + str(i).encode()),
    ("criteo-tsv", CriteoTsvCodec(), TSV_SPEC, lambda i: b"x\t" + str(i).encode()),
    ("arrow-ipc", ArrowIpcCodec(), ARROW_SPEC, lambda i: b"ARROW" + str(i).encode()),
    ("arrow-ipc-7", ArrowIpcCodec(rows_per_payload=7), ARROW_SPEC, lambda i: bytes([i % 256])),
]
CONTRACT_IDS = [c[0] for c in CONTRACT]


@pytest.fixture(params=CONTRACT, ids=CONTRACT_IDS)
def contract(request: pytest.FixtureRequest) -> tuple[Codec, FeatureSpec, Callable[[int], bytes]]:
    _, codec, spec, bad = request.param
    return codec, spec, bad


def test_contract_round_trip(contract: tuple[Codec, FeatureSpec, Callable[[int], bytes]]) -> None:
    codec, spec, _ = contract
    table = good_table(spec, 500)
    payloads = codec.encode(table.append_column(POSITION, pa.array(np.arange(500))))
    good, bad = codec.decode(chunk_of(payloads, first=0, step=1), spec)
    assert bad == []
    rows = 500 if not isinstance(codec, ArrowIpcCodec) else len(payloads) * codec.rows_per_payload
    assert good.drop_columns([POSITION]).equals(table), "values change in a round trip"
    if not isinstance(codec, ArrowIpcCodec) or codec.rows_per_payload == 1:
        assert good.column(POSITION).to_pylist() == list(range(min(rows, 500)))


def test_contract_empty_input(contract: tuple[Codec, FeatureSpec, Callable[[int], bytes]]) -> None:
    codec, spec, _ = contract
    good, bad = codec.decode(chunk_of([]), spec)
    assert (good.num_rows, bad) == (0, [])
    assert good.schema == spec_schema(spec, position=True)


def test_contract_deterministic_and_pickles(
    contract: tuple[Codec, FeatureSpec, Callable[[int], bytes]],
) -> None:
    codec, spec, bad_payload = contract
    payloads = codec.encode(good_table(spec, 50, seed=1))
    payloads[3:3] = [bad_payload(i) for i in range(5)]
    raw = chunk_of(payloads)
    first = codec.decode(raw, spec)
    copy = pickle.loads(pickle.dumps(codec))
    assert copy == codec
    for again in (codec.decode(raw, spec), copy.decode(pickle.loads(pickle.dumps(raw)), spec)):
        assert again[0].equals(first[0])
        assert again[1] == first[1]
    assert len(first[1]) == 5


def test_contract_all_bad(contract: tuple[Codec, FeatureSpec, Callable[[int], bytes]]) -> None:
    codec, spec, bad_payload = contract
    payloads = [bad_payload(i) for i in range(300)]
    good, bad = codec.decode(chunk_of(payloads), spec)
    assert good.num_rows == 0
    assert good.schema == spec_schema(spec, position=True)
    assert [b.raw for b in bad] == payloads
    assert all(b.reason in REASONS for b in bad)


def test_contract_huge_block(contract: tuple[Codec, FeatureSpec, Callable[[int], bytes]]) -> None:
    """Many records (several of pyarrow's blocks and the JSON reader's segments), 1 in 500 bad."""
    codec, spec, bad_payload = contract
    n = 40_000 if not isinstance(codec, ArrowIpcCodec) or codec.rows_per_payload > 1 else 8_000
    table = good_table(spec, n, seed=2)
    payloads = codec.encode(table)
    bad_at = set(range(7, len(payloads), 500))
    for i in bad_at:
        payloads[i] = bad_payload(i)
    good, bad = codec.decode(chunk_of(payloads, first=0, step=1), spec)
    assert sorted(b.position for b in bad) == sorted(bad_at)
    per = codec.rows_per_payload if isinstance(codec, ArrowIpcCodec) else 1
    keep = np.ones(n, dtype=np.bool_)
    for i in bad_at:
        keep[i * per : (i + 1) * per] = False
    assert good.drop_columns([POSITION]).equals(table.filter(pa.array(keep)))


def test_make_codec() -> None:
    assert make_codec("json") == JsonLinesCodec()
    assert make_codec("json", engine="arrow").engine == "arrow"  # type: ignore[attr-defined]
    assert make_codec("arrow", rows_per_payload=3) == ArrowIpcCodec(rows_per_payload=3)
    with pytest.raises(ValueError, match=r"unknown codec 'avro'; the codecs are \['arrow'"):
        make_codec("avro")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows_per_payload must be a positive int, got 0"):
        make_codec("arrow", rows_per_payload=0)
    with pytest.raises(ValueError, match="engine must be 'numba' or 'arrow', got 'fast'"):
        make_codec("json", engine="fast")


def test_table_chunks_are_refused() -> None:
    raw = RawChunk(Chunk("pq", "f", 0, 1), np.arange(1), table=pa.table({"click": [1.0]}))
    with pytest.raises(ValueError, match="holds an Arrow table, not payloads"):
        JsonLinesCodec().decode(raw, SPEC)


# --- dead letters end to end ----------------------------------------------------------------


def test_dead_letters_round_trip_raw_bytes(tmp_path: Path) -> None:
    cases, _ = json_cases()
    raw = chunk_of([p for p, _ in cases])
    _, bad = JsonLinesCodec().decode(raw, SPEC)
    path = tmp_path / "dlq" / "json.jsonl"
    sink = CountingDeadLetterSink(JsonlDeadLetterSink(path))
    sink.write(bad[:10])
    sink.write(bad[10:])
    sink.close()
    back = read_dead_letters(path)
    assert back == bad  # every field, raw bytes included (non-UTF-8 ones too)
    assert any(b"\xff" in b.raw for b in back)
    assert sink.counts == count_reasons(bad)
    # The file is ASCII JSON lines, whatever the payloads held.
    assert all(json.loads(line) for line in path.read_bytes().decode("ascii").splitlines())


# --- the oracle: a reference written from the documented rules ------------------------------

ABSENT = object()
VALUE_FIELDS = ("click", "price", "age")  # the label and dense fields, in value_reason order


def is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def reference(rec: dict[str, Any]) -> str | None:
    """The reason a decoded JSON object is bad (None: good), from the module docstrings."""
    get = rec.get

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def as_float(v: Any) -> float:
        try:
            return float(v)
        except OverflowError:
            return math.copysign(math.inf, v)

    # The type pass, field by field.
    for name, role in (("click", "label"), ("price", "dense"), ("age", "dense")):
        v = get(name)
        if v is not None and not number(v):
            return f"{role}_wrong_type"
    user, item = get("user"), get("item")
    if user is not None and not isinstance(user, str):
        return "sparse_wrong_type"
    if isinstance(user, str) and not is_utf8(user):
        return "not_utf8"  # a lone surrogate escape
    if item is not None:
        if not isinstance(item, int) or isinstance(item, bool):
            return "sparse_wrong_type"
        if not -(2**63) <= item <= I64_MAX:
            return "int_overflow"
    for name, kind in (("tags", str), ("cats", int)):
        v = get(name)
        if v is None:
            continue
        if not isinstance(v, list):
            return "sparse_wrong_type"
        for e in v:
            if e is None or not isinstance(e, kind) or isinstance(e, bool):
                return "sparse_wrong_type"
            if isinstance(e, str) and not is_utf8(e):
                return "not_utf8"
            if isinstance(e, int) and not -(2**63) <= e <= I64_MAX:
                return "int_overflow"
    # The value pass.
    if "click" not in rec:
        return "missing_label"
    click, price, age = (None if get(k) is None else as_float(get(k)) for k in VALUE_FIELDS)
    if reason := value_reason(click, price, age, price_max=1000):
        return reason
    for name in ("tags", "cats"):
        if len(get(name) or []) > 3:
            return "list_too_long"
    return None


numbers = st.one_of(
    st.integers(-2, 3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-2, 1200),
)
anything = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2)
)
absent_or_null = st.sampled_from([ABSENT, None])
# Per field: values that are good, and values that are (mostly) bad.
GOOD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "click": st.one_of(st.integers(0, 1), st.floats(0, 1)),
    "price": st.one_of(absent_or_null, st.floats(0, 1000), st.integers(0, 1000)),
    "age": st.one_of(st.floats(-1e300, 1e300), st.integers(-(2**70), 2**70)),
    "user": st.one_of(absent_or_null, st.text(max_size=8)),
    "item": st.one_of(absent_or_null, st.integers(-(2**63), I64_MAX)),
    "tags": st.one_of(absent_or_null, st.lists(st.text(max_size=4), max_size=3)),
    "cats": st.one_of(absent_or_null, st.lists(st.integers(-(2**63), I64_MAX), max_size=3)),
}
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "click": st.one_of(st.just(ABSENT), numbers, anything),
    "price": st.one_of(numbers, anything),
    "age": st.one_of(st.just(ABSENT), numbers, anything),
    "user": st.one_of(numbers, anything),
    "item": st.one_of(numbers, anything),
    "tags": st.one_of(
        st.lists(st.text(max_size=2), min_size=4, max_size=5),
        st.lists(st.one_of(st.text(max_size=2), st.none(), st.integers()), max_size=3),
        anything,
    ),
    "cats": st.one_of(
        st.lists(st.integers(-(2**63), I64_MAX), min_size=4, max_size=5),
        st.lists(st.one_of(st.integers(-(2**65), 2**65), st.none(), st.floats()), max_size=3),
        anything,
    ),
}
json_value = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4)
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON object: each field good 9 times in 10, in any order, with unknown keys."""
    rec: dict[str, Any] = {}
    for name, good in GOOD_VALUES.items():
        bad = draw(st.integers(0, 9)) == 0
        v = draw(BAD_VALUES[name] if bad else good)
        if v is not ABSENT:
            rec[name] = v
    extras = draw(st.dictionaries(st.text(max_size=5), json_value, max_size=2))
    items = [*rec.items(), *((k, v) for k, v in extras.items() if k not in GOOD_VALUES)]
    order = draw(st.permutations(range(len(items))))
    return {items[k][0]: items[k][1] for k in order}


@st.composite
def payload_of(draw: st.DrawFn, rec: dict[str, Any]) -> bytes:
    style = draw(st.sampled_from(["compact", "spaced", "indent", "ascii"]))
    if style == "compact":
        return json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode()
    if style == "indent":
        return json.dumps(rec, indent=1).encode()
    return json.dumps(rec, ensure_ascii=style == "ascii").encode()


@given(data=st.data(), recs=st.lists(records(), min_size=1, max_size=30))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_json_oracle(data: st.DataObject, recs: list[dict[str, Any]]) -> None:
    # Records of 512+ bytes are oversize; keep to records that fit.
    payloads = [data.draw(payload_of(r)) for r in recs]
    fits = [len(p) <= SPEC.max_record_bytes for p in payloads]
    recs = [r for r, f in zip(recs, fits, strict=True) if f]
    payloads = [p for p, f in zip(payloads, fits, strict=True) if f]
    if not payloads:
        return
    want = [reference(r) for r in recs]
    raw = chunk_of(payloads)
    results = [c.decode(raw, SPEC) for c in JSON_ENGINES]
    for good, bad in results:
        got: list[str | None] = [None] * len(payloads)
        for b in bad:
            got[(b.position - 1000) // 3] = b.reason
        assert got == want, [
            (w, g, p) for w, g, p in zip(want, got, payloads, strict=True) if w != g
        ]
        rows = [expected_row(r) for r, w in zip(recs, want, strict=True) if w is None]
        assert rows_of(good) == rows
    assert results[0][0].equals(results[1][0])


def reference_payload(payload: bytes) -> str | None:
    """The reason a payload is bad (None: good): ``json.loads``, then :func:`reference`."""
    if not payload:
        return "empty_payload"
    if len(payload) > SPEC.max_record_bytes:
        return "oversize"
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return "not_utf8"
    duplicated: list[set[str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        duplicated.append({k for k in keys if keys.count(k) > 1})
        return dict(items)

    try:
        obj = json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return "not_json"
    if not isinstance(obj, dict):
        return "not_object"
    if duplicated[-1] & set(FIELDS):
        return "duplicate_field"
    return reference(obj)


MUTATIONS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"e", b"-", b".", b"0", b" ", b"\n"]
MUTATIONS += [b"null", b"NaN", b"-NaN", b"Inf", b"\x01", b"\xff", b"\\u", b"\\ud800", b"tru", b"E+"]
MUTATIONS += [b"00", b'"click":1,', b'"age":"x",', b'"click":', b"{}", b"[]"]


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    """A JSON record with up to three bytes-level edits: deletions, insertions, truncation."""
    payload = bytearray(draw(payload_of(draw(records()))))
    for _ in range(draw(st.integers(0, 3))):
        k = draw(st.integers(0, len(payload)))
        edit = draw(st.integers(0, 2))
        if edit == 0 and payload:
            del payload[min(k, len(payload) - 1)]
        elif edit == 1:
            payload[k:k] = draw(st.sampled_from(MUTATIONS))
        else:
            del payload[k:]
    return bytes(payload)


@given(payloads=st.lists(mutated_payloads(), min_size=1, max_size=30))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_json_mangled_payloads(payloads: list[bytes]) -> None:
    """Broken JSON gets json.loads's verdict; the engines agree (but on Arrow's ``Inf``)."""
    raw = chunk_of(payloads)
    good, bad = JsonLinesCodec().decode(raw, SPEC)
    got: list[str | None] = [None] * len(payloads)
    for b in bad:
        got[(b.position - 1000) // 3] = b.reason
    assert got == [reference_payload(p) for p in payloads]
    if not any(b"Inf" in p or b"-NaN" in p for p in payloads):
        good_arrow, bad_arrow = JsonLinesCodec(engine="arrow").decode(raw, SPEC)
        assert good_arrow.equals(good)
        assert bad_arrow == bad
