"""Adam and AdamW with a per-row step count for bias correction (lazy Adam)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import BLOCK, Float32Array, Int64Array, touch_rows
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
            t = np.float64(row_step[r])
            step_size = lr / (1.0 - beta1**t)
            bc2_sqrt = np.sqrt(1.0 - beta2**t)
            for j in range(dim):
                w = np.float64(weights[r, j])
                g = np.float64(grads[i, j])
                if decoupled:
                    w = w * (1.0 - lr * weight_decay)
                else:
                    g = g + weight_decay * w
                m = beta1 * np.float64(state[r, j]) + (1.0 - beta1) * g
                v = beta2 * np.float64(state[r, dim + j]) + (1.0 - beta2) * g * g
                state[r, j] = m
                state[r, dim + j] = v
                weights[r, j] = w - step_size * m / (np.sqrt(v) / bc2_sqrt + eps)
    return sink


class Adam:
    """Adam per row (AdamW with ``decoupled_weight_decay``); state is ``m`` then ``v``.

    Each row corrects the bias of its moments with its own step count, so a row
    first updated late in training takes a full-size first step, as a fresh
    ``torch.optim.Adam`` parameter would.

    >>> import numpy as np
    >>> opt = Adam(AdamConfig(lr=0.1))
    >>> w = np.zeros((1, 2), np.float32); s = np.zeros((1, opt.state_width(2)), np.float32)
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[3.0, -0.5]], np.float32))
    >>> w.astype(float).round(3).tolist()  # the first Adam step moves every coordinate by about lr
    [[-0.1, 0.1]]
    """

    def __init__(self, config: AdamConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        """First moments (``dim``) then second moments (``dim``)."""
        return 2 * dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        """Zero both moments of fresh rows."""
        state[rows[rows >= 0]] = 0.0

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        """One Adam step on each named row (``rows[i] < 0`` skipped)."""
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
