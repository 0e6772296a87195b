"""SGD with momentum, dampening, Nesterov and L2 weight decay (``torch.optim.SGD`` per row)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import Float32Array, Int64Array
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
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_step[r] += 1
        first = row_step[r] == 1
        for j in range(dim):
            d = np.float32(grads[i, j] + weight_decay * weights[r, j])
            if momentum != 0.0:
                buf = d if first else np.float32(momentum * state[r, j] + (1.0 - dampening) * d)
                state[r, j] = buf
                d = np.float32(d + momentum * buf) if nesterov else buf
            weights[r, j] = np.float32(weights[r, j] - lr * d)


class SGD:
    """Row-wise SGD; momentum buffers live in the row's state (``dim`` floats when used).

    >>> import numpy as np
    >>> opt = SGD(SGDConfig(lr=0.1))
    >>> w = np.ones((2, 3), np.float32); s = np.zeros((2, 0), np.float32)
    >>> opt.apply(w, s, np.zeros(2, np.int64), np.array([1]), np.ones((1, 3), np.float32))
    >>> w.astype(float).round(2).tolist()
    [[1.0, 1.0, 1.0], [0.9, 0.9, 0.9]]
    """

    def __init__(self, config: SGDConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        return dim if self.config.momentum > 0 else 0

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
