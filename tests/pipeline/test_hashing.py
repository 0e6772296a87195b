"""Feature hashing against a pure-Python reference of the documented hash.

The reference reads every record with ``to_pylist()`` and hashes it with
Python integers; the kernels must agree bit for bit on any layout Arrow can
produce (nulls, empty lists, unicode, slices, chunks, large and dictionary
types). Known-answer ids pin the hash itself: ids live in embedding tables and
checkpoints, so changing them silently would orphan every trained row.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings

from pipeline.hashing import FieldHasher, FieldSeeds, SparseKind, feature_id, hash_sparse
from tests.pipeline.hashing_reference import (
    ref_hash,
    ref_int_id,
    ref_string_id,
)

REPO = Path(__file__).resolve().parents[2]


def check(field: str, column: pa.Array | pa.ChunkedArray, kind: SparseKind) -> None:
    ids, lengths = hash_sparse(field, column, kind)
    want_ids, want_lengths = ref_hash(field, column, kind)
    assert ids.dtype == np.uint64
    assert lengths.dtype == np.int32
    assert lengths.tolist() == want_lengths
    assert ids.tolist() == want_ids


# --- generated columns -----------------------------------------------------------

INT_TYPES = {
    pa.int8(): (-(1 << 7), (1 << 7) - 1),
    pa.int16(): (-(1 << 15), (1 << 15) - 1),
    pa.int32(): (-(1 << 31), (1 << 31) - 1),
    pa.int64(): (-(1 << 63), (1 << 63) - 1),
    pa.uint8(): (0, (1 << 8) - 1),
    pa.uint16(): (0, (1 << 16) - 1),
    pa.uint32(): (0, (1 << 32) - 1),
    pa.uint64(): (0, (1 << 63) - 1),  # above 2**63 the id is the int64 one (see below)
}
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)


@st.composite
def columns(draw: st.DrawFn, kind: SparseKind) -> pa.Array | pa.ChunkedArray:
    """A ``kind`` column: nulls, empty lists, a random Arrow type, maybe sliced and chunked."""
    if kind in ("int", "list_int"):
        value_type = draw(st.sampled_from(list(INT_TYPES)))
        lo, hi = INT_TYPES[value_type]
        values: st.SearchStrategy[Any] = st.integers(lo, hi)
    else:
        value_type = draw(st.sampled_from([pa.string(), pa.large_string()]))
        # A small alphabet next to arbitrary text, so values repeat within a batch.
        values = st.one_of(st.sampled_from(["", "a", "12", "\u00e9\u00e9", "x" * 17]), texts)
    if kind.startswith("list_"):
        make = st.sampled_from([pa.list_, pa.large_list])
        typ = draw(make)(value_type)
        items = st.lists(st.none() | values, max_size=6)
    else:
        typ = value_type
        items = values
    records = draw(st.lists(st.none() | items, max_size=40))
    head = draw(st.integers(0, 3))
    tail = draw(st.integers(0, 3))
    # Padding before and after, then sliced away: the kernels must honour offsets.
    padded = [draw(st.none() | items) for _ in range(head)] + records
    padded += [draw(st.none() | items) for _ in range(tail)]
    arr = pa.array(padded, type=typ).slice(head, len(records))
    if draw(st.booleans()) and len(records) > 1:
        cuts = sorted(draw(st.lists(st.integers(0, len(records)), max_size=4)))
        bounds = [0, *cuts, len(records)]
        return pa.chunked_array([arr.slice(a, b - a) for a, b in itertools.pairwise(bounds)], typ)
    return arr


@pytest.mark.parametrize("kind", ["string", "int", "list_string", "list_int"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_reference(kind: SparseKind, data: st.DataObject) -> None:
    column = data.draw(columns(kind))
    check(data.draw(st.sampled_from(["f", "user.id", "C1"])), column, kind)


# --- layouts the generator does not reach ----------------------------------------


def test_null_list_with_nonempty_segment_is_empty() -> None:
    # Arrow allows a null list slot to span child values; they must not leak out.
    values = pa.array(["a", "b", "c", "d"])
    offsets = pa.array([0, 2, 4], pa.int32())
    arr = pa.ListArray.from_arrays(offsets, values, mask=pa.array([True, False]))
    assert arr.to_pylist() == [None, ["c", "d"]]
    ids, lengths = hash_sparse("f", arr, "list_string")
    assert lengths.tolist() == [0, 2]
    assert ids.tolist() == [ref_string_id("f", "c"), ref_string_id("f", "d")]


def test_list_whose_child_is_sliced() -> None:
    child = pa.array([None, 1, 2, 3, None, 5], pa.int16()).slice(1)
    arr = pa.ListArray.from_arrays(pa.array([0, 2, 5], pa.int32()), child).slice(1)
    check("f", arr, "list_int")


def test_multichunk_list_column_and_empty_chunks() -> None:
    typ = pa.large_list(pa.large_string())
    col = pa.chunked_array(
        [pa.array([], typ), pa.array([["é", None], []], typ), pa.array([None, ["z"] * 3], typ)],
        typ,
    )
    check("f", col, "list_string")


def test_all_null_dictionary_and_view_columns() -> None:
    kinds: list[SparseKind] = ["string", "int", "list_string", "list_int"]
    for kind in kinds:
        ids, lengths = hash_sparse("f", pa.nulls(3), kind)
        assert (len(ids), lengths.tolist()) == (0, [0, 0, 0])
    dictionary = pa.array(["b", None, "a", "b"]).dictionary_encode()
    check("f", dictionary, "string")
    if hasattr(pa, "string_view"):
        check(
            "f", pa.array(["a", None, "long enough to be out of line"], pa.string_view()), "string"
        )


def test_empty_column() -> None:
    for kind, typ in [("string", pa.string()), ("list_int", pa.list_(pa.int32()))]:
        ids, lengths = hash_sparse("f", pa.array([], typ), kind)  # type: ignore[arg-type]
        assert (ids.shape, lengths.shape) == ((0,), (0,))
        ids, lengths = hash_sparse("f", pa.chunked_array([], typ), kind)  # type: ignore[arg-type]
        assert (ids.shape, lengths.shape) == ((0,), (0,))


def test_integer_widths_share_ids_and_uint64_keeps_its_bits() -> None:
    want = hash_sparse("f", pa.array([5, -3], pa.int64()), "int")[0].tolist()
    for typ in (pa.int8(), pa.int16(), pa.int32()):
        assert hash_sparse("f", pa.array([5, -3], typ), "int")[0].tolist() == want
    big = hash_sparse("f", pa.array([(1 << 64) - 1], pa.uint64()), "int")[0]
    assert int(big[0]) == ref_int_id("f", -1) == feature_id("f", -1)
    lists = pa.array([[(1 << 64) - 1, 7]], pa.list_(pa.uint64()))
    assert hash_sparse("f", lists, "list_int")[0].tolist() == [
        ref_int_id("f", -1),
        ref_int_id("f", 7),
    ]


# --- separation of fields and types ----------------------------------------------


def test_same_value_in_two_fields_gets_two_ids() -> None:
    a, _ = hash_sparse("a", pa.array(["v", "12"]), "string")
    b, _ = hash_sparse("b", pa.array(["v", "12"]), "string")
    assert not set(a.tolist()) & set(b.tolist())
    ia, _ = hash_sparse("a", pa.array([0, 12]), "int")
    ib, _ = hash_sparse("b", pa.array([0, 12]), "int")
    assert not set(ia.tolist()) & set(ib.tolist())


def test_string_and_int_of_one_field_differ() -> None:
    assert feature_id("f", "12") != feature_id("f", 12)
    assert feature_id("f", "") != feature_id("f", 0)
    seeds = FieldSeeds.of("f")
    assert len({int(seeds.string), int(seeds.int_lo), int(seeds.int_hi)}) == 3


def test_list_and_single_hot_values_hash_alike() -> None:
    single, _ = hash_sparse("f", pa.array(["x"]), "string")
    multi, _ = hash_sparse("f", pa.array([["x"]]), "list_string")
    assert single.tolist() == multi.tolist()


def test_ints_of_one_field_do_not_collide() -> None:
    values = np.arange(-50_000, 50_000, dtype=np.int64)
    ids, _ = hash_sparse("f", pa.array(values), "int")
    assert len(np.unique(ids)) == len(values)


def test_strings_that_differ_in_length_or_padding() -> None:
    values = ["", "\x00", "\x00\x00", "a", "a\x00", "abcdefgh", "abcdefgh\x00", "abcdefghi"]
    ids, _ = hash_sparse("f", pa.array(values), "string")
    assert len(set(ids.tolist())) == len(values)


# --- determinism -------------------------------------------------------------------

KNOWN: dict[tuple[str, str | int], int] = {
    # (field, value) -> id; fixed forever (ids are stored in tables and checkpoints).
    ("user", "alice"): ref_string_id("user", "alice"),
    ("C1", "68fd1e64"): ref_string_id("C1", "68fd1e64"),
    ("tags", "\u00e9t\u00e9 \u2603 long value over 8 bytes"): ref_string_id(
        "tags", "\u00e9t\u00e9 \u2603 long value over 8 bytes"
    ),
    ("item", 0): ref_int_id("item", 0),
    ("item", -1): ref_int_id("item", -1),
}
GOLDEN: dict[tuple[str, str | int], int] = {
    ("user", "alice"): 687862734065023273,
    ("C1", "68fd1e64"): 8309119386287833762,
    ("item", 0): 9291821631715783572,
}


def test_known_answers() -> None:
    for (field, value), want in GOLDEN.items():
        assert feature_id(field, value) == want == KNOWN[(field, value)]


@pytest.mark.processes
def test_same_ids_in_another_process() -> None:
    here = {f"{f}|{v!r}": feature_id(f, v) for f, v in KNOWN}
    script = (
        "import json, sys\n"
        "from pipeline.hashing import feature_id\n"
        "pairs = json.loads(sys.argv[1])\n"
        "print(json.dumps({f'{f}|{v!r}': feature_id(f, v) for f, v in pairs}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(list(KNOWN))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == here
    assert here == {f"{f}|{v!r}": want for (f, v), want in KNOWN.items()}


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "column"),
    [
        ("string", pa.array([1, 2])),
        ("string", pa.array([["a"]])),
        ("int", pa.array(["1"])),
        ("int", pa.array([True])),
        ("int", pa.array([1.0])),
        ("list_string", pa.array(["a"])),
        ("list_string", pa.array([[1]])),
        ("list_int", pa.array([["a"]])),
        ("list_int", pa.array([[1.5]])),
    ],
)
def test_wrong_type_names_field_and_type(kind: SparseKind, column: pa.Array) -> None:
    with pytest.raises(TypeError, match=rf"'my_field' is declared '{kind}'.*{column.type}"):
        hash_sparse("my_field", column, kind)
    with pytest.raises(TypeError, match="my_field"):
        hash_sparse("my_field", pa.chunked_array([column]), kind)


def test_feature_id_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="str or an int"):
        feature_id("f", True)
    with pytest.raises(TypeError, match="str or an int"):
        feature_id("f", 1.0)  # type: ignore[arg-type]


def test_field_hasher_writes_after_pos() -> None:
    h = FieldHasher("f", pa.array(["a", None, "b"]), "string")
    ids = np.zeros(h.bound + 2, dtype=np.uint64)
    lengths = np.empty(3, dtype=np.int32)
    assert h.into(ids, 2, lengths) == 4
    assert ids.tolist() == [0, 0, ref_string_id("f", "a"), ref_string_id("f", "b")]
    assert lengths.tolist() == [1, 0, 1]


def test_field_hasher_rejects_short_buffers() -> None:
    h = FieldHasher("f", pa.array(["a", "b"]), "string")
    lengths = np.empty(2, dtype=np.int32)
    with pytest.raises(ValueError, match="room for 2 ids from 1"):
        h.into(np.empty(2, dtype=np.uint64), 1, lengths)
    with pytest.raises(ValueError, match="room for 2 lengths"):
        h.into(np.empty(2, dtype=np.uint64), 0, lengths[:1])
    with pytest.raises(ValueError, match="needs uint64"):
        h.into(np.empty(2, dtype=np.int64), 0, lengths)
