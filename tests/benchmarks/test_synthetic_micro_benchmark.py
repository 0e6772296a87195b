"""``benchmarks/synthetic_micro.py`` on two chunks of 1,000 events: every figure is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes


def test_the_synthetic_source_reports_its_rates(tmp_path: Path) -> None:
    args = ["--chunk-size", "1000", "--chunks", "2", "--json-events", "500"]
    figures = run_benchmark("synthetic_micro.py", tmp_path / "synthetic.json", *args)
    assert figures["chunk_size"] == 1000
    keys = ["read_events_per_s", "read_events_per_s_min", "json_lines_per_s", "best_auc"]
    assert_positive(figures, keys)
    assert 0.5 < figures["best_auc"] < 1.0
