"""Fixtures of the pipeline tests: a Dask cluster of worker processes, store shard processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from distributed import Client

from deploy.local.shards import ShardProcess
from pipeline.prepare import StoreAddress
from tests.support.jobs import write_job_yaml
from tests.support.processes import dask_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Client]:
    """A LocalCluster of 2 worker processes (1 thread each), one per test module."""
    with dask_cluster() as client:
        yield client


@pytest.fixture(scope="module")
def start_store(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[dict[str, Any]], StoreAddress]]:
    """``start_store(section)``: one store shard process serving a job's ``store:`` section.

    It runs with a token; every shard started is killed at the end of the module.
    """
    started: list[ShardProcess] = []

    def start(section: dict[str, Any]) -> StoreAddress:
        tmp = tmp_path_factory.mktemp("store")
        job = write_job_yaml(tmp / "job.yaml", store=section)
        token = tmp / "token"
        token.write_text("runner-test-token")
        proc = ShardProcess.start(job, tmp / "shard-0", token_file=token)
        started.append(proc)
        return StoreAddress(f"grpc://{proc.address}", token="runner-test-token")

    yield start
    for proc in started:
        proc.kill()
