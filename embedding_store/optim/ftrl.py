"""FTRL-Proximal (McMahan et al., "Ad Click Prediction: a View from the Trenches", 2013)."""

from __future__ import annotations

import numba as nb
import numpy as np

from embedding_store.optim.base import BLOCK, Float32Array, Int64Array, touch_rows
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
    denom = (beta + np.sqrt(n0)) / alpha + l2
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        for j in range(dim):
            state[r, j] = -np.float64(weights[r, j]) * denom
            state[r, dim + j] = n0


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
            for j in range(dim):
                g = np.float64(grads[i, j])
                n = np.float64(state[r, dim + j])
                n_new = n + g * g
                sigma = (np.sqrt(n_new) - np.sqrt(n)) / alpha
                z = np.float64(state[r, j]) + g - sigma * np.float64(weights[r, j])
                state[r, j] = z
                state[r, dim + j] = n_new
                if abs(z) <= l1:
                    weights[r, j] = 0.0
                else:
                    shrunk = z - l1 if z > 0.0 else z + l1
                    weights[r, j] = -shrunk / ((beta + np.sqrt(n_new)) / alpha + l2)
    return sink


class FTRL:
    """FTRL-Proximal per coordinate; the state is ``z`` (``dim``) then ``n`` (``dim``).

    ``alpha`` is the learning rate, ``beta`` smooths it for rarely seen
    coordinates, ``l1`` makes weights exactly zero and ``l2`` shrinks them. After
    an update the weight is the closed form
    ``0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``.

    Fresh rows: ``n`` starts at ``initial_accumulator_value`` and ``z`` at
    ``-w * ((beta + sqrt(n)) / alpha + l2)``, the value for which the closed form
    gives back the row's initialized weight ``w`` when ``l1 == 0``. So a new row
    keeps its initial value until its first update instead of snapping to zero,
    and with ``l1 > 0`` its first update applies the L1 shrinkage to it. Use the
    zeros initializer for the classic FTRL start (``z = 0``).

    >>> import numpy as np
    >>> opt = FTRL(FTRLConfig(alpha=0.1, l1=10.0))
    >>> w = np.full((1, 2), 0.3, np.float32); s = np.zeros((1, opt.state_width(2)), np.float32)
    >>> opt.initialize(w, s, np.array([0]))
    >>> w.astype(float).round(3).tolist()  # initializing keeps the weights
    [[0.3, 0.3]]
    >>> opt.apply(w, s, np.zeros(1, np.int64), np.array([0]), np.array([[0.5, -0.2]], np.float32))
    >>> w.tolist()  # a large L1 drives weights to exact zeros
    [[0.0, 0.0]]
    """

    def __init__(self, config: FTRLConfig) -> None:
        self.config = config

    def state_width(self, dim: int) -> int:
        """``z`` then ``n``, ``dim`` floats each."""
        return 2 * dim

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        """Set ``n`` to the initial accumulator and ``z`` so the row keeps its weights."""
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
        """One FTRL-Proximal step on each named row (``rows[i] < 0`` skipped)."""
        c = self.config
        _ftrl(weights, state, row_step, rows, grads, c.alpha, c.beta, c.l1, c.l2)
