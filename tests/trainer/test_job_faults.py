"""Faults in a job of two trainer ranks (`trainer.ranks: 2`), as users run it.

A store shard killed with SIGKILL is restarted by the job, both ranks roll
back to the newest checkpoint together and the job ends by itself with every
offset learned once. A trainer rank killed with SIGKILL is started again with
the other ranks, from the newest checkpoint, and again the job ends by itself
with every offset learned once.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.jobs import (
    assert_learned_once,
    trainer_section,
    wait_for_checkpoint,
    write_synthetic_training_job,
)
from tests.support.processes import finish, kill_group, start_job

pytestmark = pytest.mark.processes

EVENTS = 6_000  # per partition
PARTITIONS = 2
BATCH = 200


def write_job(tmp: Path, cluster: dict[str, Any] | None = None, ranks: int = 2) -> Path:
    """The two-rank job of these tests; ``cluster``: another cluster section (services)."""
    return write_synthetic_training_job(
        tmp,
        trainer=trainer_section(
            batch_size=BATCH, hidden=[16], every_steps=4, mode="hybrid", staleness=2, ranks=ranks
        ),
        events=EVENTS,
        partitions=PARTITIONS,
        seed=4,
        cluster=cluster,
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


# Every partition to its end (the jobs here end by themselves at the stream's end).
ENDS = {f"synthetic/{p}": EVENTS for p in range(PARTITIONS)}


def test_a_killed_store_shard_is_healed_in_a_two_rank_job(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    proc = start_job(job)
    try:
        wait_for_checkpoint(run_dir, 4, proc)
        shards = children(proc, "serve")
        assert len(shards) == 2
        shards[1].kill()
        out = finish(proc, timeout=300)
    finally:
        kill_group(proc)
    assert "recovered 1 time(s) from a lost store shard" in out, out[-4000:]
    # Both ranks' samples, net of what the rollback took back.
    assert f"trained {EVENTS * PARTITIONS:,} samples in " in out, out[-4000:]
    assert_learned_once(run_dir, ENDS)


def test_a_killed_trainer_rank_is_started_again_and_the_job_goes_on(tmp_path: Path) -> None:
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    proc = start_job(job)
    try:
        wait_for_checkpoint(run_dir, 4, proc)
        victim = rank_process(proc, 1)  # rank 0 is the job process itself
        victim.kill()
        out = finish(proc, timeout=300)
    finally:
        kill_group(proc)
    assert f"streamrec-rank-1 (pid {victim.pid}, killed by SIGKILL) ended the world" in out, out[
        -4000:
    ]
    assert "starting the 2 rank(s) again from the newest checkpoint" in out, out[-4000:]
    assert "started the trainer ranks again 1 time(s)" in out, out[-4000:]
    # The summary is the whole run's: the first life's checkpointed work included.
    assert f"trained {EVENTS * PARTITIONS:,} samples in " in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert_learned_once(run_dir, ENDS)
