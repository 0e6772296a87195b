"""The single-process PyTorch reference against the embedding store.

Two levels:

- the row optimizers and initializers: the reference's torch code and the
  store's numba kernels give bit-identical rows for every optimizer option;
- whole training: lookup rows from an in-process store, pool, backward, push
  row gradients (``staleness: 0``) gives the losses, rows and dense weights of
  ``ReferenceModel`` (one nn.EmbeddingBag-style weight per table with sparse
  gradients), step by step, to float tolerance. Not bit for bit: autograd sums
  the gradients of a repeated id in an order that depends on the row numbers,
  which differ between the batch-local rows and the reference's table rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pytest
import torch
from torch import nn

from connectors.spec import FeatureSpec
from connectors.synthetic import SyntheticConfig, SyntheticSource
from embedding_store.client import StoreClient
from embedding_store.table import EmbeddingTable
from embedding_store.types import StoreConfig, TableConfig
from pipeline.batch import build_batch
from pipeline.types import PreparedBatch
from trainer.models import FFNNConfig, build_model, field_dims, loss_fn
from trainer.pooling import pool, row_grads, to_tensors
from trainer.reference import ReferenceEmbeddings, ReferenceModel

F32 = npt.NDArray[np.float32]

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"kind": "sgd", "lr": 0.3},
    "sgd-momentum": {"kind": "sgd", "lr": 0.3, "momentum": 0.9, "dampening": 0.1},
    "sgd-nesterov-wd": {"kind": "sgd", "lr": 0.3, "momentum": 0.8, "nesterov": True,
                        "weight_decay": 0.01},
    "adagrad": {"kind": "adagrad", "lr": 0.1},
    "adagrad-options": {"kind": "adagrad", "lr": 0.1, "lr_decay": 0.1, "weight_decay": 0.02,
                        "initial_accumulator_value": 0.1, "eps": 1e-6},
    "adagrad-rowwise": {"kind": "adagrad", "lr": 0.1, "rowwise": True},
    "adagrad-rowwise-options": {"kind": "adagrad", "lr": 0.1, "rowwise": True, "lr_decay": 0.1,
                                "weight_decay": 0.02, "initial_accumulator_value": 0.1},
    "adam": {"kind": "adam", "lr": 0.01, "weight_decay": 0.1},
    "adamw": {"kind": "adam", "lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True,
              "beta1": 0.8, "beta2": 0.99},
    "ftrl": {"kind": "ftrl", "alpha": 0.1},
    "ftrl-options": {"kind": "ftrl", "alpha": 0.1, "beta": 0.5, "l1": 0.05, "l2": 0.1,
                     "initial_accumulator_value": 0.2},
}  # fmt: skip


# --- row optimizers and initializers, bit for bit -----------------------------------


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_row_updates_equal_the_store_bit_for_bit(name: str, clip: float | None) -> None:
    cfg = TableConfig(
        dim=7,
        optimizer=OPTIMIZERS[name],
        initializer={"kind": "normal", "std": 0.1},
        weight_clip=clip,
    )
    store = EmbeddingTable("t", cfg)
    ref = ReferenceEmbeddings({"t": cfg})
    rng = np.random.default_rng(0)
    universe = np.arange(1, 40, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for step in range(25):
        ids = rng.choice(universe, size=int(rng.integers(1, 30)), replace=False)
        np.testing.assert_array_equal(ref.rows("t", ids, create=True), store.lookup(ids))
        # Gradient scales from tiny to large, and now and then a row with a NaN.
        grads = (rng.normal(size=(ids.shape[0], 7)) * rng.choice([1e-4, 1.0, 10.0])).astype(
            np.float32
        )
        if step % 5 == 4:
            grads[0, 3] = np.nan
        store.push(ids, grads)
        ref.apply("t", ids, grads)
    final = store.lookup(universe, train=False)
    np.testing.assert_array_equal(ref.rows("t", universe), final)
    assert not np.array_equal(
        final, ReferenceEmbeddings({"t": cfg}).rows("t", universe, create=True)
    )


@pytest.mark.parametrize(
    "initializer",
    [
        {"kind": "uniform", "scale": 0.05},
        {"kind": "normal", "mean": 0.3, "std": 0.2},
        {"kind": "zeros"},
    ],
)
@pytest.mark.parametrize("seed", [0, 12345])
def test_initial_rows_equal_the_store(initializer: dict[str, Any], seed: int) -> None:
    cfg = TableConfig(dim=5, initializer=initializer, seed=seed)
    ids = np.array([0, 1, 2**63, 2**64 - 1, 987654321], dtype=np.uint64)
    ref = ReferenceEmbeddings({"users": cfg, "items": cfg})
    users = ref.rows("users", ids, create=True)
    np.testing.assert_array_equal(users, EmbeddingTable("users", cfg).lookup(ids))
    if initializer["kind"] != "zeros":
        # Rows depend on the table's name and seed, not only on the id.
        assert not np.array_equal(users, ref.rows("items", ids, create=True))
        other = ReferenceEmbeddings({"users": cfg.model_copy(update={"seed": seed + 1})})
        assert not np.array_equal(users, other.rows("users", ids, create=True))


# --- whole training -------------------------------------------------------------------

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["click", "click_next"],
        "dense": [{"name": f"I{i}", "transform": "log1p", "min_value": 0} for i in (1, 2, 3)],
        "sparse": [
            {"name": "C1", "table": "a"},
            {"name": "C3", "table": "b"},
            {"name": "C2", "table": "a", "pooling": "mean"},
            {"name": "tags", "table": "b", "type": "list_string", "pooling": "mean"},
        ],
    }
)
BATCHES = 6
BATCH_SIZE = 64


def make_batches() -> list[PreparedBatch]:
    """Synthetic events over small vocabularies, so ids recur across batches.

    ``tags`` is a multi-hot field made of C4 and C5 values: bags of 0 to 3 ids,
    with repeats inside a bag. ``click_next`` is a second task.
    """
    src = SyntheticSource(SyntheticConfig(seed=3, cardinalities=(25,) * 26))
    out = []
    for k in range(BATCHES):
        records = src.records(0, k * BATCH_SIZE, BATCH_SIZE)
        rng = np.random.default_rng(k)
        c4, c5 = records["C4"].to_pylist(), records["C5"].to_pylist()
        tags = [[c4[i], c5[i], c4[i]][: int(rng.integers(0, 4))] for i in range(len(c4))]
        clicks = records["click"].to_numpy()
        records = records.append_column("tags", pa.array(tags, pa.list_(pa.string())))
        records = records.append_column("click_next", pa.array(np.roll(clicks, 1)))
        out.append(build_batch(records, SPEC))
    return out


def table_configs(optimizer: dict[str, Any]) -> dict[str, TableConfig]:
    return {
        "a": TableConfig(dim=4, optimizer=optimizer, initializer={"kind": "normal", "std": 0.1}),
        "b": TableConfig(dim=6, optimizer=optimizer, initializer={"kind": "uniform", "scale": 0.1}),
    }


def dense_model(tables: dict[str, TableConfig]) -> nn.Module:
    torch.manual_seed(0)
    dims = field_dims(SPEC, {name: cfg.dim for name, cfg in tables.items()})
    return build_model(FFNNConfig(hidden=[16, 8]), num_dense=3, field_dims=dims, num_tasks=2)


@dataclass
class Run:
    losses: list[float]
    logits: list[F32]
    model: nn.Module
    rows: dict[str, F32]  # final rows of every id seen, per table (sorted ids)


def seen_ids(batches: list[PreparedBatch]) -> dict[str, npt.NDArray[np.uint64]]:
    return {
        name: np.unique(np.concatenate([b.tables[name].unique_ids for b in batches]))
        for name in SPEC.tables()
    }


def store_backed_run(
    batches: list[PreparedBatch], tables: dict[str, TableConfig], address: str
) -> Run:
    """Synchronous store-backed training: lookup, pool, backward, push, per batch."""
    model = dense_model(tables)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, logits = [], []
    config = StoreConfig(tables=tables, row_dtype="float32")
    with StoreClient.connect(address, config=config) as store:
        for batch in copy.deepcopy(batches):
            rows = store.lookup({n: t.unique_ids for n, t in batch.tables.items()}, train=True)
            for name, t in batch.tables.items():
                t.rows = rows[name]
            bt = to_tensors(batch, SPEC)
            out = model(bt.dense, pool(bt, SPEC))
            loss = loss_fn(out, bt.labels)
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()
            grads = row_grads(bt)
            result = store.push({n: (t.unique_ids, grads[n]) for n, t in batch.tables.items()})
            assert result.applied == sum(t.unique_ids.shape[0] for t in batch.tables.values())
            losses.append(float(loss.detach()))
            logits.append(out.detach().numpy())
        ids = seen_ids(batches)
        final = store.lookup(ids, train=False)
    return Run(losses, logits, model, final)


def reference_run(batches: list[PreparedBatch], tables: dict[str, TableConfig]) -> Run:
    ref = ReferenceModel(SPEC, tables, dense_model(tables))
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    losses, logits = [], []
    for batch in batches:
        step = ref.train_step(batch, opt)
        losses.append(step.loss)
        logits.append(step.logits.numpy())
    ids = seen_ids(batches)
    rows = {name: ref.embeddings.rows(name, ids[name]) for name in ids}
    return Run(losses, logits, ref.dense, rows)


def assert_same_training(got: Run, want: Run) -> None:
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6)
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"logits of batch {step}")
    for name in want.rows:
        np.testing.assert_allclose(got.rows[name], want.rows[name], rtol=1e-5, atol=1e-7)
    for (pname, g_p), w_p in zip(
        got.model.named_parameters(), want.model.parameters(), strict=True
    ):
        torch.testing.assert_close(g_p, w_p, rtol=1e-5, atol=1e-7, msg=pname)


@pytest.fixture(scope="module")
def batches() -> list[PreparedBatch]:
    out = make_batches()
    # The point of the test: ids come back in later batches, with the gradients of
    # earlier ones applied; and some bags are empty or hold an id twice.
    for name in SPEC.tables():
        first = set(out[0].tables[name].unique_ids.tolist())
        assert any(first & set(b.tables[name].unique_ids.tolist()) for b in out[1:]), name
    tags = out[0].tables["b"]
    lengths = np.diff(tags.offsets)[1::2]  # field "tags" is the table's second field
    assert (lengths == 0).any()
    assert (lengths == 3).any()
    return out


@pytest.mark.parametrize(
    ("optimizer", "address"),
    [
        ("sgd", "inproc://1"),
        ("adagrad", "inproc://1"),
        ("adagrad-rowwise-options", "inproc://1"),
        ("sgd-nesterov-wd", "inproc://2"),
        ("adagrad", "inproc://3"),
        ("adamw", "inproc://1"),
        ("ftrl-options", "inproc://1"),
    ],
)
def test_store_backed_training_equals_the_reference(
    batches: list[PreparedBatch], optimizer: str, address: str
) -> None:
    tables = table_configs(OPTIMIZERS[optimizer])
    got = store_backed_run(batches, tables, address)
    want = reference_run(batches, tables)
    assert_same_training(got, want)
    assert len(set(want.losses)) == len(want.losses)  # training moves the model
    initial = ReferenceEmbeddings(tables)
    for name, rows in want.rows.items():
        ids = seen_ids(batches)[name]
        assert not np.allclose(rows, initial.rows(name, ids, create=True), atol=1e-4)


def test_the_comparison_catches_a_different_row_update(batches: list[PreparedBatch]) -> None:
    tables = table_configs(OPTIMIZERS["adagrad"])
    got = store_backed_run(batches, tables, "inproc://1")
    off = reference_run(
        batches, table_configs({**OPTIMIZERS["adagrad"], "lr": 1.01 * OPTIMIZERS["adagrad"]["lr"]})
    )
    with pytest.raises(AssertionError):
        assert_same_training(got, off)


# --- what the reference refuses and how it reads --------------------------------------


def test_options_the_reference_does_not_model_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="admission 'count_min'"):
        ReferenceEmbeddings({"t": TableConfig(dim=2, admission={"kind": "count_min"})})
    with pytest.raises(NotImplementedError, match="ttl_steps=10"):
        ReferenceEmbeddings({"t": TableConfig(dim=2, ttl_steps=10)})
    small = ReferenceEmbeddings({"t": TableConfig(dim=2, capacity=3, initial_rows=1)})
    small.rows("t", np.array([1, 2, 3], np.uint64), create=True)  # grows 1 -> 4 rows
    with pytest.raises(NotImplementedError, match="capacity 3"):
        small.rows("t", np.array([4], np.uint64), create=True)


def test_reads_unknown_ids_as_zeros_and_refuses_pushes_to_them() -> None:
    ref = ReferenceEmbeddings({"t": TableConfig(dim=3)})
    known = ref.rows("t", np.array([5], np.uint64), create=True)
    assert np.abs(known).sum() > 0
    got = ref.rows("t", np.array([5, 6, 5], np.uint64))
    np.testing.assert_array_equal(got, np.concatenate([known, np.zeros((1, 3)), known]))
    assert len(ref.tables["t"]) == 1  # reading without create made no row
    with pytest.raises(KeyError, match="without a row"):
        ref.apply("t", np.array([6], np.uint64), np.ones((1, 3), np.float32))
    with pytest.raises(KeyError, match="no reference table 'u'"):
        ref.rows("u", np.array([5], np.uint64))


def test_reference_model_needs_a_config_for_every_table_of_the_spec() -> None:
    tables = table_configs(OPTIMIZERS["sgd"])
    del tables["b"]
    with pytest.raises(ValueError, match=r"tables \['b'\]"):
        ReferenceModel(SPEC, tables, nn.Identity())


def test_reference_ignores_the_batch_rows(batches: list[PreparedBatch]) -> None:
    tables = table_configs(OPTIMIZERS["sgd"])
    with_rows = copy.deepcopy(batches[0])
    for name, t in with_rows.tables.items():
        t.rows = np.full((t.unique_ids.shape[0], tables[name].dim), 9.0, np.float32)
    plain = ReferenceModel(SPEC, tables, dense_model(tables))(batches[0])
    given = ReferenceModel(SPEC, tables, dense_model(tables))(with_rows)
    assert torch.equal(plain, given)
