"""Layouts, random batches and per-bag Python oracles for the pooling tests.

The pooling oracle walks every sample and field and adds the rows of the ids
in its bag (in float64); the gradient oracle builds the same pooled vectors
with an explicit gather (``rows[inverse[start:end]]``) per bag and lets
autograd differentiate that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from connectors.spec import FeatureSpec
from pipeline.types import PreparedBatch, TableBatch


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
