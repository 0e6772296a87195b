"""SGD with momentum, dampening, Nesterov and L2 weight decay (``torch.optim.SGD`` per row)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import BLOCK, Float32Array, Int64Array, touch_rows
from embedding_store.types import SGDConfig


@nb.njit(nogil=True, cache=True)
def _sgd(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    grads: Float32Array,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
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
            # torch starts the momentum buffer as a copy of the first gradient (no dampening).
            first = row_step[r] == 1
            for j in range(dim):
                w = np.float64(weights[r, j])
                d = np.float64(grads[i, j]) + weight_decay * w
                if momentum != 0.0:
                    buf = d if first else momentum * np.float64(state[r, j]) + (1.0 - dampening) * d
                    state[r, j] = buf
                    d = d + momentum * buf if nesterov else buf
                weights[r, j] = w - lr * d
    return sink


class SGD:
    """Row-wise SGD; the momentum buffer is the row's state (``dim`` floats, none without momentum).

    A row's first update starts its buffer from the gradient, as ``torch.optim.SGD``
    does, so a row recycled for a new id behaves like a fresh parameter.

    >>> import numpy as np
    >>> opt = SGD(SGDConfig(lr=0.1))
    >>> w = np.ones((2, 3), np.float32); s = np.zeros((2, opt.state_width(3)), np.float32)
    >>> opt.apply(w, s, np.zeros(2, np.int64), np.array([1]), np.ones((1, 3), np.float32))
    >>> w.astype(float).round(2).tolist()
    [[1.0, 1.0, 1.0], [0.9, 0.9, 0.9]]
    """

    def __init__(self, config: SGDConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        """``dim`` floats of momentum buffer when momentum is on, else none."""
        return dim if self.config.momentum > 0.0 else 0

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        """Zero the momentum buffer of fresh rows."""
        state[rows[rows >= 0]] = 0.0

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        """One SGD step on each named row (``rows[i] < 0`` skipped)."""
        c = self.config
        _sgd(
            weights,
            state,
            row_step,
            rows,
            grads,
            c.lr,
            c.momentum,
            c.dampening,
            c.nesterov,
            c.weight_decay,
        )
