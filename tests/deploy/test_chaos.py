"""The chaos benchmark's short run: four SIGKILLs (a store shard, a Dask worker, the broker
and a serving replica), with the job served while it trains, from Tansu (the modern
protocol) with its log in a local S3 server.

``benchmarks/chaos.py`` runs a continuous `streamrec run` from a real local
Kafka while a producer writes, kills one component of each kind in a random
order, never restarts the job, and counts every offset from the ledger and the
consumer group. The long run (10 minutes, a kill every 30 s) is the benchmark
itself; this is the same script, short.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes


def test_four_kills_lose_nothing_learn_nothing_twice_and_serve_on(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/chaos.py",
            "--minutes",
            "4",
            # Each kill waits for the last one's recovery anyway: 2 s between them and
            # 1 s outages keep the run short without fewer kills or less checking.
            "--kill-every-s",
            "2",
            "--outage-s",
            "1",
            "--kills",
            "4",
            "--serve",
            "--rate",
            "600",
            "--seed",
            "1",
            # The modern broker, its log in the local S3 server: Kafka 0.9's broker kills
            # are tests/deploy/test_kafka_local.py's (a job carries on through them).
            "--broker",
            "tansu",
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    log = (tmp_path / "work" / "job.log").read_text(errors="replace")[-4000:]
    assert figures["kills"] == 4, figures
    assert figures["broker"] == "tansu"
    assert figures["kills_by_kind"] == {"shard": 1, "worker": 1, "broker": 1, "replica": 1}
    assert figures["recoveries"] == 4, (figures, log)
    assert figures["produced"] > 0
    assert figures["never_learned"] == 0, (figures, log)
    assert figures["learned_twice"] == 0, (figures, log)
    assert figures["learned_once"] == figures["produced"]
    assert figures["committed_equals_end"], (figures, log)
    assert figures["job_rollbacks"] == 1, (figures, log)  # the shard's
    assert figures["manual_restarts"] == 0
    assert figures["exit_code"] == 0, log
    assert figures["stop_reason"] == "signal", log
    # Served throughout: the killed replica's reads waited or got a 503 (retryable),
    # never a wrong or failed answer otherwise, and no server went back a version.
    assert figures["serve_requests"] > 100, figures
    assert set(figures["serve_failed_by_status"]) <= {"503"}, figures
    assert figures["serve_failed"] < figures["serve_requests"] * 0.05, figures
    assert figures["dense_versions_served"] > 1, figures
    assert figures["dense_version_backwards"] == 0, figures
