"""Finished Dask spans dropped from the scheduler, so that its memory stays flat for weeks.

Dask's scheduler keeps every span it ever made (``SpansSchedulerExtension``)
and, through each, the ``TaskGroup`` of every task the span saw, long after
the tasks are forgotten: spans have no lifetime yet (dask/distributed issue
7977). A batch job does not notice. A streaming job does: whenever all its
tasks are done for a moment, the scheduler starts a new default span for the
next ones, so spans and task groups pile up, and the scheduler's memory grows,
for as long as the job runs (``benchmarks/soak.py`` watches it).

:class:`SpanPruner` is a scheduler plugin that calls :func:`prune_spans` every
``every_s``: root spans beyond the newest ``keep``, done for ``min_age_s``,
whose task groups the scheduler has itself forgotten, are dropped with their
sub-spans (the dashboard's span views keep the newest ``keep``). A worker's
heartbeat carries metrics by span, and Dask's scheduler answers one naming a
span it lacks with a KeyError, on which the worker closes itself; so the
plugin also has the spans extension drop those metrics (counted in
``late_metrics``) instead.

>>> from types import SimpleNamespace as NS
>>> spans = [NS(id=i, done=i < 5, stop=10.0 * i, groups=set()) for i in range(6)]
>>> for s in spans:
...     s.traverse_spans = lambda s=s: iter([s])
>>> ext = NS(spans={s.id: s for s in spans}, root_spans=list(spans),
...          spans_search_by_name={("default",): list(spans)},
...          spans_search_by_tag={"default": list(spans)})
>>> prune_spans(ext, task_groups={}, keep=2, done_before=25.0)  # the newest 2 stay
3
>>> sorted(ext.spans), [s.id for s in ext.spans_search_by_tag["default"]]
([3, 4, 5], [3, 4, 5])
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pipeline.periodic import PeriodicPlugin


def _live(span: Any, task_groups: Mapping[str, Any]) -> bool:
    """Whether the scheduler still holds one of the span's task groups itself."""
    return any(task_groups.get(tg.name) is tg for tg in span.groups)


def prune_spans(ext: Any, task_groups: Mapping[str, Any], keep: int, done_before: float) -> int:
    """Drop the root spans of ``ext`` (a ``SpansSchedulerExtension``) older than the
    newest ``keep`` and done before ``done_before`` (their ``stop``), with their
    sub-spans, where none of their task groups is still one of the scheduler's
    ``task_groups``; return how many spans went.
    """
    roots = list(ext.root_spans)
    candidates = roots[: max(0, len(roots) - keep)]
    gone: set[str] = set()
    for root in candidates:
        tree = list(root.traverse_spans())
        if root.done and root.stop < done_before and not any(_live(s, task_groups) for s in tree):
            gone.update(s.id for s in tree)
    if not gone:
        return 0
    ext.root_spans[:] = [r for r in roots if r.id not in gone]
    for span_id in gone:
        ext.spans.pop(span_id, None)
    for index in (ext.spans_search_by_name, ext.spans_search_by_tag):
        for key in list(index):
            kept = [s for s in index[key] if s.id not in gone]
            if kept:
                index[key] = kept
            else:
                del index[key]
    return len(gone)


class SpanPruner(PeriodicPlugin):
    """Calls :func:`prune_spans` on its scheduler every ``every_s`` seconds."""

    name = "streamrec-span-pruner"
    doing = "pruning finished spans"

    def __init__(self, keep: int = 100, every_s: float = 30.0, min_age_s: float = 60.0) -> None:
        """``min_age_s``: a span is dropped once done this long, so that the metrics of
        its last tasks, which workers send with their next heartbeats (every second
        or so), still reach it; and no longer, since a streaming job starts spans
        every minute and each one kept holds its task groups."""
        super().__init__(every_s)
        self.keep = keep
        self.min_age_s = min_age_s
        self.dropped = 0
        self.late_metrics = 0  # heartbeat metrics of spans already dropped, not kept

    async def start(self, scheduler: Any) -> None:
        ext = scheduler.extensions.get("spans")
        if ext is not None and callable(getattr(ext, "heartbeat", None)):
            self._tolerate_dropped_spans(ext)
        await super().start(scheduler)

    def _tolerate_dropped_spans(self, ext: Any) -> None:
        """Metrics a heartbeat names by a span the pruner dropped are left out: Dask's
        extension raises a KeyError for them, and the worker then closes itself
        ("Unexpected exception during heartbeat. Closing worker."). For the
        scheduler's life: spans already dropped may be named after the plugin goes."""
        own = ext.heartbeat

        def heartbeat(ws: Any, data: dict[tuple[Any, ...], float]) -> None:
            known = {key: v for key, v in data.items() if key[1] in ext.spans}
            self.late_metrics += len(data) - len(known)
            own(ws, known)

        ext.heartbeat = heartbeat

    def tick(self) -> None:
        ext = self.scheduler.extensions.get("spans")
        if ext is None:  # a Dask without spans: nothing piles up
            return
        done_before = time.time() - self.min_age_s
        self.dropped += prune_spans(ext, self.scheduler.task_groups, self.keep, done_before)
