"""``to_tensors``, ``pool`` and ``row_grads`` against per-bag Python loops.

The pooling oracle walks every sample and field and adds the rows of the ids
in its bag (in float64); the gradient oracle builds the same pooled vectors
with an explicit gather (``rows[inverse[start:end]]``) per bag and lets
autograd differentiate that.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.spec import FeatureSpec
from pipeline.batch import build_batch
from pipeline.types import PreparedBatch, TableBatch
from trainer.pooling import pool, pool_table, row_grads, to_tensors


@dataclass(frozen=True)
class Layout:
    """Which fields feed which table (in spec order) and how they pool."""

    fields: tuple[tuple[str, str, str], ...]  # (field, table, pooling)
    dims: dict[str, int]

    def spec(self) -> FeatureSpec:
        return FeatureSpec.model_validate(
            {
                "labels": ["y", "z"],
                "dense": [{"name": "d0"}],
                "sparse": [
                    {"name": f, "table": t, "type": "list_int", "pooling": p}
                    for f, t, p in self.fields
                ],
            }
        )


# Fields of two tables interleave in the spec, so spec order differs from table order.
MIXED = Layout(
    fields=(
        ("f_sum", "a", "sum"),
        ("g_mean", "b", "mean"),
        ("f_mean", "a", "mean"),
        ("g_sum", "b", "sum"),
        ("h", "c", "mean"),
    ),
    dims={"a": 3, "b": 5, "c": 2},
)


def random_batch(
    layout: Layout,
    batch_size: int,
    seed: int,
    *,
    max_len: int = 4,
    min_len: int = 0,
    vocab: int = 6,
    row_dtype: type[np.floating] = np.float32,
) -> PreparedBatch:
    """A batch with multi-hot bags (repeats inside and across bags, empty bags) and rows."""
    rng = np.random.default_rng(seed)
    spec = layout.spec()
    tables: dict[str, TableBatch] = {}
    for name, fields in spec.tables().items():
        bags = [
            rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist()
            for _ in range(batch_size * len(fields))
        ]
        first: dict[int, int] = {}
        inverse = [first.setdefault(x, len(first)) for bag in bags for x in bag]
        offsets = np.cumsum([0, *map(len, bags)])
        tables[name] = TableBatch(
            fields=fields,
            unique_ids=np.array([1000 + x for x in first], dtype=np.uint64),
            inverse=np.array(inverse, dtype=np.int32),
            offsets=offsets.astype(np.int32),
            rows=rng.normal(size=(len(first), layout.dims[name])).astype(row_dtype),
            pooling=tuple(spec.field(f).pooling for f in fields),
        )
    return PreparedBatch(
        labels=rng.integers(0, 2, size=(batch_size, 2)).astype(np.float32),
        dense=rng.normal(size=(batch_size, 1)).astype(np.float32),
        tables=tables,
    )


def naive_pool(batch: PreparedBatch, spec: FeatureSpec) -> list[npt.NDArray[np.float64]]:
    """Per field (spec order), per sample: sum or mean of the rows of the bag's ids."""
    out = []
    for s in spec.sparse:
        tb = batch.tables[s.table]
        assert tb.rows is not None
        f = tb.fields.index(s.name)
        nf = len(tb.fields)
        pooled = np.zeros((len(batch), tb.rows.shape[1]))
        for b in range(len(batch)):
            bag = b * nf + f
            ids = tb.inverse[tb.offsets[bag] : tb.offsets[bag + 1]]
            for i in ids:
                pooled[b] += tb.rows[i].astype(np.float64)
            if s.pooling == "mean" and len(ids):
                pooled[b] /= len(ids)
        out.append(pooled)
    return out


def gather_grads(
    batch: PreparedBatch, spec: FeatureSpec, upstream: list[torch.Tensor]
) -> dict[str, npt.NDArray[np.float32]]:
    """Row gradients of sum(pooled_f * upstream_f) through an explicit per-bag gather."""
    leaves = {
        name: torch.tensor(tb.rows, dtype=torch.float32, requires_grad=True)
        for name, tb in batch.tables.items()
    }
    loss = torch.zeros(())
    for s, up in zip(spec.sparse, upstream, strict=True):
        tb = batch.tables[s.table]
        f, nf = tb.fields.index(s.name), len(tb.fields)
        rows = leaves[s.table]
        pooled = []
        for b in range(len(batch)):
            bag = b * nf + f
            idx = torch.from_numpy(
                tb.inverse[tb.offsets[bag] : tb.offsets[bag + 1]].astype(np.int64)
            )
            v = rows[idx].sum(0)
            if s.pooling == "mean" and len(idx):
                v = v / len(idx)
            pooled.append(v)
        loss = loss + (torch.stack(pooled) * up).sum()
    torch.autograd.backward(loss)
    return {
        name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).numpy()
        for name, leaf in leaves.items()
    }


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), max_len=st.integers(0, 5))
def test_pool_matches_naive_loop(batch_size: int, seed: int, max_len: int) -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, batch_size, seed, max_len=max_len)
    bt = to_tensors(batch, spec)
    got = pool(bt, spec)
    want = naive_pool(batch, spec)
    assert len(got) == len(spec.sparse)
    for s, g, w in zip(spec.sparse, got, want, strict=True):
        assert g.shape == (batch_size, MIXED.dims[s.table]), s.name
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-5, atol=1e-6, err_msg=s.name)


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_row_grads_match_autograd_through_explicit_gather(batch_size: int, seed: int) -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, batch_size, seed)
    gen = torch.Generator().manual_seed(seed)
    upstream = [
        torch.randn(batch_size, MIXED.dims[s.table], generator=gen, dtype=torch.float32)
        for s in spec.sparse
    ]
    bt = to_tensors(batch, spec)
    loss = sum(
        ((p * u).sum() for p, u in zip(pool(bt, spec), upstream, strict=True)), torch.zeros(())
    )
    torch.autograd.backward(loss)
    got = row_grads(bt)
    want = gather_grads(batch, spec, upstream)
    assert set(got) == set(want) == {"a", "b", "c"}
    for name in got:
        tb = batch.tables[name]
        assert got[name].dtype == np.float32
        assert got[name].shape == (tb.unique_ids.shape[0], MIXED.dims[name])
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@settings(max_examples=25, deadline=None)
@given(batch_size=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_one_id_per_bag_pools_and_differentiates_as_the_general_path(
    batch_size: int, seed: int
) -> None:
    # One categorical value per field takes the gather path (no embedding_bag).
    spec = MIXED.spec()
    batch = random_batch(MIXED, batch_size, seed, min_len=1, max_len=1)
    bt = to_tensors(batch, spec)
    assert all(t.one_per_bag for t in bt.tables.values())
    gen = torch.Generator().manual_seed(seed)
    upstream = [
        torch.randn(batch_size, MIXED.dims[s.table], generator=gen, dtype=torch.float32)
        for s in spec.sparse
    ]
    pooled = pool(bt, spec)
    for g, w in zip(pooled, naive_pool(batch, spec), strict=True):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-5, atol=1e-6)
    loss = sum(((p * u).sum() for p, u in zip(pooled, upstream, strict=True)), torch.zeros(()))
    torch.autograd.backward(loss)
    want = gather_grads(batch, spec, upstream)
    for name, got in row_grads(bt).items():
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # A bag of two ids (and so an empty one) anywhere takes the general path.
    multi = random_batch(MIXED, batch_size, seed, min_len=0, max_len=2)
    flags = {n: t.one_per_bag for n, t in to_tensors(multi, spec).tables.items()}
    for name, tb in multi.tables.items():
        assert flags[name] == bool(np.all(np.diff(tb.offsets) == 1)), name


def test_known_values_sum_mean_empty_and_repeats() -> None:
    # Sample 0: a=[r0, r0, r1] (repeat inside a bag), b=[] (empty). Sample 1: a=[r1], b=[r0].
    w = torch.tensor([[1.0, 2.0], [10.0, 20.0]], requires_grad=True)
    inverse = torch.tensor([0, 0, 1, 1, 0])
    offsets = torch.tensor([0, 3, 3, 4, 5])
    out = pool_table(w, inverse, offsets, ["sum", "mean"], 2)
    assert out.tolist() == [[[12.0, 24.0], [0.0, 0.0]], [[10.0, 20.0], [1.0, 2.0]]]
    mean_first = pool_table(w, inverse, offsets, ["mean", "sum"], 2)
    assert mean_first[0, 0].tolist() == [4.0, 8.0]
    torch.autograd.backward(out.sum())
    assert w.grad is not None
    # Row 0: twice in a summed bag, once in a mean bag of one; row 1: twice summed.
    assert w.grad.tolist() == [[3.0, 3.0], [2.0, 2.0]]


def test_pool_of_a_real_batch_from_build_batch() -> None:
    spec = FeatureSpec.model_validate(
        {
            "labels": ["y"],
            "sparse": [
                {"name": "tags", "table": "t", "type": "list_int", "pooling": "mean"},
                {"name": "user", "table": "t", "type": "int"},
                {"name": "item", "table": "i", "type": "string"},
            ],
        }
    )
    table = pa.table(
        {
            "y": [1.0, 0.0, 1.0],
            "tags": [[5, 6, 5], None, [7]],
            "user": pa.array([5, None, 9], pa.int64()),
            "item": ["x", "y", "x"],
        }
    )
    batch = build_batch(table, spec)
    rng = np.random.default_rng(0)
    for tb in batch.tables.values():
        tb.rows = rng.normal(size=(tb.unique_ids.shape[0], 4)).astype(np.float32)
    got = pool(to_tensors(batch, spec), spec)
    for g, w in zip(got, naive_pool(batch, spec), strict=True):
        np.testing.assert_allclose(g.detach().numpy(), w, rtol=1e-6, atol=1e-6)
    # Sample 1 has no tags and no user: empty bags pool to zeros, in both modes.
    assert got[0][1].abs().sum().item() == got[1][1].abs().sum().item() == 0.0
    # The same item in samples 0 and 2 pools to the same row.
    assert torch.equal(got[2][0], got[2][2])


def test_to_tensors_dtypes_leaves_and_float16_rows() -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, 4, 0, row_dtype=np.float16)
    batch.labels.flags.writeable = False  # as arrays arrive from a Dask message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it would share a read-only array
        bt = to_tensors(batch, spec)
    assert bt.batch_size == 4
    assert bt.labels.dtype == bt.dense.dtype == torch.float32
    assert bt.labels.shape == (4, 2)
    assert bt.dense.shape == (4, 1)
    assert list(bt.tables) == ["a", "b", "c"]
    for name, t in bt.tables.items():
        tb = batch.tables[name]
        assert tb.rows is not None
        assert t.rows.dtype == torch.float32
        assert t.rows.requires_grad
        assert t.rows.is_leaf
        assert t.inverse.dtype == t.offsets.dtype == torch.int64
        np.testing.assert_array_equal(t.rows.detach().numpy(), tb.rows.astype(np.float32))
        np.testing.assert_array_equal(t.offsets.numpy(), tb.offsets)
        assert t.fields == tb.fields
        assert t.pooling == tuple(spec.field(f).pooling for f in tb.fields)


def test_row_grads_zero_for_tables_without_gradient_and_without_ids() -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, 3, 1)
    # Table c: every bag empty, so no rows at all.
    batch.tables["c"] = TableBatch(
        fields=("h",),
        unique_ids=np.zeros(0, np.uint64),
        inverse=np.zeros(0, np.int32),
        offsets=np.zeros(4, np.int32),
        rows=np.zeros((0, 2), np.float32),
        pooling=("mean",),
    )
    bt = to_tensors(batch, spec)
    pooled = pool(bt, spec)
    assert pooled[4].tolist() == [[0.0, 0.0]] * 3
    torch.autograd.backward(pooled[0].sum())  # only field f_sum (table a) gets a gradient
    grads = row_grads(bt)
    assert np.abs(grads["a"]).sum() > 0
    assert grads["b"].shape == (batch.tables["b"].unique_ids.shape[0], 5)
    assert not grads["b"].any()
    assert grads["c"].shape == (0, 2)


def test_to_tensors_rejects_inconsistent_batches() -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, 2, 0)
    batch.tables["a"].rows = None
    with pytest.raises(ValueError, match="'a' has no rows"):
        to_tensors(batch, spec)
    batch = random_batch(MIXED, 2, 0)
    del batch.tables["b"]
    with pytest.raises(ValueError, match="no table 'b'"):
        to_tensors(batch, spec)
    batch = random_batch(MIXED, 2, 0)
    batch.tables["a"].pooling = ("mean", "mean")
    with pytest.raises(ValueError, match="pooling"):
        to_tensors(batch, spec)
    batch = random_batch(MIXED, 2, 0)
    rows = batch.tables["a"].rows
    assert rows is not None
    batch.tables["a"].rows = rows[1:]
    with pytest.raises(ValueError, match="rows of shape"):
        to_tensors(batch, spec)


def test_pool_table_rejects_bad_offsets_and_modes() -> None:
    w = torch.ones(2, 2)
    with pytest.raises(ValueError, match="need 5"):
        pool_table(w, torch.tensor([0]), torch.tensor([0, 1]), ["sum", "sum"], 2)
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        pool_table(w, torch.tensor([0]), torch.tensor([0, 1]), ["max"], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_tensors_on_cuda_with_pinned_non_blocking_copies() -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, 8, 3, row_dtype=np.float16)
    cpu = to_tensors(batch, spec)
    gpu = to_tensors(batch, spec, device="cuda", non_blocking=True, pin_memory=True)
    assert gpu.labels.is_cuda
    assert all(t.rows.is_cuda and t.rows.is_leaf for t in gpu.tables.values())
    loss_cpu = sum((p.sum() for p in pool(cpu, spec)), torch.zeros(()))
    loss_gpu = sum((p.sum() for p in pool(gpu, spec)), torch.zeros((), device="cuda"))
    torch.autograd.backward(loss_cpu)
    torch.autograd.backward(loss_gpu)
    for name, g in row_grads(gpu).items():
        np.testing.assert_allclose(g, row_grads(cpu)[name], rtol=1e-5, atol=1e-6)
