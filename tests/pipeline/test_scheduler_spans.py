"""A Dask scheduler that runs a stream of small computations keeps a span, and its task
groups, for each burst of them for ever; the span pruner keeps the newest few.

A real LocalCluster (its scheduler in this process, two worker processes), as
the job's local cluster is: rounds of one task each, each waited for, as a
streaming job's chunks come when the last ones are done.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import pytest
from distributed import Client

from pipeline.scheduler_spans import SpanPruner
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes


def spans(client: Client) -> int:
    def count(dask_scheduler: Any) -> int:
        return len(dask_scheduler.extensions["spans"].spans)

    return int(client.run_on_scheduler(count))


def rounds(client: Client, n: int, prefix: str) -> None:
    """``n`` rounds of one task, each of a task group of its own (as a job's chunks of
    another range: ``prepare-<chunk>-<start>-<end>-<token>``), each waited for."""
    for i in range(n):
        key = (f"{prefix}-round{chr(97 + i // 26)}{chr(97 + i % 26)}", 0)
        client.submit(operator.add, i, 1, key=key, pure=False).result()


def test_finished_spans_are_dropped_and_live_ones_kept() -> None:
    with dask_cluster() as client:
        before = spans(client)
        rounds(client, 30, "unpruned")
        # Dask's own behaviour, which the pruner is for: a new span for every round.
        assert spans(client) - before >= 25

        client.register_plugin(SpanPruner(keep=3, every_s=0.1, min_age_s=3.0))
        held = client.submit(operator.add, 1, 1, key="held-1", pure=False)
        assert held.result() == 2  # its result stays in memory: its task group is live
        rounds(client, 30, "pruned")
        deadline = time.monotonic() + 40
        while spans(client) > 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        # The newest 3, and the held task's (the scheduler still holds its group).
        assert spans(client) <= 4

        def held_span_kept(dask_scheduler: Any) -> bool:
            group = dask_scheduler.tasks["held-1"].group
            return group.span_id in dask_scheduler.extensions["spans"].spans

        assert client.run_on_scheduler(held_span_kept)
        # The scheduler goes on as before: new work, new spans, right answers.
        assert client.submit(operator.mul, 6, 7, pure=False).result() == 42
        del held


def test_a_heartbeat_naming_a_dropped_span_does_not_close_its_worker() -> None:
    """Spans dropped as soon as they are done: a worker's next heartbeat still names the
    span of the task it just ran. Dask's scheduler answered it with a KeyError, on
    which the worker closed itself ("Unexpected exception during heartbeat. Closing
    worker.", seen with an earlier pruner); the pruner has those metrics dropped."""
    with dask_cluster() as client:
        workers = set(client.scheduler_info()["workers"])
        client.register_plugin(SpanPruner(keep=0, every_s=0.05, min_age_s=0.0))
        rounds(client, 40, "eager")  # each round's future is released at once
        time.sleep(2)  # a few more heartbeats, each worker's every 0.5 s

        def late(dask_scheduler: Any) -> tuple[int, int]:
            pruner = dask_scheduler.plugins[SpanPruner.name]
            return pruner.late_metrics, pruner.dropped

        late_metrics, dropped = client.run_on_scheduler(late)
        assert dropped >= 30
        assert late_metrics > 0  # the race this is about did happen
        assert set(client.scheduler_info()["workers"]) == workers  # none closed
        assert client.submit(operator.mul, 6, 7, pure=False).result() == 42
