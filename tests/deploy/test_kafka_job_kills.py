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
from pathlib import Path

import pytest

from tests.support.jobs import (
    assert_learned_once,
    wait_for_checkpoint,
    wait_for_learned,
    write_kafka_job,
)
from tests.support.kafka import KafkaForTests, produce_in_blocks
from tests.support.processes import finish, kill_group, start_job
from trainer.checkpoint import CheckpointBook

pytestmark = pytest.mark.processes

EVENTS = 3_000  # 1,500 per partition
BATCH = 100


def test_a_trainer_killed_mid_run_resumes_and_learns_every_offset_once(
    tmp_path: Path, tansu: KafkaForTests
) -> None:
    broker = tansu
    topic = broker.new_topic(partitions=2)
    produce_in_blocks(broker, topic, EVENTS, 100)
    job = write_kafka_job(tmp_path, broker.bootstrap, topic, mode="hybrid", staleness=3)
    run_dir = tmp_path / "run"
    proc = start_job(job, "--max-events", str(EVENTS))
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
    again = start_job(job, "--max-events", str(left))
    try:
        text = finish(again, timeout=180)
    finally:
        kill_group(again)
    assert f"resuming from checkpoint step {kept.step} " in text, text[-3000:]
    assert f"trained {left:,} samples" in text, text[-3000:]
    assert_learned_once(run_dir, {f"{topic}/0": 1500, f"{topic}/1": 1500})
