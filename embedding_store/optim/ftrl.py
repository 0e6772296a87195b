"""FTRL-Proximal (McMahan et al., "Ad Click Prediction: a View from the Trenches", 2013)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import Float32Array, Int64Array
from embedding_store.types import FTRLConfig


@nb.njit(nogil=True, cache=True)
def _ftrl_init(
    weights: Float32Array,
    state: Float32Array,
    rows: Int64Array,
    alpha: float,
    beta: float,
    l2: float,
    n0: float,
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(dim):
            state[r, dim + j] = n0
            state[r, j] = -weights[r, j] * ((beta + np.sqrt(n0)) / alpha + l2)


@nb.njit(nogil=True, cache=True)
def _ftrl(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    grads: Float32Array,
    alpha: float,
    beta: float,
    l1: float,
    l2: float,
) -> None:
    dim = weights.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_step[r] += 1
        for j in range(dim):
            g = float(grads[i, j])
            n = float(state[r, dim + j])
            n_new = n + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(n)) / alpha
            z = float(state[r, j]) + g - sigma * weights[r, j]
            state[r, j] = z
            state[r, dim + j] = n_new
            if abs(z) <= l1:
                weights[r, j] = 0.0
            else:
                sign = 1.0 if z > 0 else -1.0
                weights[r, j] = -(z - sign * l1) / ((beta + np.sqrt(n_new)) / alpha + l2)


class FTRL:
    """FTRL-Proximal per coordinate; state is ``z`` and ``n`` (``2 * dim`` floats).

    A new row's ``z`` is set so that the closed form gives back its initial
    weight (exactly when ``l1 == 0``), so a row keeps its initialized value
    until its first update instead of jumping to zero.

    >>> import numpy as np
    >>> opt = FTRL(FTRLConfig(alpha=0.1, l1=10.0))
    >>> w = np.full((1, 2), 0.3, np.float32); s = np.zeros((1, 4), np.float32)
    >>> opt.initialize(w, s, np.array([0]))
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[0.5, -0.2]], np.float32))
    >>> w.tolist()  # a large L1 drives weights to exact zeros
    [[0.0, 0.0]]
    """

    def __init__(self, config: FTRLConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        c = self.config
        _ftrl_init(weights, state, rows, c.alpha, c.beta, c.l2, c.initial_accumulator_value)

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        c = self.config
        _ftrl(weights, state, row_step, rows, grads, c.alpha, c.beta, c.l1, c.l2)
