"""A plain single-process PyTorch model: the oracle of synchronous training and a baseline.

``ReferenceEmbeddings`` keeps each table as one growing float32 weight with
sparse gradients (as ``nn.EmbeddingBag(sparse=True)`` gives), an id -> row
dict, and a row optimizer written here in torch, independently of the store's
numba kernels. Rows start exactly as the store starts them (same seed, same
initializer) and every update follows the store's rule for the table's
optimizer config, in float64 with float32 storage as the store does, so
store-backed training with ``staleness: 0`` can be checked against it step by
step.

The reference does not model admission, eviction or TTL expiry: tables that
configure them are refused (``NotImplementedError``), and a table that grows
past its ``capacity`` raises rather than diverge silently from a store that
would evict.

>>> import numpy as np
>>> from embedding_store.types import TableConfig
>>> emb = ReferenceEmbeddings({"user": TableConfig(dim=2, optimizer={"kind": "sgd", "lr": 0.5})})
>>> ids = np.array([7, 9], np.uint64)
>>> first = emb.rows("user", ids, create=True)
>>> emb.apply("user", ids, np.ones((2, 2), np.float32))
>>> (emb.rows("user", ids) - first).round(6).tolist()  # one SGD step of lr * grad
[[-0.5, -0.5], [-0.5, -0.5]]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, assert_never

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from connectors.spec import FeatureSpec
from embedding_store.hashing import init_params, init_rows, table_seed
from embedding_store.types import (
    AdagradConfig,
    AdamConfig,
    AlwaysAdmit,
    FTRLConfig,
    OptimizerConfig,
    SGDConfig,
    TableConfig,
)
from pipeline.types import PreparedBatch
from trainer.models import loss_fn
from trainer.pooling import pool_table

F32 = npt.NDArray[np.float32]

# --- row update rules -------------------------------------------------------------
#
# Each rule takes the float32 rows being updated, their float32 state, their
# step counts after this update and float32 gradients, and returns the new
# float32 rows and state. The arithmetic is float64 with the operations in the
# store's order, so the results round to the same float32 values.


class RowRule(Protocol):
    """One sparse optimizer's update of a set of distinct rows."""

    def state_width(self, dim: int) -> int: ...

    def init_state(self, weights: Tensor) -> Tensor:
        """The float32 state ``[n, state_width]`` of fresh rows with these weights."""
        ...

    def update(
        self, weights: Tensor, state: Tensor, steps: Tensor, grads: Tensor
    ) -> tuple[Tensor, Tensor]:
        """New (weights, state) of rows; ``steps`` already counts this update."""
        ...


class SGDRule:
    """``torch.optim.SGD`` per row: weight decay, momentum, dampening, Nesterov."""

    def __init__(self, config: SGDConfig) -> None:
        self.c = config

    def state_width(self, dim: int) -> int:
        return dim if self.c.momentum > 0.0 else 0

    def init_state(self, weights: Tensor) -> Tensor:
        return weights.new_zeros((weights.shape[0], self.state_width(weights.shape[1])))

    def update(
        self, weights: Tensor, state: Tensor, steps: Tensor, grads: Tensor
    ) -> tuple[Tensor, Tensor]:
        c = self.c
        w = weights.double()
        d = grads.double() + c.weight_decay * w
        if c.momentum != 0.0:
            # A row's first step starts its buffer from the gradient itself.
            first = (steps == 1).unsqueeze(1)
            buf = torch.where(first, d, c.momentum * state.double() + (1.0 - c.dampening) * d)
            state = buf.float()
            d = d + c.momentum * buf if c.nesterov else buf
        return (w - c.lr * d).float(), state


class AdagradRule:
    """Adagrad per coordinate, or row-wise with one accumulator (mean squared gradient)."""

    def __init__(self, config: AdagradConfig) -> None:
        self.c = config

    def state_width(self, dim: int) -> int:
        return 1 if self.c.rowwise else dim

    def init_state(self, weights: Tensor) -> Tensor:
        shape = (weights.shape[0], self.state_width(weights.shape[1]))
        return weights.new_full(shape, self.c.initial_accumulator_value)

    def update(
        self, weights: Tensor, state: Tensor, steps: Tensor, grads: Tensor
    ) -> tuple[Tensor, Tensor]:
        c = self.c
        w = weights.double()
        clr = (c.lr / (1.0 + (steps.double() - 1.0) * c.lr_decay)).unsqueeze(1)
        g = grads.double() + c.weight_decay * w
        if not c.rowwise:
            acc = state.double() + g * g
            return (w - clr * g / (acc.sqrt() + c.eps)).float(), acc.float()
        # Summed column by column, in the store's order, so the float64 sum is the same.
        sq = torch.zeros_like(w[:, 0])
        for j in range(w.shape[1]):
            sq = sq + g[:, j] * g[:, j]
        acc = state[:, 0].double() + sq / w.shape[1]
        scale = (clr[:, 0] / (acc.sqrt() + c.eps)).unsqueeze(1)
        return (w - scale * g).float(), acc.float().unsqueeze(1)


class AdamRule:
    """Adam (AdamW when decoupled) with bias correction by each row's own step count."""

    def __init__(self, config: AdamConfig) -> None:
        self.c = config
        # Bias corrections per step count, from Python's pow (libm, as the store's
        # kernel uses) rather than torch.pow, whose vectorised pow may differ by an ulp.
        self._corrections: list[tuple[float, float]] = [(math.nan, math.nan)]

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def init_state(self, weights: Tensor) -> Tensor:
        return weights.new_zeros((weights.shape[0], self.state_width(weights.shape[1])))

    def _bias(self, steps: Tensor) -> tuple[Tensor, Tensor]:
        c = self.c
        top = int(steps.max()) if steps.numel() else 0
        for t in range(len(self._corrections), top + 1):
            tf = float(t)
            self._corrections.append((c.lr / (1.0 - c.beta1**tf), math.sqrt(1.0 - c.beta2**tf)))
        table = torch.tensor(self._corrections, dtype=torch.float64, device=steps.device)
        picked = table[steps]
        return picked[:, 0:1], picked[:, 1:2]

    def update(
        self, weights: Tensor, state: Tensor, steps: Tensor, grads: Tensor
    ) -> tuple[Tensor, Tensor]:
        c = self.c
        dim = weights.shape[1]
        step_size, bc2_sqrt = self._bias(steps)
        w = weights.double()
        g = grads.double()
        if c.decoupled_weight_decay:
            w = w * (1.0 - c.lr * c.weight_decay)
        else:
            g = g + c.weight_decay * w
        m = c.beta1 * state[:, :dim].double() + (1.0 - c.beta1) * g
        v = c.beta2 * state[:, dim:].double() + (1.0 - c.beta2) * g * g
        new_w = w - step_size * m / (v.sqrt() / bc2_sqrt + c.eps)
        return new_w.float(), torch.cat([m, v], dim=1).float()


class FTRLRule:
    """FTRL-Proximal per coordinate; fresh rows get the ``z`` that keeps their weights."""

    def __init__(self, config: FTRLConfig) -> None:
        self.c = config

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def init_state(self, weights: Tensor) -> Tensor:
        c = self.c
        n0 = c.initial_accumulator_value
        denom = (c.beta + math.sqrt(n0)) / c.alpha + c.l2
        z = -weights.double() * denom
        return torch.cat([z.float(), torch.full_like(weights, n0)], dim=1)

    def update(
        self, weights: Tensor, state: Tensor, steps: Tensor, grads: Tensor
    ) -> tuple[Tensor, Tensor]:
        c = self.c
        dim = weights.shape[1]
        g = grads.double()
        n = state[:, dim:].double()
        n_new = n + g * g
        sigma = (n_new.sqrt() - n.sqrt()) / c.alpha
        z = state[:, :dim].double() + g - sigma * weights.double()
        shrunk = torch.where(z > 0.0, z - c.l1, z + c.l1)
        closed = -shrunk / ((c.beta + n_new.sqrt()) / c.alpha + c.l2)
        new_w = torch.where(z.abs() <= c.l1, torch.zeros_like(z), closed)
        return new_w.float(), torch.cat([z, n_new], dim=1).float()


def row_rule(config: OptimizerConfig) -> RowRule:
    """The reference update rule of a store optimizer config."""
    match config:
        case SGDConfig():
            return SGDRule(config)
        case AdagradConfig():
            return AdagradRule(config)
        case AdamConfig():
            return AdamRule(config)
        case FTRLConfig():
            return FTRLRule(config)
        case _:
            assert_never(config)


# --- tables -----------------------------------------------------------------------


class ReferenceTable:
    """One table: id -> row dict, float32 weights that grow by doubling, optimizer state."""

    def __init__(
        self, name: str, config: TableConfig, *, device: torch.device | str = "cpu"
    ) -> None:
        if not isinstance(config.admission, AlwaysAdmit):
            msg = (
                f"reference table {name!r}: admission {config.admission.kind!r} is not "
                f"modelled; use admission 'always' to compare with the reference"
            )
            raise NotImplementedError(msg)
        if config.ttl_steps is not None:
            msg = (
                f"reference table {name!r}: ttl_steps={config.ttl_steps} (expiry) is not "
                f"modelled; leave ttl_steps unset to compare with the reference"
            )
            raise NotImplementedError(msg)
        self.name = name
        self.config = config
        self.dim = config.dim
        self.device = torch.device(device)
        self.rule = row_rule(config.optimizer)
        self._seed = table_seed(name, config.seed)
        self._init = init_params(config.initializer)
        self._index: dict[int, int] = {}
        cap = max(1, min(config.initial_rows, config.capacity))
        width = self.rule.state_width(self.dim)
        self._weights = torch.zeros((cap, self.dim), dtype=torch.float32, device=self.device)
        self._state = torch.zeros((cap, width), dtype=torch.float32, device=self.device)
        self._steps = torch.zeros(cap, dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def weight(self) -> Tensor:
        """The weights of the rows created so far, ``[len(self), dim]`` (a view, no grad)."""
        return self._weights[: len(self)]

    def _grow(self, need: int) -> None:
        cap = self._weights.shape[0]
        if need <= cap:
            return
        while cap < need:
            cap *= 2

        def grown(t: Tensor) -> Tensor:
            out = t.new_zeros((cap, *t.shape[1:]))
            out[: t.shape[0]] = t
            return out

        self._weights = grown(self._weights)
        self._state = grown(self._state)
        self._steps = grown(self._steps)

    def index(self, ids: npt.ArrayLike, *, create: bool = False) -> npt.NDArray[np.int64]:
        """Row of each id; new ids get initialized rows when ``create``, else -1."""
        keys = np.ascontiguousarray(ids, dtype=np.uint64)
        get = self._index.get
        rows = np.fromiter((get(k, -1) for k in keys.tolist()), np.int64, keys.shape[0])
        if not create:
            return rows
        missing = np.flatnonzero(rows < 0)
        if missing.shape[0] == 0:
            return rows
        new_keys = np.array(list(dict.fromkeys(keys[missing].tolist())), dtype=np.uint64)
        start = len(self)
        if start + new_keys.shape[0] > self.config.capacity:
            msg = (
                f"reference table {self.name!r} needs {start + new_keys.shape[0]} rows, more "
                f"than its capacity {self.config.capacity} (per shard): a store shard may "
                f"evict, which the reference does not model; raise the capacity to compare"
            )
            raise NotImplementedError(msg)
        self._grow(start + new_keys.shape[0])
        fresh = np.empty((new_keys.shape[0], self.dim), dtype=np.float32)
        kind, a, b = self._init
        init_rows(fresh, new_keys, self._seed, kind, a, b)
        stop = start + new_keys.shape[0]
        weights = torch.from_numpy(fresh).to(self.device)
        self._weights[start:stop] = weights
        self._state[start:stop] = self.rule.init_state(weights)
        self._steps[start:stop] = 0
        self._index.update(zip(new_keys.tolist(), range(start, stop), strict=True))
        rows[missing] = [self._index[k] for k in keys[missing].tolist()]
        return rows

    def apply(self, rows: Tensor, grads: Tensor) -> None:
        """One optimizer step on each of the distinct ``rows`` (skips non-finite gradients)."""
        with torch.no_grad():
            finite = torch.isfinite(grads).all(dim=1)
            rows, grads = rows[finite], grads[finite].to(torch.float32)
            steps = self._steps[rows] + 1
            weights, state = self.rule.update(self._weights[rows], self._state[rows], steps, grads)
            clip = self.config.weight_clip
            if clip is not None:
                weights = weights.clamp(-clip, clip)
            self._weights[rows] = weights
            self._state[rows] = state
            self._steps[rows] = steps


class ReferenceEmbeddings:
    """The embedding tables of a reference model, with sparse gradients and row optimizers.

    ``pool`` looks a batch's ids up (creating rows as a training lookup of the
    store does), pools them with ``embedding_bag(sparse=True)`` over each
    table's whole weight, and remembers the weights it used; after
    ``backward()``, ``step`` applies their (coalesced) sparse gradients.
    """

    def __init__(
        self, tables: Mapping[str, TableConfig], *, device: torch.device | str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        self.tables = {
            name: ReferenceTable(name, cfg, device=self.device) for name, cfg in tables.items()
        }
        self._pending: dict[str, Tensor] = {}

    def _table(self, name: str) -> ReferenceTable:
        try:
            return self.tables[name]
        except KeyError:
            msg = f"no reference table {name!r} (tables: {sorted(self.tables)})"
            raise KeyError(msg) from None

    def rows(self, table: str, ids: npt.ArrayLike, *, create: bool = False) -> F32:
        """Current rows of ``ids`` (float32 ``[n, dim]``); ids without a row read as zeros.

        ``create=True`` first creates rows for new ids, as a training lookup does.
        """
        t = self._table(table)
        idx = torch.from_numpy(t.index(ids, create=create))
        out = torch.zeros((idx.shape[0], t.dim), dtype=torch.float32)
        known = idx >= 0
        out[known] = t.weight[idx[known].to(t.device)].cpu()
        return out.numpy()

    def apply(self, table: str, ids: npt.ArrayLike, grads: npt.ArrayLike) -> None:
        """Apply row gradients to existing, distinct ``ids`` (the store's push, for tests)."""
        t = self._table(table)
        idx = t.index(ids)
        if (idx < 0).any():
            msg = f"reference table {table!r}: push to ids without a row"
            raise KeyError(msg)
        g = torch.as_tensor(np.asarray(grads, dtype=np.float32), device=t.device)
        t.apply(torch.from_numpy(idx).to(t.device), g)

    def pool(self, batch: PreparedBatch, spec: FeatureSpec) -> list[Tensor]:
        """One pooled ``[B, dim]`` tensor per sparse field, in ``spec.sparse`` order."""
        self._pending.clear()
        pooled: dict[str, Tensor] = {}
        for name, fields in spec.tables().items():
            t = self._table(name)
            tb = batch.tables.get(name)
            if tb is None:
                msg = f"batch has no table {name!r} (it has {sorted(batch.tables)})"
                raise ValueError(msg)
            rows = torch.from_numpy(t.index(tb.unique_ids, create=True)).to(self.device)
            inverse = torch.from_numpy(tb.inverse.astype(np.int64)).to(self.device)
            offsets = torch.from_numpy(tb.offsets.astype(np.int64)).to(self.device)
            weight = t.weight.detach().requires_grad_(True)
            pooling = [spec.field(f).pooling for f in fields]
            out = pool_table(weight, rows[inverse], offsets, pooling, len(batch), sparse=True)
            self._pending[name] = weight
            for f, field in enumerate(fields):
                pooled[field] = out[:, f]
        return [pooled[s.name] for s in spec.sparse]

    def step(self) -> None:
        """Apply the sparse gradients the last ``pool``'s weights received."""
        for name, weight in self._pending.items():
            grad = weight.grad
            if grad is None:
                continue
            grad = grad.coalesce()
            self.tables[name].apply(grad.indices()[0], grad.values())
        self._pending.clear()


@dataclass(frozen=True)
class StepOutput:
    """One training step: the loss and the logits scored before the update."""

    loss: float
    logits: Tensor  # [B, T], detached


class ReferenceModel(nn.Module):
    """The dense model over ``ReferenceEmbeddings``: input is a ``PreparedBatch``.

    Ids come from each ``TableBatch.unique_ids``; the batch's ``rows`` (a store
    lookup) are ignored. ``parameters()`` are the dense model's only.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        tables: Mapping[str, TableConfig],
        dense: nn.Module,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        missing = sorted(set(spec.tables()) - set(tables))
        if missing:
            msg = f"the feature spec feeds tables {missing} that have no TableConfig"
            raise ValueError(msg)
        self.spec = spec
        self.device = torch.device(device)
        self.dense = dense.to(self.device)
        self.embeddings = ReferenceEmbeddings(
            {name: tables[name] for name in spec.tables()}, device=self.device
        )

    def forward(self, batch: PreparedBatch) -> Tensor:
        dense = torch.from_numpy(np.ascontiguousarray(batch.dense)).to(self.device)
        logits: Tensor = self.dense(dense, self.embeddings.pool(batch, self.spec))
        return logits

    def train_step(self, batch: PreparedBatch, optimizer: torch.optim.Optimizer) -> StepOutput:
        """Score ``batch``, then one step of ``optimizer`` (dense) and of the row optimizers."""
        optimizer.zero_grad()
        logits = self(batch)
        labels = torch.from_numpy(np.ascontiguousarray(batch.labels)).to(self.device)
        loss = loss_fn(logits, labels)
        torch.autograd.backward(loss)  # typed, unlike Tensor.backward
        optimizer.step()
        self.embeddings.step()
        return StepOutput(loss=float(loss.detach()), logits=logits.detach())
