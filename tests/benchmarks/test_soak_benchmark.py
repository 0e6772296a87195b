"""``benchmarks/soak.py`` at its tiniest: two backlogs, 9 s at a steady rate, every figure.

The whole script runs as in its hour-long run (a local Kafka 0.9 broker, the
producer, ``streamrec run`` with checkpoints on a clock), with a 2,000-event
backlog (twice), samples every 1.5 s, a 3 s warm-up and 3.6 s windows. Every offset must
be learned once; no figure is compared with a bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_benchmark
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes


def test_a_short_soak_learns_every_offset_once_and_reports_every_figure(tmp_path: Path) -> None:
    # 9 s: two whole 3.6 s windows and a sample after the second one ends, with room for
    # samples that come late on a loaded machine.
    args = ["--minutes", "0.15", "--warmup-minutes", "0.05", "--window-minutes", "0.06"]
    args += ["--sample-s", "1.5", "--capacity-events", "2000", "--pool-events", "4000"]
    args += ["--checkpoint-s", "4"]
    args += ["--work-dir", str(tmp_path / "work"), "--table-rows", "2048"]
    figures = run_benchmark("soak.py", tmp_path / "soak.json", *args, timeout=300)
    assert figures["exit_code"] == 0
    assert figures["table_rows"] == 2048
    assert figures["produced"] > 4000  # two backlogs, then the steady phase
    assert figures["learned_once"] == figures["produced"]
    assert figures["learned_twice"] == figures["never_learned"] == 0
    assert figures["capacity_events_per_s"] > 0
    assert figures["capacity_alone_events_per_s"] > 0
    assert 0 < figures["rate"] < figures["capacity_events_per_s"]
    assert figures["rate_achieved"] > 0
    growth = figures["rss_growth_pct_after_warmup"]
    assert set(growth) == {"job", "shard", "worker", "scheduler", "broker"}
    assert all(isinstance(v, float | int) for v in growth.values()), growth
    assert all(figures["rss_mb_by_role"][role] > 0 for role in growth)
    assert set(figures["rss_growth_pct_two_samples"]) == set(growth)
    assert set(figures["disk_bytes_by_kind"]["end"]) == {"checkpoints", "store", "run_dir_rest"}
    assert figures["disk_bytes_by_kind"]["end"]["checkpoints"] > 0
    assert figures["disk_bytes_first_vs_last"] > 0
    # A loaded machine may learn nothing in a 4 s window: no rate is compared here.
    assert len(figures["windows"]) >= 2
    assert all(w["events_per_s"] >= 0 for w in figures["windows"])
    for w in figures["windows"]:
        assert set(w["cores"]) == {"job", "shard", "worker", "scheduler", "broker", "producer"}
        assert w["cores"]["job"] > 0, w
        assert w["cores"]["producer"] > 0, w
        assert set(w["cpu_ms_per_event"]) == set(w["cores"]), w
    assert "throughput_last_vs_first_window" in figures
    assert figures["lag_max_s"] >= 0
    assert all(t["met"] in (True, False) for t in figures["targets"].values())
    assert len(figures["samples"]) >= 5


def test_windows_are_whole_and_rates_are_per_second() -> None:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import soak
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    samples = [{"t": t + 0.1, "learned": 10 * t} for t in range(0, 32, 3)]
    windows = soak.windows_of(samples, 0, 10)
    assert [w["from_s"] for w in windows] == [0, 10, 20]  # 30-40 is not whole
    assert [round(w["events_per_s"], 6) for w in windows] == [10.0, 10.0, 10.0]
    assert round(soak.growth_pct({1: 100, 2: 200}, {1: 110, 2: 200, 3: 999}) or 0, 9) == 10.0
    assert soak.growth_pct({1: 100}, {2: 100}) is None  # no process lived through both
    # Peaks per window, per process: a sawtooth that does not rise is no growth.
    saw = [
        {"t": t, "rss": {"shard": {"7": 100 + 20 * (t % 3 == 0)}, "job": {"8": 50}}}
        for t in range(12)
    ]
    assert soak.rss_peaks_growth(saw, warmup_s=2, window_s=4) == {"job": 0.0, "shard": 0.0}
    saw[-1]["rss"]["shard"]["7"] = 180
    assert soak.rss_peaks_growth(saw, warmup_s=2, window_s=4)["shard"] == 50.0
    saw[-1]["rss"]["job"] = {"9": 80}  # a process of the last window alone: its own peak
    assert soak.rss_peaks_growth(saw, warmup_s=2, window_s=4)["job"] == 0.0
