"""Admission kernels: whether a new id gets a row (``CountMinAdmission``: seen often
enough by a count-min sketch; ``ProbabilityAdmission``: a seeded coin per id and step).
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.hashing import mix64, unit_float

I64 = npt.NDArray[np.int64]


@nb.njit(nogil=True, cache=True)
def admit_count_min(
    sketch: npt.NDArray[np.uint32],
    ids: I64,
    positions: I64,
    threshold: int,
    admitted: npt.NDArray[np.bool_],
) -> None:
    depth, width = sketch.shape
    slots = np.empty(depth, dtype=np.int64)
    for p in range(positions.shape[0]):
        h = np.uint64(ids[positions[p]])
        est = np.uint32(0xFFFFFFFF)
        for d in range(depth):
            h = mix64(h + np.uint64(d + 1))
            slots[d] = int(h % np.uint64(width))
            est = min(est, sketch[d, slots[d]])
        # Conservative update: raise only the counters at the minimum.
        if est < np.uint32(0xFFFFFFFF):
            for d in range(depth):
                if sketch[d, slots[d]] == est:
                    sketch[d, slots[d]] = est + np.uint32(1)
        admitted[p] = int(est) + 1 >= threshold


@nb.njit(nogil=True, cache=True)
def admit_probability(
    ids: I64,
    positions: I64,
    seed: np.uint64,
    clock: int,
    probability: float,
    admitted: npt.NDArray[np.bool_],
) -> None:
    salt = mix64(seed ^ np.uint64(clock))
    for p in range(positions.shape[0]):
        admitted[p] = unit_float(mix64(np.uint64(ids[positions[p]]) ^ salt)) < probability
