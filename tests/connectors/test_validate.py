"""validate/check on Arrow tables alone (as columnar sources use them), and dead-letter sinks."""

from __future__ import annotations

import json
import math
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.codecs import JsonLinesCodec
from connectors.deadletter import (
    CountingDeadLetterSink,
    JsonlDeadLetterSink,
    NullDeadLetterSink,
    read_dead_letters,
)
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, RawChunk
from connectors.validate import (
    POSITION,
    REASONS,
    Marker,
    check,
    count_reasons,
    row_json,
    spec_schema,
    validate,
)
from tests.support.bad_records import feature_spec, value_reason

SPEC = feature_spec(price_max=10, max_len=2)


def table(n: int = 1, **columns: Any) -> pa.Table:
    """A table of ``n`` good rows with some columns replaced (None drops a column)."""
    cols: dict[str, Any] = {
        "click": pa.array([1.0] * n),
        "price": pa.array([5.0] * n),
        "age": pa.array([30.0] * n),
        "user": pa.array(["u"] * n),
        "item": pa.array([7] * n),
        "tags": pa.array([["a"]] * n),
        "cats": pa.array([[1]] * n),
    }
    cols.update(columns)
    return pa.table({k: v for k, v in cols.items() if v is not None})


def reasons(t: pa.Table, spec: FeatureSpec = SPEC) -> list[str | None]:
    """The reason of each row (None when good)."""
    c = check(t, spec)
    out: list[str | None] = [None] * t.num_rows
    for p in c.problems:
        out[p.row] = p.reason
    assert [r is None for r in out] == c.good.tolist()
    return out


# --- types ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value", "expected"),
    [
        ("click", pa.array([1], pa.int8()), 1.0),
        ("click", pa.array([1], pa.uint32()), 1.0),
        ("click", pa.array([1.0], pa.float16()), 1.0),
        ("price", pa.array([2.5], pa.float32()), 2.5),
        ("price", pa.array([2], pa.decimal128(5, 0)), 2.0),
        ("price", pa.nulls(1), None),
        ("user", pa.array(["u"], pa.large_string()), "u"),
        ("user", pa.array(["u"]).dictionary_encode(), "u"),
        ("user", pa.array(["u"], pa.string_view()), "u"),
        ("user", pa.array([b"u"], pa.binary()), "u"),
        ("item", pa.array([7], pa.int32()), 7),
        ("item", pa.array([7], pa.uint64()), 7),
        ("tags", pa.array([["a"]], pa.large_list(pa.large_string())), ["a"]),
        ("tags", pa.array([[b"a"]], pa.list_(pa.binary())), ["a"]),
        ("tags", pa.array([["a"]], pa.list_(pa.string(), 1)), ["a"]),
        ("tags", pa.array([[]], pa.list_(pa.null())), []),
        ("cats", pa.array([[1]], pa.list_(pa.uint8())), [1]),
        ("cats", pa.array([[1, 2]], pa.list_view(pa.int16())), [1, 2]),
        ("cats", pa.array([[1]], pa.large_list_view(pa.int64())), [1]),
    ],
)
def test_castable_types_are_cast(column: str, value: pa.Array, expected: Any) -> None:
    c = check(table(**{column: value}), SPEC)
    assert c.good.tolist() == [True], c.problems
    assert c.table.schema == spec_schema(SPEC)
    assert c.table.column(column).to_pylist() == [expected]


@pytest.mark.parametrize(
    ("column", "value", "reason", "detail"),
    [
        (
            "click",
            pa.array(["1"]),
            "label_wrong_type",
            "label 'click' is a string ('1'); labels are numbers in [0, 1]",
        ),
        ("click", pa.array([True]), "label_wrong_type", "label 'click' is a bool (True)"),
        ("price", pa.array([[1.0]]), "dense_wrong_type", "dense field 'price' is a list ([1.0])"),
        (
            "price",
            pa.array([{"a": 1}]),
            "dense_wrong_type",
            "dense field 'price' is a object ({'a': 1})",
        ),
        (
            "user",
            pa.array([3]),
            "sparse_wrong_type",
            "sparse field 'user' (type string) is a int (3); it takes a string",
        ),
        (
            "user",
            pa.array([b"\xff"]),
            "not_utf8",
            "sparse field 'user' (type string) holds b'\\xff', not valid UTF-8",
        ),
        (
            "item",
            pa.array([3.0]),
            "sparse_wrong_type",
            "sparse field 'item' (type int) is a float (3.0); it takes an int",
        ),
        ("item", pa.array(["3"]), "sparse_wrong_type", "it takes an int"),
        (
            "item",
            pa.array([2**63], pa.uint64()),
            "int_overflow",
            "sparse field 'item' (type int) is 9223372036854775808, beyond int64",
        ),
        ("tags", pa.array(["a"]), "sparse_wrong_type", "is a string ('a'); it takes a list"),
        (
            "tags",
            pa.array([[1]]),
            "sparse_wrong_type",
            "is a list of ints ([1]); it takes a list of strings",
        ),
        (
            "tags",
            pa.array([["a", None]]),
            "sparse_wrong_type",
            "holds a null element (['a', None])",
        ),
        (
            "tags",
            pa.array([[b"\xfe"]], pa.list_(pa.binary())),
            "not_utf8",
            "with an element not valid UTF-8",
        ),
        (
            "cats",
            pa.array([[1.5]]),
            "sparse_wrong_type",
            "is a list of floats ([1.5]); it takes a list of ints",
        ),
        (
            "cats",
            pa.array([[2**63]], pa.list_(pa.uint64())),
            "int_overflow",
            "with an element beyond int64",
        ),
    ],
)
def test_wrong_types(column: str, value: pa.Array, reason: str, detail: str) -> None:
    c = check(table(**{column: value}), SPEC)
    assert [(p.reason, p.field) for p in c.problems] == [(reason, column)]
    assert detail in c.problems[0].detail


def test_wrong_type_spares_null_rows() -> None:
    # A string column for a dense field: its null rows are merely missing.
    assert reasons(table(3, price=pa.array(["1", None, "x"]))) == [
        "dense_wrong_type",
        None,
        "dense_wrong_type",
    ]
    # A list of the wrong element type: empty lists are fine.
    assert reasons(table(2, cats=pa.array([["a"], []]))) == ["sparse_wrong_type", None]


# --- values ---------------------------------------------------------------------------------


def test_labels() -> None:
    values = [0.0, 1.0, None, math.nan, math.inf, -0.1, 1.1, 0.5]
    assert reasons(table(len(values), click=pa.array(values))) == [
        None,
        None,
        "null_label",
        "label_not_finite",
        "label_not_finite",
        "label_out_of_range",
        "label_out_of_range",
        None,
    ]
    assert reasons(table(2, click=None)) == ["missing_label", "missing_label"]


def test_dense() -> None:
    price = [0.0, 10.0, -0.5, 10.5, math.nan, -math.inf, None]
    assert reasons(table(len(price), price=pa.array(price))) == [
        None,
        None,
        "dense_below_min",
        "dense_above_max",
        "dense_not_finite",
        "dense_not_finite",
        None,  # null, then filled by the pipeline (fill=0)
    ]
    assert reasons(table(2, age=pa.array([None, 1.0]))) == ["missing_dense", None]
    assert reasons(table(1, age=None)) == ["missing_dense"]
    c = check(table(1, price=pa.array([None], pa.float64())), SPEC)
    assert c.table.column("price").to_pylist() == [None]  # kept null: fill is applied later


def test_lists_and_missing_sparse() -> None:
    tags = [["a", "b"], ["a", "b", "c"], [], None]
    assert reasons(table(4, tags=pa.array(tags))) == [None, "list_too_long", None, None]
    c = check(table(1, user=None, item=None, tags=None, cats=None), SPEC)
    assert c.good.tolist() == [True]
    assert c.table.select(["user", "item", "tags", "cats"]).to_pylist() == [
        {"user": None, "item": None, "tags": None, "cats": None}
    ]


def test_type_problems_come_before_value_problems() -> None:
    # Row 0: label out of range, and a wrong type in the last field: the type wins.
    # Row 1: label absent (a value problem) and a list too long: the first field wins.
    t = table(
        2,
        click=pa.array([5.0, None]),
        cats=pa.array([["x"], []]),
        tags=pa.array([["a"], ["a", "b", "c"]]),
    )
    assert reasons(t) == ["sparse_wrong_type", "null_label"]


def test_extra_columns_are_ignored() -> None:
    t = table(1, extra=pa.array([{"deep": [1, 2]}]), more=pa.array(["x"]))
    good, bad = validate(t, SPEC)
    assert bad == []
    assert good.column_names == [*spec_schema(SPEC).names, POSITION]


def test_chunked_columns() -> None:
    # Lists with null elements in a later chunk: their rows count from the table's start.
    t = pa.concat_tables([table(3), table(2, cats=pa.array([[1], [None]]))])
    assert t.column("cats").num_chunks == 2
    assert reasons(t) == [None, None, None, None, "sparse_wrong_type"]


# --- positions and raw bytes ----------------------------------------------------------------


def test_positions_and_raw_bytes() -> None:
    t = table(3, click=pa.array([1.0, 9.0, 0.0]))
    # From the raw chunk: rows[i] is the record of row i.
    payloads = [b"a", b"b", b"c", b"d"]
    raw = RawChunk(Chunk("s", "p/0", 10, 20), np.array([10, 12, 15, 19]), payloads)
    good, bad = validate(t, SPEC, raw, rows=np.array([0, 2, 3]))
    assert good.column(POSITION).to_pylist() == [10, 19]
    assert [(b.source, b.partition, b.position, b.raw) for b in bad] == [("s", "p/0", 15, b"c")]
    # From a __position column, without payloads: the row as a JSON line the codec reads back.
    t2 = t.append_column(POSITION, pa.array([5, 6, 7]))
    good, bad = validate(t2, SPEC, source="pq", partition="f.parquet")
    assert good.column(POSITION).to_pylist() == [5, 7]
    assert (bad[0].source, bad[0].partition, bad[0].position) == ("pq", "f.parquet", 6)
    back = JsonLinesCodec().decode(
        RawChunk(Chunk("x", "y", 0, 1), np.arange(1), [bad[0].raw]), SPEC
    )
    assert back[1][0].reason == "label_out_of_range"
    # Explicit positions win; by default, row numbers.
    assert validate(t, SPEC, positions=np.array([7, 8, 9]))[1][0].position == 8
    assert validate(t, SPEC)[1][0].position == 1
    with pytest.raises(ValueError, match="positions has 2 entries for a table of 3 rows"):
        validate(t, SPEC, positions=np.array([1, 2]))
    with pytest.raises(ValueError, match="rows has 1 entries for a table of 3 rows"):
        validate(t, SPEC, raw, rows=np.array([0]))


def test_row_json_writes_nan_and_lists() -> None:
    row = pa.table({"click": [math.nan], "tags": [["a"]], POSITION: [3]})
    assert row_json(row) == b'{"click":NaN,"tags":["a"]}'


def test_marker_keeps_codec_problems_first() -> None:
    m = Marker(2)
    m.mark(np.array([True, False]), "not_utf8", "user", None, lambda _v: "codec says")
    c = check(table(2, click=pa.array([9.0, 9.0])), SPEC, m)
    assert [(p.row, p.reason) for p in c.problems] == [(0, "not_utf8"), (1, "label_out_of_range")]
    with pytest.raises(ValueError, match="the marker has 2 rows for a table of 3 rows"):
        check(table(3), SPEC, Marker(2))


def test_reasons_and_counts() -> None:
    t = table(4, click=pa.array([9.0, None, 1.0, 9.0]))
    _, bad = validate(t, SPEC)
    assert count_reasons(bad) == {"label_out_of_range": 2, "null_label": 1}
    assert all(b.reason in REASONS for b in bad)
    assert all(REASONS[r].startswith(("a ", "an ", "the ")) for r in REASONS)


@given(
    clicks=st.lists(st.one_of(st.none(), st.floats(), st.sampled_from([0.0, 1.0])), max_size=20),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_values_match_a_reference(clicks: list[float | None], data: st.DataObject) -> None:
    n = len(clicks)
    prices = data.draw(st.lists(st.one_of(st.none(), st.floats()), min_size=n, max_size=n))
    ages = data.draw(st.lists(st.one_of(st.none(), st.floats(-5, 5)), min_size=n, max_size=n))
    t = table(
        n,
        click=pa.array(clicks, pa.float64()),
        price=pa.array(prices, pa.float64()),
        age=pa.array(ages, pa.float64()),
    )

    def ref(c: float | None, p: float | None, a: float | None) -> str | None:
        return value_reason(c, p, a, price_max=10)

    assert reasons(t) == [ref(*v) for v in zip(clicks, prices, ages, strict=True)]
    good, bad = validate(t, SPEC)
    assert good.num_rows + len(bad) == n


# --- dead-letter sinks ----------------------------------------------------------------------


def bad_record(i: int, raw: bytes = b"") -> BadRecord:
    return BadRecord("kafka", "events/0", i, "not_json", None, f"record {i} is not JSON", raw)


def test_jsonl_sink_round_trips_every_byte(tmp_path: Path) -> None:
    every_byte = bytes(range(256))
    records = [bad_record(0, every_byte), bad_record(1, b""), bad_record(2, "é😀".encode())]
    path = tmp_path / "a" / "b" / "dead.jsonl"  # parents are created
    sink = JsonlDeadLetterSink(path)
    sink.write(records)
    sink.close()
    assert read_dead_letters(path) == records
    assert path.read_bytes().isascii()


def test_jsonl_sink_appends_reopens_and_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "dead.jsonl"
    sink = JsonlDeadLetterSink(path)
    sink.write([])
    assert not path.exists()  # nothing to write, no file
    sink.write([bad_record(0)])
    sink.close()
    sink.close()  # twice is fine
    assert len(synced) == 1
    sink.write([bad_record(1)])  # reopens
    sink.close()
    with JsonlDeadLetterSink(path) as again:  # another sink appends to the same file
        again.write([bad_record(2)])
    assert [r.position for r in read_dead_letters(path)] == [0, 1, 2]
    assert len(synced) == 3


def test_jsonl_sink_threads_do_not_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "dead.jsonl"
    sink = JsonlDeadLetterSink(path)

    def work(k: int) -> None:
        for i in range(50):
            sink.write([bad_record(k * 1000 + i, bytes([i]) * 300)] * 3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    back = read_dead_letters(path)
    assert len(back) == sink.written == 600
    assert all(r.raw == bytes([r.position % 1000]) * 300 for r in back)


def test_jsonl_sink_pickles_when_closed(tmp_path: Path) -> None:
    sink = JsonlDeadLetterSink(tmp_path / "d.jsonl")
    copy = pickle.loads(pickle.dumps(sink))
    copy.write([bad_record(0)])
    copy.close()
    sink.write([bad_record(1)])
    with pytest.raises(TypeError, match=r"close the dead-letter sink .* before pickling it"):
        pickle.dumps(sink)
    sink.close()
    assert len(read_dead_letters(tmp_path / "d.jsonl")) == 2


def test_read_dead_letters_names_a_broken_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(bad_record(0).to_json()) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2 is not a dead-letter line"):
        read_dead_letters(path)


def test_counting_and_null_sinks(tmp_path: Path) -> None:
    inner = JsonlDeadLetterSink(tmp_path / "d.jsonl")
    sink = CountingDeadLetterSink(inner)
    other = BadRecord("s", "p", 9, "oversize", None, "too big")
    sink.write([bad_record(0), other, bad_record(1)])
    sink.close()
    assert (sink.counts, sink.total) == ({"not_json": 2, "oversize": 1}, 3)
    assert len(read_dead_letters(tmp_path / "d.jsonl")) == 3
    copy = pickle.loads(pickle.dumps(sink))
    assert copy.counts == sink.counts
    counting_only = CountingDeadLetterSink()
    counting_only.write([other])
    assert isinstance(counting_only.inner, NullDeadLetterSink)
    assert counting_only.counts == {"oversize": 1}
