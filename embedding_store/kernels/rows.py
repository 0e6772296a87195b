"""Row kernels: gathers out of a table's weights, the weight clip, and the checks
around an optimizer step (``update_rows``, the arithmetic of a push).
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.hashing import init_row
from embedding_store.kernels.intrinsics import AHEAD, prefetch
from embedding_store.optim import RowOptimizer

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def update_rows(
    optimizer: RowOptimizer,
    weight_clip: float | None,
    weights: F32,
    state: F32,
    row_step: I64,
    rows: I64,
    g: F32,
) -> int:
    """Apply ``g`` to the slots ``rows`` (``-1`` skipped) as a table's push does: the
    optimizer's step, then the weight clip; a row the update would make non-finite is
    left as it was. Returns how many rows were left so.

    A finite gradient can still overflow a weight or an optimizer state (3e38 three
    times), and a row that holds NaN or Inf would be served, and checkpointed, for
    good. A trainer that predicts what its push will do calls this on copies of the
    rows, so its prediction is the store's arithmetic, not a second implementation.

    >>> from embedding_store.optim import make_optimizer
    >>> from embedding_store.types import SGDConfig
    >>> w, s, n = np.ones((1, 2), np.float32), np.zeros((1, 0), np.float32), np.zeros(1, np.int64)
    >>> update_rows(make_optimizer(SGDConfig(lr=1.0)), 0.5, w, s, n, np.array([0]),
    ...             np.full((1, 2), 2.0, np.float32))
    0
    >>> w.tolist(), n.tolist()
    ([[-0.5, -0.5]], [1])
    """
    n, width = rows.shape[0], state.shape[1]
    before = (
        np.empty((n, weights.shape[1]), dtype=np.float32),
        np.empty((n, width), dtype=np.float32),
        np.empty(n, dtype=np.int64),
    )
    save_rows(weights, state, row_step, rows, *before)
    optimizer.apply(weights, state, row_step, rows, g)
    if weight_clip is not None:
        clip(weights, rows, weight_clip)
    return int(undo_nonfinite(weights, state, row_step, rows, *before))


@nb.njit(nogil=True, cache=True)
def gather_or_init(
    weights: F32, rows: I64, keys: I64, seed: np.uint64, kind: int, a: float, b: float, out: F32
) -> None:
    """``out[i] = weights[rows[i]]``; the id's initial row where ``rows[i] < 0``."""
    n = rows.shape[0]
    dim = weights.shape[1]
    for i in range(n):
        if i + AHEAD < n and rows[i + AHEAD] >= 0:
            prefetch(weights, rows[i + AHEAD])
        r = rows[i]
        if r < 0:
            init_row(out[i], np.uint64(keys[i]), seed, kind, a, b)
        else:
            for j in range(dim):
                out[i, j] = weights[r, j]


@nb.njit(nogil=True, cache=True)
def gather(weights: F32, rows: I64, out: F32) -> None:
    """``out[i] = weights[rows[i]]``, zeros where ``rows[i] < 0``."""
    n = rows.shape[0]
    dim = weights.shape[1]
    for i in range(n):
        if i + AHEAD < n and rows[i + AHEAD] >= 0:
            prefetch(weights, rows[i + AHEAD])
        r = rows[i]
        if r < 0:
            for j in range(dim):
                out[i, j] = 0.0
        else:
            for j in range(dim):
                out[i, j] = weights[r, j]


@nb.njit(nogil=True, cache=True)
def clip(weights: F32, rows: I64, c: float) -> None:
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        for j in range(weights.shape[1]):
            w = weights[r, j]
            if w > c:
                weights[r, j] = c
            elif w < -c:
                weights[r, j] = -c


@nb.njit(nogil=True, cache=True)
def gather_state(
    weights: F32, state: F32, row_step: I64, rows: I64, out_w: F32, out_s: F32, out_step: I64
) -> None:
    """Rows ``rows`` with their state into ``out_*``; a row -1 reads zeros and step -1."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            out_w[i] = 0.0
            out_s[i] = 0.0
            out_step[i] = -1
        else:
            out_w[i] = weights[r]
            out_s[i] = state[r]
            out_step[i] = row_step[r]


@nb.njit(nogil=True, cache=True)
def save_rows(
    weights: F32, state: F32, row_step: I64, rows: I64, w_out: F32, s_out: F32, step_out: I64
) -> None:
    """Copy the weights, state and step of each row (``rows[i] < 0`` skipped) before a push."""
    n = rows.shape[0]
    for i in range(n):
        if i + AHEAD < n and rows[i + AHEAD] >= 0:
            prefetch(weights, rows[i + AHEAD])
            prefetch(state, rows[i + AHEAD])
        r = rows[i]
        if r < 0:
            continue
        for j in range(weights.shape[1]):
            w_out[i, j] = weights[r, j]
        for j in range(state.shape[1]):
            s_out[i, j] = state[r, j]
        step_out[i] = row_step[r]


@nb.njit(nogil=True, cache=True)
def undo_nonfinite(
    weights: F32, state: F32, row_step: I64, rows: I64, w_in: F32, s_in: F32, step_in: I64
) -> int:
    """Put back the saved values of every row a push left non-finite; returns how many.

    One pass over the rows just written (still in cache), not numpy's two gathers
    and two temporaries per array (``benchmarks/store.py``, pushes).
    """
    bad = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        finite = True
        for j in range(weights.shape[1]):
            finite &= np.isfinite(weights[r, j])
        for j in range(state.shape[1]):
            finite &= np.isfinite(state[r, j])
        if finite:
            continue
        bad += 1
        for j in range(weights.shape[1]):
            weights[r, j] = w_in[i, j]
        for j in range(state.shape[1]):
            state[r, j] = s_in[i, j]
        row_step[r] = step_in[i]
    return bad
