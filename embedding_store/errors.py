"""Typed errors of the embedding store; each message says what was wrong and what to do.

The gRPC service maps them onto status codes (see ``service.py``) and the
client maps the codes back, so ``inproc://`` and ``grpc://`` raise the same types.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the embedding store raises on purpose."""


class UnknownTable(StoreError, KeyError):
    """A request named a table the shard does not serve (gRPC NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidRequest(StoreError, ValueError):
    """A request's fields do not fit together, e.g. byte lengths (INVALID_ARGUMENT)."""


class CheckpointError(StoreError):
    """A checkpoint could not be written, or read back intact (never a partial load)."""


class StoreUnavailable(StoreError):
    """A shard could not be reached after the retries (UNAVAILABLE, DEADLINE_EXCEEDED)."""


class Unauthenticated(StoreError):
    """The call carried no token, or the wrong one (UNAUTHENTICATED)."""


class MessageTooLarge(StoreError):
    """A request or reply exceeds the configured maximum message size (RESOURCE_EXHAUSTED)."""


class ShardRestarted(StoreUnavailable):
    """A shard answered as a new process: what was pushed since its last checkpoint is gone.

    Raised by a client that saw the shard's incarnation change; a job rolls back
    to its newest checkpoint (:meth:`StoreClient.accept_restarts` then accepts it).
    """
