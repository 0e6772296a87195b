"""WorkerTrim on a real cluster: a worker's metrics by span stay bounded.

A streaming job's tasks are all done for a moment many times a minute, and the
scheduler starts a new span for the next ones. Each worker adds up its tasks'
time by span and keeps every span's keys for as long as it lives: without the
plugin they grow with every span.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import pytest
from distributed import Client, wait

from pipeline.worker_memory import SPAN_CONTEXTS, WorkerTrim
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes


def span_keys_and_seconds(client: Client) -> dict[str, tuple[int, float]]:
    """Per worker: its metric keys by span, and the seconds its tasks ran on a thread."""

    def read(dask_worker: Any) -> tuple[int, float]:
        totals = dict(dask_worker.digests_total)
        by_span = [
            k
            for k in totals
            if isinstance(k, tuple) and len(k) > 2 and k[0] in SPAN_CONTEXTS and k[1] is not None
        ]
        seconds = sum(
            v
            for k, v in totals.items()
            if isinstance(k, tuple) and k[0] == "execute" and k[-2:] == ("thread-cpu", "seconds")
        )
        return len(by_span), float(seconds)

    return dict(client.run(read))


def bursts(client: Client, n: int, prefix: str) -> None:
    """``n`` rounds of tasks, each after the last one's are all done: a span each."""
    for b in range(n):
        keys = [f"{prefix}-{b}-{i}-ab12cd34" for i in range(4)]
        futures = [
            client.submit(sum, range(20_000 * (i + 1)), key=key, pure=False)
            for i, key in enumerate(keys)
        ]
        wait(futures, timeout=60)
        del futures
        time.sleep(0.02)


def spans(client: Client) -> int:
    return int(
        client.run_on_scheduler(
            lambda dask_scheduler: len(dask_scheduler.extensions["spans"].spans)
        )
    )


def test_a_worker_folds_its_metrics_by_span_and_keeps_their_totals() -> None:
    with dask_cluster() as client:
        before = spans(client)
        bursts(client, 40, "kept")
        assert spans(client) - before >= 40
        # Dask's own behaviour, which the plugin is for: keys for every span, kept.
        by_span = span_keys_and_seconds(client)
        assert sum(n for n, _ in by_span.values()) >= 40
        cpu_before = sum(s for _, s in by_span.values())

        client.register_plugin(WorkerTrim(every_s=0.1))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = span_keys_and_seconds(client)
            if all(n == 0 for n, _ in now.values()):
                break
            time.sleep(0.1)
        assert all(n == 0 for n, _ in now.values()), now
        # Folded, not dropped: the workers' thread time is all still there.
        assert sum(s for _, s in now.values()) >= cpu_before > 0

        bursts(client, 40, "trimmed")
        time.sleep(0.5)
        assert all(n <= 8 for n, _ in span_keys_and_seconds(client).values())

        def counts(dask_worker: Any) -> tuple[int, int]:
            plugin = dask_worker.plugins[WorkerTrim.name]
            return plugin.trims, plugin.span_keys_folded

        done = client.run(counts)
        assert all(trims > 0 for trims, _ in done.values())
        assert sum(folded for _, folded in done.values()) >= 40
        # The workers go on as before: new tasks, right answers.
        assert client.submit(operator.mul, 6, 7, pure=False).result() == 42
