"""Fixtures that run the real thing: store shard processes on free loopback ports.

Also the helpers tests in several folders share: job YAML writers and ``streamrec``.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.local.kafka import REPO_ROOT
from deploy.local.shards import ShardProcess

pytest_plugins = ["tests.kafka_fixtures", "tests.s3_fixtures"]

# Shared check helpers: pytest rewrites their asserts too, so failures show the values.
pytest.register_assert_rewrite("tests.connectors.contract", "tests.connectors.bad_records")

DEFAULT_TABLES: dict[str, Any] = {
    "user": {"dim": 8, "optimizer": {"kind": "adagrad", "lr": 0.1}, "capacity": 100_000},
    "item": {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}, "capacity": 100_000},
}
# The ``streamrec`` command of this checkout (what the console script runs).
STREAMREC = [sys.executable, "-m", "deploy.cli"]


def streamrec(
    *args: str, timeout: float = 240, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``streamrec <args>`` from the repository root; stdout and stderr come back as text."""
    return subprocess.run(
        [*STREAMREC, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def write_job_yaml(path: Path, **sections: Any) -> Path:
    """Write a job YAML with these top-level sections; returns ``path``."""
    path.write_text(yaml.safe_dump(sections))
    return path


def write_synthetic_job(tmp: Path, **sections: Any) -> Path:
    """``tmp/job.yaml``: the synthetic stream's features, ``run_dir`` ``tmp/run``, ``sections``."""
    from connectors.synthetic import synthetic_feature_spec

    features = synthetic_feature_spec().model_dump()
    return write_job_yaml(tmp / "job.yaml", features=features, run_dir=str(tmp / "run"), **sections)


@pytest.fixture
def write_job(tmp_path: Path) -> Callable[..., Path]:
    """Write a job YAML with a ``store`` section; returns its path."""

    def write(name: str = "job.yaml", **store: Any) -> Path:
        section = {"tables": DEFAULT_TABLES, "row_dtype": "float32", **store}
        return write_job_yaml(tmp_path / name, store=section)

    return write


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(secrets.token_hex(16) + "\n")
    return path


@pytest.fixture
def start_shards(tmp_path: Path) -> Iterator[Callable[..., list[ShardProcess]]]:
    """Start N ``streamrec store serve`` processes; all are killed at teardown."""
    started: list[ShardProcess] = []

    def start(
        n: int,
        config: Path,
        token_file: Path | None,
        prefix: str = "shard",
        allow_dirs: tuple[Path, ...] = (),
    ) -> list[ShardProcess]:
        procs = [
            ShardProcess.start(
                config, tmp_path / f"{prefix}-{i}", token_file=token_file, allow_dirs=allow_dirs
            )
            for i in range(n)
        ]
        started.extend(procs)
        return procs

    start.track = started.append  # type: ignore[attr-defined]  # for restarted shards
    yield start
    for p in started:
        p.kill()


def grpc_address(procs: list[ShardProcess]) -> str:
    return "grpc://" + ",".join(p.address for p in procs)
