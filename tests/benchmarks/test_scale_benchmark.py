"""``benchmarks/scale.py`` at one size of 4M parameters on 2 shards, 16,384 samples, its
large tables tiered: a few thousand rows in memory, the rest on disk.

Every phase of a size runs (the tables sized and bulk-loaded, lookups and
pushes of the stream's batches and of uniform ids, hybrid training on the
loaded shards, the shards' memory, the tiers) and each figure is reported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes


def test_one_size_loads_serves_trains_and_reports(tmp_path: Path) -> None:
    args = ["--sizes", "4e6", "--shards", "2", "--samples", "16384", "--store-batches", "2"]
    args += ["--tiered", "4e6", "--memory-rows", "50000", "--rowwise", "--dir", str(tmp_path)]
    # Reports (the training clock's ticks) every 0.2 s: a sub-second run is still timed.
    args += ["--log-every-s", "0.2"]
    figures = run_benchmark("scale.py", tmp_path / "scale.json", *args)
    assert figures["params"] == [4_000_000]
    per_size = ["lookup_rows_per_s", "train_samples_per_s", "uniform_lookup_rows_per_s"]
    per_size += ["load_rows_per_s", "table_bytes_per_param", "rss_bytes_per_param"]
    # Over an idle shard's: serving and training grow a shard by far more than its tables.
    per_size += ["bytes_per_param", "bytes_vs_min"]
    assert_positive(figures, [*per_size, "min_bytes_per_param"])
    assert_positive(figures, ["throughput_1b_vs_10m", "store_1b_vs_10m"])
    (run,) = figures["runs"]
    # Every row of the tables was created by the bulk load, and every sample trained.
    assert run["rows"] == 4_000_000 // 16
    assert run["train_samples"] == 16384
    assert run["stopped_by"] == "max_events", run["stopped_by"]
    # Most rows live on disk, and the memory tier answered some of the lookups.
    assert run["tiered"] is True
    assert run["disk_rows"] > run["rows"] // 4, run
    assert 0 < run["train_hit_rate"] <= 1, run
    assert 0.0 < run["train_auc"] < 1.0
    assert figures["tiered_peak_rss_gib"] > 0
