"""The failures a trainer rank tells apart: the store lost state (every rank rolls back
to the newest job checkpoint together) or anything else (the job fails)."""

from __future__ import annotations

from embedding_store.errors import StoreUnavailable
from trainer.pusher import PushFailed


class StoreLost(RuntimeError):
    """A store shard lost its rows: it died and came back, or was replaced."""


class Rollback(RuntimeError):
    """The store lost state mid-run; every rank must roll back to the newest job checkpoint.

    Raised by :meth:`TrainLoop.run` on every rank at the same step (the ranks
    agree through the per-step collective), so the caller can restore and go on.
    """


def store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the store (not the model or the data) failed: a rollback heals it.

    >>> store_failure(StoreUnavailable("shard 1 down")), store_failure(ValueError("bad"))
    (True, False)
    """
    if isinstance(exc, PushFailed):
        return exc.__cause__ is not None and store_failure(exc.__cause__)
    return isinstance(exc, StoreUnavailable | StoreLost)
