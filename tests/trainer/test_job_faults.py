"""Faults in a job of two trainer ranks (`trainer.ranks: 2`), as users run it.

A store shard killed with SIGKILL is restarted by the job, both ranks roll
back to the newest checkpoint together and the job ends by itself with every
offset learned once. A trainer rank killed with SIGKILL is started again with
the other ranks, from the newest checkpoint, and again the job ends by itself
with every offset learned once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from connectors.synthetic import synthetic_store_section
from tests.conftest import REPO_ROOT, STREAMREC, write_synthetic_job
from tests.trainer.test_job import wait_for_checkpoint
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges

EVENTS = 6_000  # per partition
PARTITIONS = 2
BATCH = 200


def write_job(tmp: Path, cluster: dict[str, Any] | None = None, ranks: int = 2) -> Path:
    """The two-rank job of these tests; ``cluster``: another cluster section (services)."""
    trainer: dict[str, Any] = {
        "mode": "hybrid",
        "staleness": 2,
        "ranks": ranks,
        "batch_size": BATCH,
        "model": {"kind": "ffnn", "hidden": [16]},
        "torch_threads": 1,
        "log_every_s": 0.5,
        "checkpoint": {"every_steps": 4, "every_s": None},
    }
    return write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4, row_dtype="float32"),
        source={"kind": "synthetic", "seed": 4, "partitions": PARTITIONS, "events": EVENTS},
        trainer=trainer,
        cluster=cluster or {"workers": 1, "store_shards": 2, "dashboard_address": ":0"},
    )


def start(job: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*STREAMREC, "run", str(job)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def children(proc: subprocess.Popen[str], marker: str) -> list[psutil.Process]:
    found = []
    for c in psutil.Process(proc.pid).children(recursive=True):
        try:
            if marker in " ".join(c.cmdline()):
                found.append(c)
        except psutil.NoSuchProcess:
            continue
    return found


def rank_process(proc: subprocess.Popen[str], rank: int) -> psutil.Process:
    """The spawned process of trainer rank ``rank``: the one writing its ledger."""
    for c in psutil.Process(proc.pid).children():
        try:
            if any(f.path.endswith(f"learned-rank{rank}.log") for f in c.open_files()):
                return c
        except psutil.NoSuchProcess:
            continue
    pytest.fail(f"no process of rank {rank} among the job's children")


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def kill_leftovers(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def assert_every_offset_learned_once(run_dir: Path) -> None:
    ranges = learned_ranges(*sorted(run_dir.glob("learned-rank*.log")))
    assert sorted(ranges) == [f"synthetic/{p}" for p in range(PARTITIONS)]
    for partition, spans in ranges.items():
        covered = np.zeros(EVENTS, dtype=np.int64)
        for s, e in spans:
            covered[s:e] += 1
        assert covered.min() == 1, f"{partition}: an offset was never learned"
        assert covered.max() == 1, f"{partition}: an offset was learned twice"
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    assert final.samples == EVENTS * PARTITIONS
    assert final.positions == {f"synthetic/{p}": EVENTS for p in range(PARTITIONS)}


def test_a_killed_store_shard_is_healed_in_a_two_rank_job(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    proc = start(job)
    try:
        wait_for_checkpoint(run_dir, 4, proc)
        shards = children(proc, "serve")
        assert len(shards) == 2
        shards[1].kill()
        code, out = finish(proc)
    finally:
        kill_leftovers(proc)
    assert code == 0, out[-4000:]
    assert "recovered 1 time(s) from a lost store shard" in out, out[-4000:]
    # Both ranks' samples, net of what the rollback took back.
    assert f"trained {EVENTS * PARTITIONS:,} samples in " in out, out[-4000:]
    assert_every_offset_learned_once(run_dir)


def test_a_killed_trainer_rank_is_started_again_and_the_job_goes_on(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    proc = start(job)
    try:
        wait_for_checkpoint(run_dir, 4, proc)
        victim = rank_process(proc, 1)  # rank 0 is the job process itself
        victim.kill()
        code, out = finish(proc)
    finally:
        kill_leftovers(proc)
    assert code == 0, out[-4000:]
    assert f"streamrec-rank-1 (pid {victim.pid}, killed by SIGKILL) ended the world" in out, out[
        -4000:
    ]
    assert "starting the 2 rank(s) again from the newest checkpoint" in out, out[-4000:]
    assert "started the trainer ranks again 1 time(s)" in out, out[-4000:]
    # The summary is the whole run's: the first life's checkpointed work included.
    assert f"trained {EVENTS * PARTITIONS:,} samples in " in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert_every_offset_learned_once(run_dir)
