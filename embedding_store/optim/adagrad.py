"""Adagrad, element-wise (``torch.optim.Adagrad`` per row) or row-wise (one accumulator per row)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import Float32Array, Int64Array
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
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_step[r] += 1
        clr = lr / (1.0 + (row_step[r] - 1) * lr_decay)
        for j in range(dim):
            g = np.float32(grads[i, j] + weight_decay * weights[r, j])
            acc = np.float32(state[r, j] + g * g)
            state[r, j] = acc
            weights[r, j] = np.float32(weights[r, j] - clr * g / (np.sqrt(acc) + eps))


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
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_step[r] += 1
        clr = lr / (1.0 + (row_step[r] - 1) * lr_decay)
        sq = 0.0
        for j in range(dim):
            g = grads[i, j] + weight_decay * weights[r, j]
            sq += g * g
        acc = np.float32(state[r, 0] + sq / dim)
        state[r, 0] = acc
        scale = clr / (np.sqrt(acc) + eps)
        for j in range(dim):
            g = grads[i, j] + weight_decay * weights[r, j]
            weights[r, j] = np.float32(weights[r, j] - scale * g)


class Adagrad:
    """Adagrad over rows; ``rowwise=True`` keeps one float of state per row instead of ``dim``.

    >>> import numpy as np
    >>> opt = Adagrad(AdagradConfig(lr=0.5))
    >>> w = np.zeros((1, 2), np.float32); s = np.zeros((1, opt.state_width(2)), np.float32)
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[2.0, -1.0]], np.float32))
    >>> w.astype(float).round(3).tolist(), s.tolist()
    ([[-0.5, 0.5]], [[4.0, 1.0]])
    """

    def __init__(self, config: AdagradConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        return 1 if self.config.rowwise else dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        state[rows] = self.config.initial_accumulator_value

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        c = self.config
        kernel = _rowwise_adagrad if c.rowwise else _adagrad
        kernel(weights, state, row_step, rows, grads, c.lr, c.eps, c.weight_decay, c.lr_decay)
