"""A job reading a modern-protocol broker, its trainer killed with SIGKILL mid-run and
started again.

On Tansu (record batches, the modern protocol): the second run resumes from the
newest checkpoint, rolls back what was learned after it, and the ledger shows
every offset of every partition learned exactly once, none skipped. On Kafka 0.9
the same holds across the chaos benchmark's kills (tests/deploy/test_chaos.py)
and a trainer killed in tests/trainer/test_job.py; CI's time is spent here on
the broker that had none.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np

from tests.conftest import REPO_ROOT, STREAMREC
from tests.deploy.test_job_ends import kafka_job, produce_in_blocks
from tests.kafka_fixtures import KafkaForTests
from tests.trainer.test_job import finish, kill_group, wait_for_checkpoint, wait_for_learned
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges

EVENTS = 3_000  # 1,500 per partition
BATCH = 100


def test_a_trainer_killed_mid_run_resumes_and_learns_every_offset_once(
    tmp_path: Path, tansu: KafkaForTests
) -> None:
    broker = tansu
    topic = broker.new_topic(partitions=2)
    produce_in_blocks(broker, topic, EVENTS, 100)
    job = kafka_job(tmp_path, broker.bootstrap, topic, mode="hybrid", staleness=3)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(job), "--max-events", str(EVENTS)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the test can kill all of it
    )
    try:
        wait_for_checkpoint(run_dir, 10, proc)
        wait_for_learned(run_dir, 14, proc)  # the kill lands between two checkpoints
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_group(proc)  # the orphaned store shards and Dask workers
    book = CheckpointBook(run_dir / "checkpoints")
    kept = book.latest()
    assert kept is not None
    assert 0 < kept.samples < EVENTS
    left = EVENTS - kept.samples
    again = subprocess.Popen(
        [*STREAMREC, "run", str(job), "--max-events", str(left)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        text = finish(again, timeout=180)
    finally:
        kill_group(again)
    assert f"resuming from checkpoint step {kept.step} " in text, text[-3000:]
    assert f"trained {left:,} samples" in text, text[-3000:]
    final = book.latest()
    assert final is not None
    assert final.samples == EVENTS
    assert final.positions == {f"{topic}/0": 1500, f"{topic}/1": 1500}
    ranges = learned_ranges(run_dir / "learned-rank0.log")
    for partition in (f"{topic}/0", f"{topic}/1"):
        covered = np.zeros(1500, dtype=np.int64)
        for s, e in ranges[partition]:
            covered[s:e] += 1
        assert covered.min() == 1, f"{partition}: an offset was never learned"
        assert covered.max() == 1, f"{partition}: an offset was learned twice"
