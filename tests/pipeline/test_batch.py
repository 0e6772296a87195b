"""``build_batch``, ``dense_matrix``, ``label_matrix`` and ``dedup`` against references.

The oracle is a per-record Python loop over ``table.to_pylist()``: dense values
through ``math``, sparse values through the reference hash of
``test_hashing``, bags laid out sample-major and deduplicated with a dict.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings

from connectors.spec import DenseField, FeatureSpec
from pipeline.batch import build_batch, dedup, dense_matrix, label_matrix
from pipeline.types import PreparedBatch
from tests.pipeline.hashing_reference import ref_record_ids, ref_string_id

# --- reference ---------------------------------------------------------------------


def ref_dedup(ids: list[int]) -> tuple[list[int], list[int]]:
    first: dict[int, int] = {}
    inverse = [first.setdefault(x, len(first)) for x in ids]
    return list(first), inverse


def ref_dense_value(d: DenseField, v: float | None) -> float:
    x = float(d.fill if v is None else v)  # type: ignore[arg-type]
    if d.transform == "log1p":
        x = math.log1p(x)
    elif d.transform == "signed_log1p":
        x = math.copysign(math.log1p(abs(x)), x)
    if d.clip_min is not None:
        x = max(x, d.clip_min)
    if d.clip_max is not None:
        x = min(x, d.clip_max)
    return x


def ref_batch(table: pa.Table, spec: FeatureSpec) -> dict[str, Any]:
    rows = table.to_pylist()
    out: dict[str, Any] = {
        "labels": [[float(r[name]) for name in spec.labels] for r in rows],
        "dense": [[ref_dense_value(d, r[d.name]) for d in spec.dense] for r in rows],
        "tables": {},
    }
    for name, fields in spec.tables().items():
        ids: list[int] = []
        offsets = [0]
        for r in rows:
            for f in fields:
                ids.extend(ref_record_ids(f, r[f], spec.field(f).type))
                offsets.append(len(ids))
        unique, inverse = ref_dedup(ids)
        out["tables"][name] = {"unique": unique, "inverse": inverse, "offsets": offsets}
    return out


def check_batch(table: pa.Table, spec: FeatureSpec) -> PreparedBatch:
    batch = build_batch(table, spec)
    want = ref_batch(table, spec)
    n, t, d = table.num_rows, len(spec.labels), len(spec.dense)
    assert len(batch) == n
    assert batch.labels.dtype == batch.dense.dtype == np.float32
    assert batch.labels.shape == (n, t)
    assert batch.dense.shape == (n, d)
    np.testing.assert_array_equal(batch.labels, np.array(want["labels"], np.float32).reshape(n, t))
    np.testing.assert_allclose(
        batch.dense, np.array(want["dense"], np.float32).reshape(n, d), rtol=1e-6, atol=1e-7
    )
    assert list(batch.tables) == list(spec.tables())
    for name, fields in spec.tables().items():
        tb = batch.tables[name]
        w = want["tables"][name]
        assert tb.fields == fields
        assert tb.pooling == tuple(spec.field(f).pooling for f in fields)
        assert tb.rows is None
        assert [a.dtype.name for a in (tb.unique_ids, tb.inverse, tb.offsets)] == [
            "uint64",
            "int32",
            "int32",
        ]
        assert tb.num_bags == n * len(fields)
        assert tb.offsets.tolist() == w["offsets"]
        assert tb.unique_ids.tolist() == w["unique"]
        assert tb.inverse.tolist() == w["inverse"]
    assert (batch.source, batch.partition, batch.start, batch.end) == ("", "", 0, 0)
    assert (batch.bad_records, batch.bad_by_reason) == (0, {})
    return batch


# --- dedup -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    ids=st.one_of(
        st.lists(st.integers(0, 20), max_size=300),
        st.lists(st.integers(0, (1 << 64) - 1), max_size=300),
        # Enough distinct ids to grow the map several times past its first size.
        st.integers(0, 5000).map(lambda n: [(i * 7919) % 3001 for i in range(n)]),
        st.lists(st.sampled_from([0, 1, (1 << 64) - 1, 1 << 32, 1 << 63]), max_size=50),
    )
)
def test_dedup_matches_np_unique(ids: list[int]) -> None:
    arr = np.array(ids, dtype=np.uint64)
    unique, inverse = dedup(arr)
    assert unique.dtype == np.uint64
    assert inverse.dtype == np.int32
    np.testing.assert_array_equal(unique[inverse], arr)
    np_unique, first = np.unique(arr, return_index=True)
    assert sorted(unique.tolist()) == np_unique.tolist()
    # First-appearance order: the order of the first occurrences, not of the values.
    assert unique.tolist() == arr[np.sort(first)].tolist()
    assert (unique.tolist(), inverse.tolist()) == ref_dedup(ids)


def test_dedup_accepts_array_likes_and_empty() -> None:
    unique, inverse = dedup([3, 3, 1])
    assert (unique.tolist(), inverse.tolist()) == ([3, 1], [0, 0, 1])
    unique, inverse = dedup(np.zeros(0, dtype=np.uint64))
    assert (unique.shape, inverse.shape) == ((0,), (0,))


# --- dense and labels --------------------------------------------------------------


def test_dense_fill_transform_clip() -> None:
    spec = FeatureSpec.model_validate(
        {
            "labels": ["y"],
            "dense": [
                {"name": "a", "fill": 2.0, "transform": "log1p"},
                {"name": "b", "fill": -5.0, "transform": "signed_log1p", "clip_max": 1.0},
                {"name": "c", "clip_min": 0.0, "clip_max": 10.0},
                {"name": "d"},
            ],
        }
    )
    table = pa.table(
        {
            "y": [1, 0, 1],
            "a": pa.array([0, None, 3], pa.int32()),
            "b": [None, -1.0, 100.0],
            "c": [-3.5, 4.0, 1e9],
            "d": pa.nulls(3),
        }
    )
    got = dense_matrix(table, spec)
    want = [
        [0.0, -math.log1p(5.0), 0.0, 0.0],
        [math.log1p(2.0), -math.log1p(1.0), 4.0, 0.0],
        [math.log1p(3.0), 1.0, 10.0, 0.0],
    ]
    np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-6)
    assert got.flags.c_contiguous


def test_dense_and_labels_read_every_numeric_type_and_chunks() -> None:
    spec = FeatureSpec.model_validate(
        {"labels": ["y"], "dense": [{"name": n} for n in ("i8", "u64", "f16", "f32", "b")]}
    )
    chunked = pa.chunked_array([pa.array([1, None], pa.int8()), pa.array([3], pa.int8())])
    table = pa.table(
        {
            "y": pa.chunked_array([pa.array([True]), pa.array([False, True])]),
            "i8": chunked,
            "u64": pa.array([0, 1 << 40, 5], pa.uint64()),
            "f16": pa.array(np.array([0.5, 1.5, -2.0], np.float16)),
            "f32": pa.array([0.25, None, -1.0], pa.float32()).slice(0),
            "b": pa.array([True, None, False]),
        }
    )
    check_batch(table, spec)
    np.testing.assert_array_equal(dense_matrix(table, spec)[:, 1], [0, 1 << 40, 5])


def test_missing_values_without_fill_or_label_are_errors() -> None:
    spec = FeatureSpec.model_validate({"labels": ["y"], "dense": [{"name": "x", "fill": None}]})
    with pytest.raises(ValueError, match="dense field 'x' is missing in 1 records"):
        dense_matrix(pa.table({"y": [1.0, 1.0], "x": [1.0, None]}), spec)
    with pytest.raises(ValueError, match="label field 'y' is missing in 1 records"):
        label_matrix(pa.table({"y": [1.0, None], "x": [1.0, 2.0]}), spec)


def test_non_numeric_dense_or_label_is_type_error() -> None:
    spec = FeatureSpec.model_validate({"labels": ["y"], "dense": [{"name": "x"}]})
    with pytest.raises(TypeError, match=r"dense field 'x' must be numeric.*string"):
        dense_matrix(pa.table({"y": [1.0], "x": ["1"]}), spec)
    with pytest.raises(TypeError, match="label field 'y' must be numeric"):
        label_matrix(pa.table({"y": ["1"], "x": [1.0]}), spec)


def test_missing_column_names_the_field() -> None:
    spec = FeatureSpec.model_validate(
        {"labels": ["y"], "sparse": [{"name": "user", "table": "users"}]}
    )
    with pytest.raises(KeyError, match="sparse field 'user' is not a column"):
        build_batch(pa.table({"y": [1.0]}), spec)
    with pytest.raises(KeyError, match="label field 'y' is not a column"):
        build_batch(pa.table({"user": ["u"]}), spec)
    twice = pa.table([pa.array([1.0]), pa.array(["u"]), pa.array(["v"])], ["y", "user", "user"])
    with pytest.raises(KeyError, match="sparse field 'user' is twice in the batch"):
        build_batch(twice, spec)


# --- build_batch -------------------------------------------------------------------


def test_two_fields_feed_one_table_sample_major() -> None:
    spec = FeatureSpec.model_validate(
        {
            "labels": ["y"],
            "sparse": [
                {"name": "hist", "table": "items", "type": "list_string", "pooling": "mean"},
                {"name": "user", "table": "users"},
                {"name": "item", "table": "items"},
            ],
        }
    )
    table = pa.table(
        {
            "y": [1.0, 0.0, 1.0],
            "hist": [["i1", "i2"], None, ["i2"]],
            "user": ["u1", "u2", "u1"],
            "item": ["i1", "i3", None],
        }
    )
    batch = check_batch(table, spec)
    items = batch.tables["items"]
    assert items.fields == ("hist", "item")
    assert items.pooling == ("mean", "sum")
    # bag b*2+f: sample 0 (hist: 2, item: 1), sample 1 (0, 1), sample 2 (1, 0)
    assert items.offsets.tolist() == [0, 2, 3, 3, 4, 5, 5]
    bag_ids = items.unique_ids[items.inverse].tolist()
    assert bag_ids == [
        ref_string_id("hist", "i1"),
        ref_string_id("hist", "i2"),
        ref_string_id("item", "i1"),
        ref_string_id("item", "i3"),
        ref_string_id("hist", "i2"),
    ]
    # "i1" in hist and in item are different ids; "i2" twice in hist is one.
    assert len(items.unique_ids) == 4
    assert items.inverse.tolist() == [0, 1, 2, 3, 1]
    assert batch.tables["users"].inverse.tolist() == [0, 1, 0]
    pooled = np.add.reduceat(np.ones(5), items.offsets[:-1][np.diff(items.offsets) > 0])
    assert pooled.tolist() == [2.0, 1.0, 1.0, 1.0]


def test_empty_table() -> None:
    spec = FeatureSpec.model_validate(
        {
            "labels": ["y"],
            "dense": [{"name": "x"}],
            "sparse": [{"name": "u", "table": "t"}, {"name": "v", "table": "t", "type": "int"}],
        }
    )
    types = {"y": pa.float64(), "x": pa.float64(), "u": pa.string(), "v": pa.int64()}
    table = pa.table({name: pa.array([], typ) for name, typ in types.items()})
    batch = check_batch(table, spec)
    assert batch.tables["t"].offsets.tolist() == [0]
    assert batch.dense.shape == (0, 1)


def test_wrong_sparse_type_names_the_field() -> None:
    spec = FeatureSpec.model_validate(
        {"labels": ["y"], "sparse": [{"name": "user_id", "table": "u", "type": "int"}]}
    )
    with pytest.raises(TypeError, match=r"'user_id' is declared 'int'.*string"):
        build_batch(pa.table({"y": [1.0], "user_id": ["7"]}), spec)


SPARSE_TYPES = {
    "string": [pa.string(), pa.large_string()],
    "int": [pa.int64(), pa.int32(), pa.uint16()],
    "list_string": [pa.list_(pa.string()), pa.large_list(pa.large_string())],
    "list_int": [pa.list_(pa.int64()), pa.large_list(pa.int8())],
}
SPARSE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "string": st.none() | st.sampled_from(["a", "b", "", "12", "\u00fcber", "z" * 9]) | st.text(),
    "int": st.none() | st.integers(0, 12),
    "list_string": st.none()
    | st.lists(st.none() | st.sampled_from(["a", "12", "\u2603"]), max_size=4),
    "list_int": st.none() | st.lists(st.none() | st.integers(0, 12), max_size=4),
}
DENSE_VALUES = st.none() | st.floats(0.0, 1e6) | st.integers(0, 1000)


def chunked(draw: st.DrawFn, values: list[Any], typ: pa.DataType) -> pa.ChunkedArray:
    """``values`` as a column cut into random chunks, some of them slices of a larger array."""
    pad = draw(st.integers(0, 2))
    arr = pa.array([None] * pad + values, typ).slice(pad)
    cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=3)))
    bounds = [0, *cuts, len(values)]
    return pa.chunked_array([arr.slice(a, b - a) for a, b in itertools.pairwise(bounds)], typ)


@st.composite
def specs_and_tables(draw: st.DrawFn) -> tuple[FeatureSpec, pa.Table]:
    n = draw(st.integers(0, 30))
    n_sparse = draw(st.integers(0, 5))
    n_tables = draw(st.integers(1, 3))
    sparse: list[dict[str, Any]] = [
        {
            "name": f"s{i}",
            "table": f"t{draw(st.integers(0, n_tables - 1))}",
            "type": draw(st.sampled_from(list(SPARSE_TYPES))),
            "pooling": draw(st.sampled_from(["sum", "mean"])),
        }
        for i in range(n_sparse)
    ]
    dense: list[dict[str, Any]] = [
        {
            "name": f"d{i}",
            "fill": draw(st.sampled_from([0.0, 1.5])),
            "transform": draw(st.sampled_from(["none", "log1p", "signed_log1p"])),
            "clip_min": draw(st.none() | st.floats(0.0, 2.0)),
            "clip_max": draw(st.none() | st.floats(3.0, 100.0)),
        }
        for i in range(draw(st.integers(0, 3)))
    ]
    spec = FeatureSpec.model_validate({"labels": ["y", "y2"], "dense": dense, "sparse": sparse})
    labels = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    counts = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    columns = {"y": chunked(draw, labels, pa.float64()), "y2": chunked(draw, counts, pa.int32())}
    for d in dense:
        values = [
            None if v is None else float(v)
            for v in draw(st.lists(DENSE_VALUES, min_size=n, max_size=n))
        ]
        typ = draw(st.sampled_from([pa.float64(), pa.float32()]))
        columns[d["name"]] = chunked(draw, values, typ)
    for s in sparse:
        values = draw(st.lists(SPARSE_VALUES[s["type"]], min_size=n, max_size=n))
        columns[s["name"]] = chunked(draw, values, draw(st.sampled_from(SPARSE_TYPES[s["type"]])))
    names = list(columns)
    order = draw(st.permutations(names))  # column order must not matter
    return spec, pa.table({k: columns[k] for k in order})


@settings(max_examples=150, deadline=None)
@given(case=specs_and_tables())
def test_build_batch_matches_reference(case: tuple[FeatureSpec, pa.Table]) -> None:
    spec, table = case
    check_batch(table, spec)
