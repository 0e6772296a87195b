"""Sparse row optimizers, one module per strategy, all behind ``RowOptimizer``.

``make_optimizer`` builds the one a table's config names. Each applies its math
in a numba kernel that runs without the GIL and touches only the rows named:

>>> import numpy as np
>>> from embedding_store.types import AdagradConfig
>>> opt = make_optimizer(AdagradConfig(lr=0.5))
>>> weights = np.ones((2, 2), np.float32)
>>> state = np.zeros((2, opt.state_width(2)), np.float32)
>>> row_step = np.zeros(2, np.int64)
>>> opt.initialize(weights, state, np.array([0, 1]))
>>> grads = np.array([[0.5, -2.0], [9.0, 9.0]], np.float32)
>>> opt.apply(weights, state, row_step, np.array([0, -1]), grads)
>>> weights.astype(float).round(3).tolist()  # row 0 moved by lr * g / |g|; row 1 was skipped
[[0.5, 1.5], [1.0, 1.0]]
>>> row_step.tolist()
[1, 0]
"""

from __future__ import annotations

from typing import assert_never

from embedding_store.optim.adagrad import Adagrad
from embedding_store.optim.adam import Adam
from embedding_store.optim.base import RowOptimizer
from embedding_store.optim.ftrl import FTRL
from embedding_store.optim.sgd import SGD
from embedding_store.types import (
    AdagradConfig,
    AdamConfig,
    FTRLConfig,
    OptimizerConfig,
    SGDConfig,
)

__all__ = ["FTRL", "SGD", "Adagrad", "Adam", "RowOptimizer", "make_optimizer"]


def make_optimizer(config: OptimizerConfig) -> RowOptimizer:
    """The optimizer ``config`` describes (dispatch on its ``kind``)."""
    match config:
        case SGDConfig():
            return SGD(config)
        case AdagradConfig():
            return Adagrad(config)
        case AdamConfig():
            return Adam(config)
        case FTRLConfig():
            return FTRL(config)
        case _:
            assert_never(config)
