"""The end-to-end benchmark's short run: every trainer it compares, on a few batches.

``benchmarks/e2e.py`` trains the same stream with plain PyTorch, TorchRec
(FBGEMM's fused row-wise Adagrad), streamrec's trainer alone in one process
and streamrec's modes; its full run is the
benchmark. This runs the same script on 8 batches per mode so that none of
the paths it measures rots: each must train, score the stream better than
chance and write its figures. The first streamrec run starts its own Dask
cluster as in the full run, the later ones share one. No figure is compared
with a speed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes


def test_every_trainer_of_the_benchmark_trains_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/e2e.py",
            "--samples",
            "32768",
            "--window",
            "32768",
            "--modes",
            "baseline",
            "torchrec",
            "step",
            "sync",
            "hybrid",
            "--store-latency-ms",
            "2",
            # The latency pair with the small model only: the default model's pair is the
            # same path at another width, and each pair is two more jobs.
            "--skip-default-at-latency",
            # The streamrec runs after the first share one Dask cluster: a cluster's start
            # and its workers' first tasks take longer than these runs' training.
            "--share-cluster",
            # Reports (and so the clocks) every 0.2 s: a short run still has several.
            "--log-every-s",
            "0.2",
            "--report",
            "",
            "--json",
            str(out),
            "--quiet",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["errors"] == {}
    assert "torchrec_skipped" not in figures, figures.get("torchrec_skipped")
    keys = ["baseline", "torchrec", "step", "sync", "hybrid"]
    keys += ["sync_small_at_2ms", "hybrid_small_at_2ms"]
    for key in keys:
        assert figures[f"{key}_samples_per_s"] > 0, key
        # 32,768 samples of the synthetic stream: every trainer does better than chance
        # (the in-process ones start from a 0.5 output, streamrec's from the label rate).
        floor = 0.505 if key in ("baseline", "torchrec") else 0.6
        assert figures[f"{key}_auc"] > floor, (key, figures[f"{key}_auc"])
    assert figures["runs"]["hybrid_small_at_2ms"]["samples"] == 32768
    assert "hybrid_at_2ms" not in figures["runs"]
    ratios = ("hybrid_vs_torchrec", "hybrid_vs_baseline", "hybrid_vs_sync_small_at_2ms")
    for ratio in (*ratios, "step_vs_baseline", "step_vs_torchrec", "hybrid_vs_step"):
        assert (figures[ratio] or 0) > 0, ratio
    assert set(figures["targets"]) >= {"hybrid_vs_torchrec", "hybrid_vs_sync_small_at_2ms"}
    # The TorchRec baseline really ran FBGEMM's fused optimizer: no sparse step of its own.
    assert "sparse_step_s" not in figures["runs"]["torchrec"]["breakdown"]
    # The control beside each job mode's rate: the machine's busy cores and CPU per sample.
    for key in ("step", "sync", "hybrid", "hybrid_small_at_2ms"):
        machine = figures["runs"][key]["machine_cpu"]
        assert 0 < machine["busy_cores"] <= figures["cpus"] * 1.05, (key, machine)
        assert machine["cpu_ms_per_1k_samples"] > 0, (key, machine)
    assert figures["runs"]["baseline"]["breakdown"]["sparse_step_s"] > 0
    # The trainer alone trained every batch of the stream, in the job's loop.
    assert figures["runs"]["step"]["steps"] == 32768 // 4096
