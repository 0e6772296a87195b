"""``benchmarks/tiers.py`` on 100,000 rows and a 32 MiB disk file: every figure.

The disk's random reads, the two engines, the fill, hit rates against the best
for each Zipf exponent, the tier against memory alone, the hot set and the drift.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes


def test_every_tier_figure_is_reported(tmp_path: Path) -> None:
    args = ["--rows", "100000", "--batches", "10", "--warm-batches", "10", "--batch", "2048"]
    args += ["--engine-rows", "20000", "--disk-mib", "32", "--disk-reads", "1000"]
    args += ["--drift-every", "4", "--dir", str(tmp_path)]
    figures = run_benchmark("tiers.py", tmp_path / "tiers.json", *args)
    assert (figures["rows"], figures["memory_rows"]) == (100_000, 20_000)
    keys = ["disk_iops_qd1", "disk_iops_qd16", "fill_rows_per_s", "tier_hot_vs_memory"]
    for engine in ("rocksdb", "buckets"):
        keys += [f"engine_{engine}_reads_per_s", f"engine_{engine}_misses_per_s"]
    for alpha in ("0p8", "1p05", "1p2"):
        keys += [f"hit_rate_{alpha}", f"best_hit_rate_{alpha}", f"tier_vs_memory_{alpha}"]
        keys += [f"tier_samples_per_s_{alpha}", f"memory_samples_per_s_{alpha}"]
        # Misses read the table files: a run that never touched the disk measured memory.
        assert figures[f"disk_reads_{alpha}"] > 0, alpha
    keys += ["hit_rate_drift", "miss_path_vs_disk_iops", "resident_mib"]
    assert_positive(figures, keys)
    assert all(0 < figures[f"best_hit_rate_{a}"] <= 1 for a in ("0p8", "1p05", "1p2"))
    assert set(figures["targets"]) >= {"tier_hot_vs_memory >= 0.9"}
    assert not list(tmp_path.glob("streamrec-tiers-*")), "the scratch folder is removed"
