"""``bytes_at_capacity``: what a table's arrays hold at its capacity, checked against a
real table filled up to it (and past it: evictions keep it there)."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.table import EmbeddingTable, bytes_at_capacity
from embedding_store.types import AdagradConfig, CountMinAdmission, SGDConfig, TableConfig


@pytest.mark.parametrize(
    "config",
    [
        TableConfig(dim=16, capacity=5000, optimizer=AdagradConfig()),
        TableConfig(dim=8, capacity=3000, optimizer=SGDConfig(lr=0.1)),
        TableConfig(
            dim=4,
            capacity=2000,
            admission=CountMinAdmission(threshold=1, width=1024, depth=2),
        ),
    ],
)
def test_a_full_table_holds_no_more_than_its_size_at_capacity(config: TableConfig) -> None:
    table = EmbeddingTable("t", config)
    rng = np.random.default_rng(0)
    for _ in range(6):  # three times the capacity in new ids: full, then evicting
        table.lookup(rng.integers(1, 2**62, config.capacity // 2, dtype=np.uint64), train=True)
    table.remove(rng.integers(1, 2**62, 10, dtype=np.uint64))
    assert len(table) == config.capacity
    assert table.memory_bytes <= bytes_at_capacity(config)
    # The bound is close: only the free list is counted at its worst.
    assert table.memory_bytes >= 0.85 * bytes_at_capacity(config)
