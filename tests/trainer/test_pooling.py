"""``to_tensors``, ``pool`` and ``row_grads`` against per-bag Python loops.

The pooling oracle walks every sample and field and adds the rows of the ids
in its bag (in float64); the gradient oracle builds the same pooled vectors
with an explicit gather (``rows[inverse[start:end]]``) per bag and lets
autograd differentiate that.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.spec import FeatureSpec
from pipeline.batch import build_batch
from pipeline.types import TableBatch
from tests.trainer.pooling_case import MIXED, gather_grads, naive_pool, random_batch
from trainer.pooling import pool, pool_table, row_grads, to_tensors


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
