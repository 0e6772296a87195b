"""Sparse row optimizers, one module per strategy, all behind ``RowOptimizer``.

>>> import numpy as np
>>> from embedding_store.types import AdagradConfig
>>> opt = make_optimizer(AdagradConfig(lr=0.5))
>>> w = np.ones((2, 2), np.float32)
>>> s = np.zeros((2, opt.state_width(2)), np.float32)
>>> opt.apply(w, s, np.zeros(2, np.int64), np.array([0, -1]), np.full((2, 2), 0.5, np.float32))
>>> w.astype(float).round(3).tolist()  # row 0 moved by lr * g / |g|; row 1 was skipped
[[0.5, 0.5], [1.0, 1.0]]
"""

from __future__ import annotations

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
    """The optimizer a table's config names."""
    match config:
        case SGDConfig():
            return SGD(config)
        case AdagradConfig():
            return Adagrad(config)
        case AdamConfig():
            return Adam(config)
        case FTRLConfig():
            return FTRL(config)
    msg = f"unknown optimizer config {config!r}"  # pragma: no cover - the union is closed
    raise TypeError(msg)
