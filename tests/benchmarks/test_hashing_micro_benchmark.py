"""``benchmarks/hashing_micro.py`` on 2,000 rows, one timed call a part: every figure is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes


def test_build_batch_and_its_parts_report_their_rates(tmp_path: Path) -> None:
    args = ["--rows", "2000", "--repeats", "1", "--dedup-ids", "10000"]
    figures = run_benchmark("hashing_micro.py", tmp_path / "hashing.json", *args)
    assert (figures["rows"], figures["shared_table"]) == (2000, False)
    parts = ["build_batch", "hash", "bags_dedup", "dense_matrix", "label_matrix"]
    keys = [f"{p}_events_per_s" for p in parts]
    keys += ["dedup_10000_ids_s", "np_unique_10000_ids_s", "dedup_10000_vs_np_unique"]
    assert_positive(figures, [*keys, "unique_fraction"])
    assert figures["unique_fraction"] <= 1.0
