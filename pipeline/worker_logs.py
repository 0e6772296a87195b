"""A Dask worker's log without the tracebacks of a peer that hung up mid-transfer.

A worker sends a task's result to whoever asks for it (another worker, or a
trainer rank's client reading straight from the workers) and then waits for
the peer's "OK". A rank that is killed in between (the job restarts the world
from its newest checkpoint) leaves the worker logging "failed during get data"
at ERROR with a traceback, in the middle of the job's own output for local
workers. The loss is expected and recovered from: :class:`QuietLostPeers`
drops that record when its error is the peer's closed connection; every
other record, and that one for any other error, still shows. Its filter,
:class:`ExpectedLoss`, is also the one the job puts on its own Dask client's
records of a lost scheduler (``deploy.job.world``).

>>> import logging
>>> from distributed.comm.core import CommClosedError
>>> keep = ExpectedLoss(CommClosedError, MESSAGE)
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


class ExpectedLoss(logging.Filter):
    """Drops a Dask record whose exception is ``expected`` (and whose message starts with
    ``message``, if given): a loss the job recovers from."""

    def __init__(self, expected: type[BaseException], message: str = "") -> None:
        super().__init__()
        self.expected = expected
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        lost = isinstance(error, self.expected) and str(record.msg).startswith(self.message)
        return not lost


class QuietLostPeers(WorkerPlugin):
    """Drops Dask's "failed during get data" record from each worker's log (those that
    join later included) when the peer closed the connection."""

    name = "streamrec-quiet-lost-peers"
    idempotent = True  # every rank may register it; the first one stays

    def __init__(self) -> None:
        from distributed.comm.core import CommClosedError

        self._filter = ExpectedLoss(CommClosedError, MESSAGE)

    def setup(self, worker: Any) -> None:
        logging.getLogger(LOGGER).addFilter(self._filter)

    def teardown(self, worker: Any) -> None:
        logging.getLogger(LOGGER).removeFilter(self._filter)
