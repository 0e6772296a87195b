"""SchedulerTrim on a real cluster: the scheduler's cache of task names stays bounded.

Every task of a streaming job has a key of its own, and Dask caches the name it
splits from each (``dask.utils.key_split``, up to 100,000 of them): without the
plugin the cache grows with every task the scheduler is given.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import pytest
from distributed import Client, wait

from pipeline.scheduler_memory import SchedulerTrim
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes


def key_names(client: Client) -> int:
    def size(dask_scheduler: Any) -> int:
        from dask.utils import key_split

        return int(key_split.cache_info().currsize)

    return int(client.run_on_scheduler(size))


def tasks(client: Client, n: int, prefix: str) -> None:
    """``n`` tasks with keys of their own, as a runner's chunks have."""
    futures = [
        client.submit(operator.add, i, 1, key=f"{prefix}-part-{i}-{i + 1}-ab12cd34", pure=False)
        for i in range(n)
    ]
    wait(futures, timeout=60)
    assert [f.result() for f in futures] == [i + 1 for i in range(n)]


def test_the_scheduler_forgets_the_names_of_its_finished_tasks() -> None:
    with dask_cluster() as client:
        before = key_names(client)
        tasks(client, 300, "kept")
        # Dask's own behaviour, which the plugin is for: a cached name per task.
        assert key_names(client) - before >= 300

        client.register_plugin(SchedulerTrim(every_s=0.1, key_cache_limit=100))
        tasks(client, 300, "trimmed")
        deadline = time.monotonic() + 20
        while key_names(client) > 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert key_names(client) <= 100

        def counts(dask_scheduler: Any) -> tuple[int, int]:
            plugin = dask_scheduler.plugins[SchedulerTrim.name]
            return plugin.trims, plugin.key_names_dropped

        trims, dropped = client.run_on_scheduler(counts)
        assert trims > 0
        assert dropped >= 300
        # The scheduler goes on as before: new tasks, right answers.
        assert client.submit(operator.mul, 6, 7, pure=False).result() == 42
