"""The "streamrec" page of the Dask dashboard, and the job's figures on ``/metrics``.

``StreamrecPlugin`` is a scheduler plugin: trainers and prediction servers
send their reports as Dask events on the ``streamrec`` topic (``Reporter`` and
``ServeReporter`` do it about once a second), the plugin folds them into a
``MonitorState``, and serves, from the
scheduler's own HTTP server (the dashboard's port, 8787 by default):

- ``/streamrec``: the live page (it asks for ``/streamrec/data.json`` once a
  second), also linked from the dashboard's menu bar;
- ``/streamrec/data.json``: the state, as the page reads it (``servers``: the
  prediction servers that reported, by URL);
- the ``streamrec_*`` metrics, added to the scheduler's existing ``/metrics``.

Register it once per cluster: ``client.register_plugin(StreamrecPlugin())``
(the job launcher does). Nothing in it polls: it only receives.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from importlib import resources
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from monitoring.prometheus import JobMetricsCollector
from monitoring.state import MonitorState
from monitoring.types import TOPIC

log = logging.getLogger(__name__)

PAGE = "streamrec"
# Reports Dask's event broker keeps on the topic (see _keep_few_events).
EVENTS_KEPT = 10


class _Handler(web.RequestHandler):
    def initialize(self, plugin: StreamrecPlugin) -> None:
        self.plugin = plugin


class _PageHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(self.plugin.page)


class _DataHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        snapshot = _finite(self.plugin.state.snapshot(now=time.time()))
        self.write(json.dumps(snapshot, allow_nan=False))


class StreamrecPlugin(SchedulerPlugin):
    """Receives the job's reports; serves the page, its data and the metrics."""

    name = PAGE
    idempotent = True  # every rank may register it; the first one stays

    def __init__(self, history: int = 3600) -> None:
        self.history = history
        self.state = MonitorState(history=history)
        self.page = ""
        self._collector: JobMetricsCollector | None = None

    async def start(self, scheduler: Any) -> None:
        self.state = MonitorState(history=self.history)
        self.page = resources.files("monitoring").joinpath("page.html").read_text("utf-8")
        app = getattr(scheduler, "http_application", None)
        if app is not None:
            # Tornado applications take handlers at any time: no restart, no config.
            app.add_handlers(
                r".*",
                [
                    (rf"/{PAGE}", _PageHandler, {"plugin": self}),
                    (rf"/{PAGE}/", web.RedirectHandler, {"url": f"/{PAGE}"}),
                    (rf"/{PAGE}/data\.json", _DataHandler, {"plugin": self}),
                ],
            )
        _add_to_dashboard_menu(scheduler)
        self._collector = JobMetricsCollector(self.state, time.time)
        _keep_few_events(scheduler, TOPIC, EVENTS_KEPT)
        # The scheduler's /metrics serves prometheus_client's default registry.
        from prometheus_client import REGISTRY

        REGISTRY.register(self._collector)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC:
            self.state.receive(msg)

    async def close(self) -> None:
        if self._collector is not None:
            from prometheus_client import REGISTRY

            REGISTRY.unregister(self._collector)
            self._collector = None


def _keep_few_events(scheduler: Any, topic: str, keep: int) -> None:
    """Have Dask's event broker keep only the last ``keep`` events of ``topic``.

    It keeps every topic's last ``distributed.admin.low-level-log-length`` (1,000)
    events for clients that ask for them. The plugin takes what it draws from a
    report as it arrives, so the broker's copies are only memory: a report is a
    few hundred objects, so a full topic holds tens of MB, and at a report every
    few seconds it keeps filling for the best part of an hour. A Dask whose broker has
    moved keeps its default.
    """
    topics = getattr(getattr(scheduler, "_broker", None), "_topics", None)
    try:
        held = topics[topic]  # type: ignore[index]  # a defaultdict: made if new
        held.events = deque(held.events, maxlen=keep)
    except Exception:  # Dask's internals moved: its default stays
        log.warning("could not bound Dask's history of the %r events; it keeps its own", topic)


def _finite(value: Any) -> Any:
    """NaN and infinities as None: JSON has no words for them (a diverged loss, say)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _add_to_dashboard_menu(scheduler: Any) -> None:
    """Put "streamrec" in the menu bar of the dashboard's Bokeh pages, when they exist."""
    try:
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # no Bokeh: no dashboard pages, the page itself still works
        return
    # Memoized per scheduler: the dict every dashboard page renders its menu from.
    pages = template_variables(scheduler)["pages"]
    if PAGE not in pages:
        pages.append(PAGE)
