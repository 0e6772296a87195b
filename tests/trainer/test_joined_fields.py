"""``JoinedFields`` (the trainer's CPU pooling) against the per-bag oracles and ``pool``.

Both of its paths: one id per bag with one dim for every field (one gather over
all the tables' rows) and any other batch (a kernel per table, multi-hot bags,
sum and mean, empty bags, fields of a table interleaved in the spec).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trainer.pooling_case import MIXED, Layout, gather_grads, naive_pool, random_batch
from trainer.config import DCNv2Config, DLRMConfig, FFNNConfig
from trainer.joined_fields import JoinedFields
from trainer.models import build_model
from trainer.pooling import pool, to_tensors

# One dim for every table: a batch of one id per bag takes the one-gather path.
SAME_DIM = Layout(fields=MIXED.fields, dims={"a": 4, "b": 4, "c": 4})


def check_against_oracles(layout: Layout, batch_size: int, seed: int, **kw: object) -> None:
    spec = layout.spec()
    batch = random_batch(layout, batch_size, seed, **kw)  # type: ignore[arg-type]
    joined = JoinedFields(batch, spec)
    x = joined.tensor()
    dims = [layout.dims[s.table] for s in spec.sparse]
    assert tuple(x.shape) == (batch_size, sum(dims))
    want = np.concatenate(naive_pool(batch, spec), axis=1)
    np.testing.assert_allclose(x.detach().numpy(), want, rtol=1e-5, atol=1e-6)
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(batch_size, sum(dims), generator=gen)
    (x * upstream).sum().backward()
    oracle = gather_grads(batch, spec, list(torch.split(upstream, dims, dim=1)))
    got = joined.row_grads()
    assert got.keys() == oracle.keys()
    for name, g in got.items():
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, oracle[name], rtol=1e-5, atol=1e-5, err_msg=name)


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), max_len=st.integers(0, 5))
def test_multi_hot_bags_pool_and_differentiate_as_the_oracles(
    batch_size: int, seed: int, max_len: int
) -> None:
    check_against_oracles(MIXED, batch_size, seed, max_len=max_len)


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_one_id_per_bag_pools_and_differentiates_as_the_oracles(batch_size: int, seed: int) -> None:
    check_against_oracles(SAME_DIM, batch_size, seed, min_len=1, max_len=1)
    # Unequal dims or float16 rows too.
    check_against_oracles(MIXED, batch_size, seed, min_len=1, max_len=1)
    check_against_oracles(SAME_DIM, batch_size, seed, min_len=1, max_len=1, row_dtype=np.float16)


@pytest.mark.parametrize("row_dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("layout", "one_id"), [(SAME_DIM, True), (MIXED, False)])
def test_equals_the_general_path_exactly_for_one_id_bags(
    row_dtype: type[np.floating], layout: Layout, one_id: bool
) -> None:
    # One id per bag is a copy of a widened row on either path: equal to the bit.
    spec = layout.spec()
    batch = random_batch(layout, 64, 3, min_len=1, max_len=1, row_dtype=row_dtype)
    joined = JoinedFields(batch, spec)
    assert (joined._one_id is not None) == one_id  # which path this case takes
    bt = to_tensors(batch, spec)
    general = torch.cat(pool(bt, spec), dim=1)
    x = joined.tensor()
    assert torch.equal(x.detach(), general.detach())
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    (x * upstream).sum().backward()
    (general * upstream).sum().backward()
    for name, g in joined.row_grads().items():
        want = bt.tables[name].rows.grad
        assert want is not None
        np.testing.assert_allclose(g, want.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)


def test_row_grads_before_a_backward_are_zeros_and_gradients_add_up() -> None:
    spec = SAME_DIM.spec()
    batch = random_batch(SAME_DIM, 8, 1, min_len=1, max_len=1)
    joined = JoinedFields(batch, spec)
    for name, g in joined.row_grads().items():
        rows = batch.tables[name].rows
        assert rows is not None
        assert g.shape == rows.shape
        assert not g.any()
    x = joined.tensor()
    x.sum().backward()
    once = {n: g.copy() for n, g in joined.row_grads().items()}
    joined.tensor().sum().backward()  # a second backward adds, as a leaf's .grad does
    for name, g in joined.row_grads().items():
        np.testing.assert_allclose(g, 2 * once[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "config",
    [FFNNConfig(hidden=[8]), DLRMConfig(bottom=[8], top=[8]), DCNv2Config(cross_layers=1)],
    ids=["ffnn", "dlrm", "dcnv2"],
)
def test_models_forward_joined_equals_forward(config: object) -> None:
    spec = SAME_DIM.spec()
    batch = random_batch(SAME_DIM, 16, 2, min_len=1, max_len=1)
    torch.manual_seed(0)
    model = build_model(config, num_dense=1, field_dims=[4] * 5, num_tasks=2)  # type: ignore[arg-type]
    bt = to_tensors(batch, spec)
    joined = JoinedFields(batch, spec).tensor()
    torch.testing.assert_close(
        model.forward_joined(bt.dense, joined), model(bt.dense, pool(bt, spec))
    )
    with pytest.raises(ValueError, match="expected 1 dense features and 20 columns"):
        model.forward_joined(bt.dense, joined[:, 1:])


def test_inconsistent_batches_are_refused_with_the_general_path_errors() -> None:
    spec = MIXED.spec()
    batch = random_batch(MIXED, 2, 0)
    batch.tables["a"].rows = None
    with pytest.raises(ValueError, match="'a' has no rows"):
        JoinedFields(batch, spec)
    batch = random_batch(MIXED, 2, 0)
    del batch.tables["b"]
    with pytest.raises(ValueError, match="no table 'b'"):
        JoinedFields(batch, spec)
    batch = random_batch(MIXED, 3, 0)
    batch.tables["c"].offsets = batch.tables["c"].offsets[:-1]
    with pytest.raises(ValueError, match=r"table 'c': offsets has 3 entries; 3 samples x 1"):
        JoinedFields(batch, spec)
