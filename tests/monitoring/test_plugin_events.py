"""The streamrec plugin on a real scheduler: reports reach the page, Dask keeps few of them.

Dask's event broker keeps each topic's last 1,000 events; the job's reports are
about 22 KB each, so a full topic held 22 MB of a scheduler's memory that
nothing reads (the page takes what it needs as each report arrives).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from monitoring.plugin import EVENTS_KEPT, StreamrecPlugin
from monitoring.types import TOPIC, TrainerReport
from tests.support.processes import dask_cluster

pytestmark = pytest.mark.processes


def report(step: int) -> TrainerReport:
    return TrainerReport(
        kind="trainer", rank=0, time=time.time(), step=step, samples_total=10 * step,
        events_total=10 * step, loss=0.5, auc=0.7, logloss=0.5, calibration=1.0,
        best_auc=None, missed_pushes={"0": 0}, staleness_bound=2, pushes_queued=0,
        wait_s=0.1, compute_s=0.2, partitions={}, checkpoint=None, mode="hybrid",
    )  # fmt: skip


def test_reports_reach_the_page_and_dask_keeps_only_the_last_few() -> None:
    with dask_cluster() as client:
        client.register_plugin(StreamrecPlugin())
        for step in range(1, 41):
            client.log_event(TOPIC, report(step))

        def seen(dask_scheduler: Any) -> tuple[int, int]:
            plugin = dask_scheduler.plugins[StreamrecPlugin.name]
            snapshot = plugin.state.snapshot(now=time.time())
            kept = dask_scheduler.get_events(TOPIC)
            return snapshot["ranks"]["0"]["step"], len(kept)

        deadline = time.monotonic() + 20
        step, kept = client.run_on_scheduler(seen)
        while step < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
            step, kept = client.run_on_scheduler(seen)
        assert step == 40  # every report reached the page
        assert 0 < kept <= EVENTS_KEPT
