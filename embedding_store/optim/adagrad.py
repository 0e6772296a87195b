"""Adagrad, element-wise (``torch.optim.Adagrad`` per row) or row-wise (one accumulator per row)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import BLOCK, Float32Array, Int64Array, touch_rows
from embedding_store.types import AdagradConfig


@nb.njit(nogil=True, cache=True)
def _adagrad(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    grads: Float32Array,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float,
) -> float:
    dim = weights.shape[1]
    sink = 0.0
    for start in range(0, rows.shape[0], BLOCK):
        stop = min(rows.shape[0], start + BLOCK)
        sink += touch_rows(weights, state, row_step, rows, start, stop)
        for i in range(start, stop):
            r = rows[i]
            if r < 0:
                continue
            row_step[r] += 1
            clr = lr / (1.0 + np.float64(row_step[r] - 1) * lr_decay)
            for j in range(dim):
                w = np.float64(weights[r, j])
                g = np.float64(grads[i, j]) + weight_decay * w
                acc = np.float64(state[r, j]) + g * g
                state[r, j] = acc
                weights[r, j] = w - clr * g / (np.sqrt(acc) + eps)
    return sink


@nb.njit(nogil=True, cache=True)
def _rowwise_adagrad(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    grads: Float32Array,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float,
) -> float:
    dim = weights.shape[1]
    sink = 0.0
    for start in range(0, rows.shape[0], BLOCK):
        stop = min(rows.shape[0], start + BLOCK)
        sink += touch_rows(weights, state, row_step, rows, start, stop)
        for i in range(start, stop):
            r = rows[i]
            if r < 0:
                continue
            row_step[r] += 1
            clr = lr / (1.0 + np.float64(row_step[r] - 1) * lr_decay)
            # Two passes over the row: the step size needs the whole row's mean first,
            # and recomputing g' avoids a scratch buffer per row.
            sq = 0.0
            for j in range(dim):
                g = np.float64(grads[i, j]) + weight_decay * np.float64(weights[r, j])
                sq += g * g
            acc = np.float64(state[r, 0]) + sq / dim
            state[r, 0] = acc
            scale = clr / (np.sqrt(acc) + eps)
            for j in range(dim):
                w = np.float64(weights[r, j])
                weights[r, j] = w - scale * (np.float64(grads[i, j]) + weight_decay * w)
    return sink


class Adagrad:
    """Adagrad over rows; ``rowwise=True`` keeps one float of state per row instead of ``dim``.

    Element-wise, the state is the per-coordinate sum of squared gradients and the
    step is ``torch.optim.Adagrad``'s. Row-wise (the FBGEMM/TorchRec variant), the
    one accumulator gains the mean of the row's squared gradient and scales the
    whole row. Either way the accumulator starts at ``initial_accumulator_value``
    and ``lr_decay`` divides the rate by ``1 + (step - 1) * lr_decay`` with the
    row's own step.

    >>> import numpy as np
    >>> opt = Adagrad(AdagradConfig(lr=0.5))
    >>> w = np.zeros((1, 2), np.float32); s = np.zeros((1, opt.state_width(2)), np.float32)
    >>> opt.initialize(w, s, np.array([0]))
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[2.0, -1.0]], np.float32))
    >>> w.astype(float).round(3).tolist(), s.tolist()
    ([[-0.5, 0.5]], [[4.0, 1.0]])
    """

    def __init__(self, config: AdagradConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        """One accumulator per coordinate, or one per row when ``rowwise``."""
        return 1 if self.config.rowwise else dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        """Set the accumulators of fresh rows to ``initial_accumulator_value``."""
        state[rows[rows >= 0]] = self.config.initial_accumulator_value

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        """One Adagrad step on each named row (``rows[i] < 0`` skipped)."""
        c = self.config
        kernel = _rowwise_adagrad if c.rowwise else _adagrad
        kernel(weights, state, row_step, rows, grads, c.lr, c.eps, c.weight_decay, c.lr_decay)
