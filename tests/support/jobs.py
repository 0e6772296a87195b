"""Job files the tests write, and what tests wait for and check in the runs they make."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tests.support.waits import wait_until

# The ``store.tables`` of the tests' store-only job files.
DEFAULT_TABLES: dict[str, Any] = {
    "user": {"dim": 8, "optimizer": {"kind": "adagrad", "lr": 0.1}, "capacity": 100_000},
    "item": {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}, "capacity": 100_000},
}


def write_job_yaml(path: Path, **sections: Any) -> Path:
    """Write a job YAML with these top-level sections; returns ``path``."""
    path.write_text(yaml.safe_dump(sections))
    return path


def write_store_job(path: Path, **store: Any) -> Path:
    """A job YAML of a ``store`` section only: :data:`DEFAULT_TABLES` in float32, ``store``
    keys added or replaced (what ``streamrec store serve`` needs)."""
    section = {"tables": DEFAULT_TABLES, "row_dtype": "float32", **store}
    return write_job_yaml(path, store=section)


def write_synthetic_job(tmp: Path, **sections: Any) -> Path:
    """``tmp/job.yaml``: the synthetic stream's features, ``run_dir`` ``tmp/run``, ``sections``."""
    from connectors.synthetic import synthetic_feature_spec

    features = synthetic_feature_spec().model_dump()
    return write_job_yaml(tmp / "job.yaml", features=features, run_dir=str(tmp / "run"), **sections)


# The trainer of the small jobs (:func:`write_small_job`): hybrid, checkpoints every 3 steps.
SMALL_TRAINER: dict[str, Any] = {
    "mode": "hybrid",
    "staleness": 2,
    "batch_size": 500,
    "model": {"kind": "ffnn", "hidden": [16]},
    "torch_threads": 1,
    "checkpoint": {"every_steps": 3, "every_s": None},
}


def write_small_job(tmp: Path, source: dict[str, Any]) -> Path:
    """A job reading ``source`` with :data:`SMALL_TRAINER` on 1 Dask worker and 1 store shard
    (4-wide rows): the job of the command tests and of the serving tests' trained model."""
    from connectors.synthetic import synthetic_store_section

    return write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4),
        source=source,
        trainer=SMALL_TRAINER,
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )


def trainer_section(
    *, batch_size: int, hidden: list[int], every_steps: int, **options: Any
) -> dict[str, Any]:
    """A small, quick trainer: an FFNN of ``hidden`` layers on one torch thread, progress
    every half second, a checkpoint every ``every_steps`` steps (none by time);
    ``options`` are further ``trainer`` keys (``mode``, ``ranks``, ...)."""
    return {
        "batch_size": batch_size,
        "model": {"kind": "ffnn", "hidden": hidden},
        "torch_threads": 1,
        "log_every_s": 0.5,
        "checkpoint": {"every_steps": every_steps, "every_s": None},
        **options,
    }


def write_synthetic_training_job(
    tmp: Path,
    *,
    trainer: dict[str, Any],
    events: int,
    partitions: int,
    seed: int,
    cluster: dict[str, Any] | None = None,
) -> Path:
    """A job learning ``events`` events per partition of the synthetic stream: 4-wide
    float32 rows, 1 Dask worker and 2 store shards unless ``cluster`` says otherwise."""
    from connectors.synthetic import synthetic_store_section

    return write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4, row_dtype="float32"),
        source={"kind": "synthetic", "seed": seed, "partitions": partitions, "events": events},
        trainer=trainer,
        cluster=cluster or {"workers": 1, "store_shards": 2, "dashboard_address": ":0"},
    )


def write_kafka_job(
    tmp: Path, bootstrap: str, topic: str, *, api_version: str = "auto", **trainer: Any
) -> Path:
    """A job reading ``topic`` (synthetic stream's records) on 2 Dask workers and 1 store
    shard; bad records to a file; ``trainer`` keys added to a batch-100 trainer."""
    from connectors.synthetic import synthetic_store_section

    return write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4),
        source={
            "kind": "kafka",
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": f"{topic}-trainer",
            "api_version": api_version,
            "deadletter": "file",
        },
        trainer=trainer_section(batch_size=100, hidden=[16], every_steps=10, **trainer),
        cluster={"workers": 2, "store_shards": 1, "dashboard_address": ":0"},
    )


def wait_for_checkpoint(
    run_dir: Path, step: int, proc: subprocess.Popen[str], timeout_s: float = 180
) -> None:
    """Until the job ``proc`` runs has a checkpoint at ``step`` or later; fails with the job's
    output if it ends first."""
    from trainer.checkpoint import CheckpointBook

    book = CheckpointBook(run_dir / "checkpoints")

    def reached() -> bool:
        m = book.latest()
        return m is not None and m.step >= step

    wait_until(
        reached,
        f"a checkpoint at step >= {step}",
        timeout_s=timeout_s,
        interval_s=0.01,
        procs=[proc],
        details=lambda: _output(proc),
    )


def wait_for_learned(
    run_dir: Path, step: int, proc: subprocess.Popen[str], timeout_s: float = 60
) -> None:
    """Until rank 0 has learned ``step`` steps (so that a kill lands between checkpoints)."""
    from trainer.run_files import read_lines

    ledger = run_dir / "learned-rank0.log"
    wait_until(
        lambda: len(read_lines(ledger)) >= step,
        f"step {step} learned",
        timeout_s=timeout_s,
        interval_s=0.005,
        procs=[proc],
    )


def assert_learned_once(run_dir: Path, ends: Mapping[str, int]) -> None:
    """The run learned each partition's ``[0, end)`` exactly once, over every rank's ledger
    and every restart, and its newest checkpoint stands at ``ends``."""
    from trainer.checkpoint import CheckpointBook
    from trainer.ledger import learned_ranges

    ranges = learned_ranges(*sorted(run_dir.glob("learned-rank*.log")))
    assert sorted(ranges) == sorted(ends)
    for partition, spans in ranges.items():
        covered = np.zeros(ends[partition], dtype=np.int64)
        for s, e in spans:
            covered[s:e] += 1
        assert covered.min() == 1, f"{partition}: an offset was never learned"
        assert covered.max() == 1, f"{partition}: an offset was learned twice"
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    assert final.samples == sum(ends.values())
    assert final.positions == dict(ends)


def _output(proc: subprocess.Popen[str]) -> str:
    """What an ended job wrote (its last 4,000 characters)."""
    if proc.poll() is None or proc.stdout is None:
        return "(its output comes when it ends)"  # reading a live pipe would block
    return proc.stdout.read()[-4000:]
