"""The whole job as users run it (`streamrec run`), killed with SIGKILL and restarted.

Everything is real: the job process starts two store shard processes, a Dask
LocalCluster with worker processes, and trains. The trainer's acceptance
test: in ``mode: sync`` a run killed at a random point (the trainer,
a store shard or a Dask worker) and restarted ends with the same model, dense
weights and every embedding row, as an uninterrupted run; in ``mode: hybrid``
every offset is learned exactly once across the restart.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from connectors.synthetic import synthetic_store_section
from deploy.config import JobConfig, load_config
from embedding_store.shard import StoreShard
from monitoring.runs import load_run
from tests.support.jobs import (
    assert_learned_once,
    trainer_section,
    wait_for_checkpoint,
    wait_for_learned,
    write_synthetic_job,
    write_synthetic_training_job,
)
from tests.support.processes import finish, kill_group, start_job
from trainer.checkpoint import CheckpointBook
from trainer.run_files import parts_of, read_lines

pytestmark = pytest.mark.processes

EVENTS = 16_000
BATCH = 400  # 40 steps


def write_job(
    tmp: Path,
    mode: str,
    *,
    every_steps: int = 4,
    workers: int = 1,
    run_files: dict[str, Any] | None = None,
) -> Path:
    trainer = trainer_section(
        batch_size=BATCH,
        hidden=[32, 16],
        every_steps=every_steps,
        mode=mode,
        optimizer={"kind": "adam", "lr": 0.01},
    )
    if mode == "hybrid":
        trainer["staleness"] = 3
    if run_files is not None:
        trainer["run_files"] = run_files
    return write_synthetic_training_job(
        tmp,
        trainer=trainer,
        events=EVENTS,
        partitions=1,
        seed=11,
        cluster={"workers": workers, "store_shards": 2, "dashboard_address": ":0"},
    )


def final_model(job_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """The newest checkpoint's dense weights and every embedding row, by table."""
    job: JobConfig = load_config(job_path)
    book = CheckpointBook(job.run_dir / "checkpoints")
    manifest = book.latest()
    assert manifest is not None
    dense = book.load_dense(manifest)["ranks"][0]["model"]
    rows: dict[str, Any] = {}
    for i, seq in enumerate(manifest.shard_seqs):
        shard = StoreShard(job.store)
        shard.restore(job.run_dir / "store" / f"shard-{i:03d}", upto_seq=seq)
        for name, table in shard.tables.items():
            batch, _, _ = table.export(dirty_only=False, mark_clean=False)
            rows.setdefault(name, []).append(batch)
    merged = {}
    for name, parts in rows.items():
        ids = np.concatenate([p.ids for p in parts])
        order = np.argsort(ids)
        merged[name] = (
            ids[order],
            np.concatenate([p.weights for p in parts])[order],
            np.concatenate([p.state for p in parts])[order],
        )
    return dense, merged, manifest.samples


def assert_same_model(a: tuple[Any, Any, int], b: tuple[Any, Any, int]) -> None:
    dense_a, rows_a, samples_a = a
    dense_b, rows_b, samples_b = b
    assert samples_a == samples_b == EVENTS
    assert dense_a.keys() == dense_b.keys()
    for k in dense_a:
        torch.testing.assert_close(dense_a[k], dense_b[k], rtol=1e-5, atol=1e-6, msg=k)
    assert rows_a.keys() == rows_b.keys()
    for name in rows_a:
        ids_a, w_a, s_a = rows_a[name]
        ids_b, w_b, s_b = rows_b[name]
        np.testing.assert_array_equal(ids_a, ids_b, err_msg=name)
        np.testing.assert_allclose(w_a, w_b, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(s_a, s_b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, int]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = write_job(tmp, "sync")
    finish(start_job(job))
    return final_model(job)


def test_uninterrupted_sync_run_learns_every_event_once(
    uninterrupted: tuple[Any, Any, int],
) -> None:
    dense, rows, samples = uninterrupted
    assert samples == EVENTS
    assert len(rows) == 26
    assert all(len(r[0]) > 0 for r in rows.values())
    assert any(float(v.abs().sum()) > 0 for v in dense.values())


@pytest.mark.parametrize("victim", ["trainer", "store shard", "dask worker"])
def test_sync_run_killed_and_restarted_ends_with_the_same_model(
    tmp_path: Path, victim: str, uninterrupted: tuple[Any, Any, int]
) -> None:
    job = write_job(tmp_path, "sync", workers=2 if victim == "dask worker" else 1)
    run_dir = tmp_path / "run"
    proc = start_job(job)
    at = random.Random(victim).choice([4, 8, 12])
    wait_for_checkpoint(run_dir, at, proc)
    wait_for_learned(run_dir, at + 2, proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    shards = [c for c in children if "serve" in c.cmdline()]
    workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    if victim == "trainer":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The shards outlive the trainer long enough to persist what they hold,
        # rows newer than the job checkpoint included: the restart must roll back.
        _, alive = psutil.wait_procs(shards, timeout=60)
        assert not alive
        kill_group(proc)  # the orphaned Dask workers
        finish(start_job(job))
    elif victim == "store shard":
        shards[0].kill()
        # The job restarts the shard, rolls every shard back to its newest checkpoint
        # and goes on by itself.
        text = finish(proc)
        assert "recovered 1 time(s) from a lost store shard" in text, text[-3000:]
        assert re.search(r"store shard \d \(127\.0\.0\.1:\d+\) died \(signal 9\)", text), text
    else:
        workers[0].kill()
        finish(proc)  # a lost worker costs a retry, the job goes on
    assert_same_model(final_model(job), uninterrupted)


def test_hybrid_run_killed_and_restarted_learns_every_offset_once(tmp_path: Path) -> None:
    # Files rotated every few lines (a week's worth of a busy job, in miniature): the
    # restarted run appends to the last part, and the audit and the report read them all.
    max_bytes = 600
    job = write_job(tmp_path, "hybrid", run_files={"max_mb": max_bytes / 1e6, "keep": 100})
    run_dir = tmp_path / "run"
    proc = start_job(job)
    wait_for_checkpoint(run_dir, 8, proc)
    wait_for_learned(run_dir, 10, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    kill_group(proc)
    finish(start_job(job))
    assert_learned_once(run_dir, {"synthetic/0": EVENTS})
    for name in ("learned-rank0.log", "metrics-rank0.jsonl"):
        parts = parts_of(run_dir / name)
        assert len(parts) >= 3, f"{name} was not rotated: {parts}"
        longest = max(len(line) + 1 for line in read_lines(run_dir / name))
        for part in parts:
            assert part.stat().st_size <= max_bytes + longest, part
    # The report's last point (every part read, oldest first) is the end of the run.
    run = load_run(run_dir)
    assert run.ranks[0][-1].points[-1].samples_total == EVENTS


@pytest.mark.parametrize(("mode", "bound"), [("sync", 0), ("hybrid", 3)])
def test_observed_staleness_stays_within_the_bound(tmp_path: Path, mode: str, bound: int) -> None:
    """Every batch's lookup missed at most ``staleness`` pushes, across interleaved partitions."""
    trainer: dict[str, Any] = {
        "mode": mode,
        "batch_size": 250,
        "model": {"kind": "ffnn", "hidden": [16]},
        "torch_threads": 1,
        "log_every_s": 0.2,
        "checkpoint": {"enabled": False},
    }
    if mode == "hybrid":
        trainer["staleness"] = bound
    job = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4, row_dtype="float32"),
        # Partitions of unequal cost would let a batch be overtaken, were it allowed.
        source={"kind": "synthetic", "seed": 3, "partitions": 3, "events": 5_000},
        trainer=trainer,
        cluster={"workers": 2, "store_shards": 2, "dashboard_address": ":0"},
    )
    finish(start_job(job))
    last = (tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()[-1]
    report = json.loads(last)
    missed = {int(k): n for k, n in report["missed_pushes"].items()}
    assert sum(missed.values()) == report["step"] == 60  # every batch was measured
    assert max(missed) <= bound, missed
    if mode == "hybrid":
        assert max(missed) > 0, "hybrid lookups ran ahead of the pushes"
