"""A Dask worker's log without the tracebacks of a peer that hung up mid-transfer.

A worker sends a task's result to whoever asks for it (another worker, or a
trainer rank's client reading straight from the workers) and then waits for
the peer's "OK". A rank that is killed in between (the job restarts the world
from its newest checkpoint) leaves the worker logging "failed during get data"
at ERROR with a traceback, in the middle of the job's own output for local
workers. The loss is expected and recovered from: :class:`QuietLostPeers`
drops that record when its error is the peer's closed connection; every
other record, and that one for any other error, still shows.

>>> import logging
>>> from distributed.comm.core import CommClosedError
>>> keep = PeerHungUp()
>>> def record(msg, error):
...     return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg,
...                              ("a", "b"), (type(error), error, None))
>>> keep.filter(record("failed during get data with %s -> %s", CommClosedError("gone")))
False
>>> keep.filter(record("failed during get data with %s -> %s", TimeoutError("slow")))
True
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

LOGGER = "distributed.worker"
MESSAGE = "failed during get data"


class PeerHungUp(logging.Filter):
    """Drops Dask's "failed during get data" record when the peer closed the connection."""

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.comm.core import CommClosedError

        error = record.exc_info[1] if record.exc_info else None
        hung_up = isinstance(error, CommClosedError) and str(record.msg).startswith(MESSAGE)
        return not hung_up


class QuietLostPeers(WorkerPlugin):
    """Adds :class:`PeerHungUp` to each worker's log, those that join later included."""

    name = "streamrec-quiet-lost-peers"
    idempotent = True  # every rank may register it; the first one stays

    def __init__(self) -> None:
        self._filter = PeerHungUp()

    def setup(self, worker: Any) -> None:
        logging.getLogger(LOGGER).addFilter(self._filter)

    def teardown(self, worker: Any) -> None:
        logging.getLogger(LOGGER).removeFilter(self._filter)
