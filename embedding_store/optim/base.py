"""The protocol every sparse (row) optimizer implements.

A table keeps, per row slot ``r``:

- ``weights[r, :dim]`` (float32), the embedding row;
- ``state[r, :state_width]`` (float32), the optimizer's per-row state;
- ``row_step[r]`` (int64), how many updates the row has received.

``apply`` updates only the slots named in ``rows`` (lazy, sparse semantics: a
row that receives no gradient is not decayed and its state does not move).
Slots given as ``-1`` are skipped. The rows named are distinct (the table sums
the gradients of duplicate ids before it calls ``apply``). Implementations are
numba kernels compiled with ``nogil=True`` so a shard serves other calls while
one runs.
"""

from __future__ import annotations

from typing import Protocol

import numba as nb
import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]

# Rows are updated in blocks: first a loop that only loads each row (independent
# cache misses the CPU overlaps), then the arithmetic on rows now in cache. Fused,
# the long sqrt/divide chains fill the reorder window and misses go one by one
# (``benchmarks/store.py``: its pushes are Adagrad on 10M rows).
BLOCK = 256


@nb.njit(nogil=True, cache=True, inline="always")
def touch_rows(
    weights: Float32Array,
    state: Float32Array,
    row_step: Int64Array,
    rows: Int64Array,
    start: int,
    end: int,
) -> float:
    """Load the first element of every array a row update reads; returns a checksum."""
    sink = 0.0
    has_state = state.shape[1] > 0
    for i in range(start, end):
        r = rows[i]
        if r >= 0:
            sink += weights[r, 0] + row_step[r]
            if has_state:
                sink += state[r, 0]
    return sink


class RowOptimizer(Protocol):
    """A sparse optimizer over the row slots of one table."""

    def state_width(self, dim: int) -> int:
        """Float32 columns of per-row state this optimizer needs for rows of ``dim``."""
        ...

    def initialize(self, weights: Float32Array, state: Float32Array, rows: Int64Array) -> None:
        """Set the state of freshly created rows (their weights are already initialized)."""
        ...

    def apply(
        self,
        weights: Float32Array,
        state: Float32Array,
        row_step: Int64Array,
        rows: Int64Array,
        grads: Float32Array,
    ) -> None:
        """Apply ``grads[i]`` to slot ``rows[i]`` for every ``rows[i] >= 0``; bump ``row_step``."""
        ...
