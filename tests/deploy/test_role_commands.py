"""One entry point for every role: `streamrec store health`, `streamrec dask`, `streamrec torchrun`.

The container image runs `streamrec` for every role (its ENTRYPOINT); these are
the commands a Kubernetes pod gives it, run here as real processes.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deploy.local.kafka import free_port
from deploy.local.shards import ShardProcess
from tests.support.processes import REPO_ROOT, STREAMREC, streamrec


@pytest.mark.processes
def test_store_health_says_serving_and_why_not(
    write_job: Callable[..., Path],
    token_file: Path,
    start_shards: Callable[..., list[ShardProcess]],
    tmp_path: Path,
) -> None:
    (shard,) = start_shards(1, write_job(), token_file)
    ok = streamrec("store", "health", "--address", shard.address, "--token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    assert "SERVING 2 table(s)" in ok.stdout

    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    refused = streamrec("store", "health", "--address", shard.address, "--token-file", str(wrong))
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0, refused.stderr  # one line
    assert "UNAUTHENTICATED" in refused.stderr

    shard.kill()
    gone = streamrec("store", "health", "--address", shard.address, "--timeout", "2")
    assert gone.returncode == 1
    assert "UNAVAILABLE" in gone.stderr
    assert "Traceback" not in gone.stderr


@pytest.fixture
def scheduler() -> Iterator[str]:
    """`streamrec dask scheduler` on a free loopback port; yields its tcp:// address."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *STREAMREC,
            "dask",
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dashboard-address",
            ":0",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if re.search(r"Scheduler at:\s+tcp://127\.0\.0\.1:\d+", line):
                break
        else:
            pytest.fail(f"the scheduler ended with {proc.wait()}")
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.processes
def test_dask_scheduler_and_worker_through_the_streamrec_entry_point(scheduler: str) -> None:
    from distributed import Client

    worker = subprocess.Popen(
        [
            *STREAMREC,
            "dask",
            "worker",
            scheduler,
            "--nthreads",
            "1",
            "--name",
            "w-0",
            "--no-dashboard",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with Client(scheduler, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            names = [w["name"] for w in client.scheduler_info()["workers"].values()]
            assert names == ["w-0"]
            assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
    finally:
        worker.terminate()
        worker.wait(30)


@pytest.mark.processes
def test_torchrun_through_the_streamrec_entry_point_runs_the_training_module() -> None:
    """`streamrec torchrun ... -m deploy.cli ...` starts a rank of the stock torchrun."""
    out = streamrec(
        "torchrun",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "-m",
        "deploy.cli",
        "run",
        "--help",
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "usage: streamrec run" in out.stdout  # the rank ran `streamrec run --help`


def test_passthrough_commands_keep_every_argument() -> None:
    from deploy.cli import build_parser, stock_command

    argv = ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--dashboard-address", "8788"]
    assert stock_command(build_parser().parse_args(argv))[2:] == ["dask", *argv[1:]]
    argv = ["torchrun", "--nnodes", "2", "--rdzv-id", "ctr", "-m", "deploy.cli", "run", "j.yaml"]
    assert stock_command(build_parser().parse_args(argv))[2:] == [
        "torch.distributed.run",
        *argv[1:],
    ]
