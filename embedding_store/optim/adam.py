"""Adam (and AdamW) with a per-row step count for bias correction: lazy Adam."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import Float32Array, Int64Array
from embedding_store.types import AdamConfig


@nb.njit(nogil=True, cache=True)
def _adam(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    grads: Float32Array,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_step[r] += 1
        t = row_step[r]
        bc1 = 1.0 - beta1**t
        bc2_sqrt = np.sqrt(1.0 - beta2**t)
        step_size = lr / bc1
        for j in range(dim):
            w = weights[r, j]
            g = grads[i, j]
            if decoupled:
                w = np.float32(w * (1.0 - lr * weight_decay))
            else:
                g = np.float32(g + weight_decay * w)
            m = np.float32(beta1 * state[r, j] + (1.0 - beta1) * g)
            v = np.float32(beta2 * state[r, dim + j] + (1.0 - beta2) * g * g)
            state[r, j] = m
            state[r, dim + j] = v
            denom = np.sqrt(v) / bc2_sqrt + eps
            weights[r, j] = np.float32(w - step_size * m / denom)


class Adam:
    """Adam per row; the first and second moments take ``2 * dim`` floats of state.

    >>> import numpy as np
    >>> opt = Adam(AdamConfig(lr=0.1))
    >>> w = np.zeros((1, 2), np.float32); s = np.zeros((1, 4), np.float32)
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[3.0, -0.5]], np.float32))
    >>> w.astype(float).round(3).tolist()  # the first Adam step moves every coordinate by about lr
    [[-0.1, 0.1]]
    """

    def __init__(self, config: AdamConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        state[rows] = 0.0

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        c = self.config
        _adam(
            weights,
            state,
            row_step,
            rows,
            grads,
            c.lr,
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
            c.decoupled_weight_decay,
        )
