"""A job that names its services waits for them to answer, and refuses to start, in one
line, when they still do not or do not fit it.

Real `streamrec run` processes against real store shards (or none), as a user
on a cluster would meet them: a wrong address, a wrong token, another job's
store, shards that start after the job (as in Kubernetes, where trainers may
start before the stores have restored), or torchrun without the services named.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deploy.local.kafka import free_port
from deploy.local.shards import ShardProcess
from tests.support.jobs import write_job_yaml
from tests.support.processes import REPO_ROOT, STREAMREC

pytestmark = pytest.mark.processes


def run(job: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMREC, "run", str(job), "--max-time", "60"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in out.stderr.splitlines() if line.startswith("streamrec:")]
    assert len(lines) == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return lines[0]


def job_yaml(tmp_path: Path, tables: dict[str, Any], **cluster: Any) -> Path:
    return write_job_yaml(
        tmp_path / "job.yaml",
        store={"tables": tables, "row_dtype": "float32"},
        features={"labels": ["y"], "sparse": [{"name": "u", "table": "user"}]},
        source={"kind": "synthetic", "events": 1000},
        cluster={"dashboard_address": ":0", **cluster},
        run_dir=str(tmp_path / "run"),
    )


TABLES = {"user": {"dim": 8}}


def test_torchrun_without_named_services_says_what_to_set(tmp_path: Path) -> None:
    out = run(job_yaml(tmp_path, TABLES), RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
    assert out.returncode == 1
    line = one_line(out)
    assert "started by torchrun (RANK=1, WORLD_SIZE=2)" in line
    assert "set cluster.scheduler and cluster.store" in line


def test_a_scheduler_that_does_not_answer_is_waited_for_then_one_line(
    tmp_path: Path, write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    [shard] = start_shards(1, write_job(), token_file)
    dead = f"tcp://127.0.0.1:{free_port()}"
    job = job_yaml(
        tmp_path,
        {"user": {"dim": 8}, "item": {"dim": 4}},
        scheduler=dead,
        store=f"grpc://{shard.address}",
        token_file=str(token_file),
        wait_for_services_s=2,
    )
    out = run(job)
    assert out.returncode == 1
    line = one_line(out)
    assert f"cluster.scheduler {dead}: no Dask scheduler answers there" in line
    assert "waited 2s for it (cluster.wait_for_services_s)" in line
    assert "waiting for the services the job names" in out.stderr


def test_max_time_bounds_the_wait_for_services(tmp_path: Path, token_file: Path) -> None:
    """`--max-time 3` is kept while the job waits (for 300 s by default) for its store."""
    job = job_yaml(
        tmp_path,
        TABLES,
        store=f"grpc://127.0.0.1:{free_port()}",
        token_file=str(token_file),
    )
    started = time.monotonic()
    out = subprocess.run(
        [*STREAMREC, "run", str(job), "--max-time", "3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "(--max-time)" in one_line(out)
    assert time.monotonic() - started < 60


def test_a_job_waits_for_store_shards_that_start_after_it(
    tmp_path: Path, write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    """It used to fail at once with UNAVAILABLE: a trainer started before its stores."""
    port = free_port()
    job = job_yaml(
        tmp_path,
        {"user": {"dim": 8}, "item": {"dim": 4}},
        store=f"grpc://127.0.0.1:{port}",
        token_file=str(token_file),
        wait_for_services_s=120,
    )
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(job), "--max-time", "90"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The shard starts only once the job has found it missing and says it waits
        # (a refused connection fails an attempt at once; the job asks again every second).
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "waiting for the services the job names" in line:
                break
        assert proc.poll() is None, "".join(seen) + "".join(proc.communicate())
        late = ShardProcess.start(write_job(), tmp_path / "late", port=port, token_file=token_file)
        start_shards.track(late)
        out, rest = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + rest
    assert proc.returncode == 0, out + err
    assert "waiting for the services the job names" in err
    assert f"cluster.store shard 0 at 127.0.0.1:{port}: UNAVAILABLE" in err
    assert "stopped by end_of_stream" in out, out  # it ran, against the late shard


def test_a_store_of_other_tables_or_another_token_is_refused(
    tmp_path: Path, write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    shards = start_shards(2, write_job(), token_file)  # tables user (dim 8), item (dim 4)
    store = "grpc://" + ",".join(s.address for s in shards)
    other = job_yaml(tmp_path, {"user": {"dim": 16}}, store=store, token_file=str(token_file))
    line = one_line(run(other))
    assert f"cluster.store shard 0 at {shards[0].address} serves other tables" in line
    assert "user: job 16, shard 8" in line
    assert "item: job absent, shard 4" in line

    right = job_yaml(tmp_path, {"user": {"dim": 8}, "item": {"dim": 4}}, store=store)
    out = run(right, STREAMREC_STORE_TOKEN="not-the-token")
    assert out.returncode == 1
    assert "refuses the job's token" in one_line(out)

    count = job_yaml(
        tmp_path,
        {"user": {"dim": 8}, "item": {"dim": 4}},
        store=store,
        store_shards=3,
        token_file=str(token_file),
    )
    assert "cluster.store names 2 shard(s), cluster.store_shards says 3" in one_line(run(count))
