"""What every shard transport offers (``ShardTransport``), the gRPC retry policy, and
the id check every call makes first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from embedding_store.errors import InvalidRequest
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    PushResult,
    RestoreResult,
    RowDtype,
    ShardStats,
)

T = TypeVar("T")
U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]
Rows = npt.NDArray[np.floating]
Wait = Callable[[], T]


@dataclass(frozen=True)
class RetryPolicy:
    """How the gRPC transport retries idempotent calls."""

    attempts: int = 6
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    timeout_s: float = 30.0

    @property
    def longest_s(self) -> float:
        """The longest a call's attempts can span: every attempt timing out, with the
        backoffs between them. A shard remembers a push's request id for longer
        (``store.remembered_push_s``), so a retried push is never applied twice.

        >>> RetryPolicy().longest_s
        181.55
        """
        backoffs, delay = 0.0, self.initial_backoff_s
        for _ in range(self.attempts - 1):
            backoffs += delay
            delay = min(delay * 2, self.max_backoff_s)
        return round(self.attempts * self.timeout_s + backoffs, 6)


class ShardTransport(Protocol):
    """How a client talks to one shard. ``start_*`` send now; the returned callable waits.

    With ``deferred`` the call may instead be made by the returned callable, on the
    caller's thread: the client defers one shard's call, which it waits for first,
    and so spares a thread hand-off: a blocking gRPC call returns sooner than the
    same call through a future (``benchmarks/store.py``, ``grpc_*``).
    """

    address: str

    def describe(self) -> tuple[dict[str, int], RowDtype]:
        """The shard's tables (name -> dim) and its configured row dtype."""
        ...

    def start_lookup(
        self,
        ids: dict[str, U64],
        train: bool,
        step: int | None,
        dtype: RowDtype,
        *,
        create_only: bool = False,
        deferred: bool = False,
        timeout_s: float | None = None,
    ) -> Wait[dict[str, Rows]]:
        """Rows of ``ids``; with ``create_only`` (and ``train``) none: the rows are only made.
        ``timeout_s``: the whole call, retries included, ends within it (``StoreUnavailable``);
        None: the transport's own policy."""
        ...

    def start_push(
        self,
        grads: dict[str, tuple[U64, Rows]],
        request_id: str,
        dtype: RowDtype,
        *,
        return_rows: bool = False,
        deferred: bool = False,
    ) -> Wait[PushResult]:
        """Apply ``grads``; with ``return_rows`` the result carries the pushed rows after it."""
        ...

    def checkpoint(
        self, directory: str, kind: CheckpointKind, metadata: dict[str, Any]
    ) -> CheckpointResult: ...

    def restore(
        self, directory: str, shard_index: int, num_shards: int, upto_seq: int | None
    ) -> RestoreResult: ...

    def stats(self) -> ShardStats: ...

    def accept_restart(self) -> None:
        """Take the shard's current process as the one to train against (see ShardRestarted)."""
        ...

    def current_at(self) -> float:
        """When the shard's rows were last current (a serving replica's newest round)."""
        ...

    def close(self) -> None: ...


def id_array(ids: npt.ArrayLike, field: str) -> U64:
    """``ids`` as a contiguous uint64 array; ``InvalidRequest`` naming ``field`` unless
    they are a 1-d array of integers (or empty).

    >>> id_array([3, 4], "ids[t]").dtype
    dtype('uint64')
    >>> id_array([0.5], "ids[t]")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    embedding_store.errors.InvalidRequest: ids[t]: expected a 1-d array of integer ids, ...
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.shape[0] > 0):
        msg = f"{field}: expected a 1-d array of integer ids, got {arr.dtype} shape {arr.shape}"
        raise InvalidRequest(msg)
    return np.ascontiguousarray(arr, dtype=np.uint64)
