"""``inproc://``: a shard object in this process behind the ``ShardTransport`` protocol."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from embedding_store.latency import LatencyHistogram
from embedding_store.shard import StoreShard
from embedding_store.transport.base import U64, Rows, T, Wait
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    PushResult,
    RestoreResult,
    RowDtype,
    ShardStats,
)
from embedding_store.wire import row_state_reply


class InprocTransport:
    """A shard object in this process; calls run on a thread (kernels release the GIL).

    Like the gRPC servicer, it times the lookups and pushes it runs (the
    shard's work and the dtype casts) and ``stats()`` reports them.
    """

    def __init__(
        self,
        shard: StoreShard,
        pool: ThreadPoolExecutor | None,
        name: str,
        current_at: Callable[[], float] | None = None,
    ) -> None:
        """``current_at``: when a replica's rows were last current (its follower's);
        None: the shard is read as it is, current now."""
        self.shard = shard
        self.address = name
        self._pool = pool
        self._current_at = current_at
        self.lookup_latency = LatencyHistogram()
        self.push_latency = LatencyHistogram()

    def _start(self, fn: Callable[[], T], deferred: bool) -> Wait[T]:
        if deferred:
            return fn
        if self._pool is None:
            value = fn()
            return lambda: value
        return self._pool.submit(fn).result

    def describe(self) -> tuple[dict[str, int], RowDtype]:
        return {name: t.dim for name, t in self.shard.tables.items()}, self.shard.config.row_dtype

    def accept_restart(self) -> None:
        """A shard object in this process cannot restart."""

    def current_at(self) -> float:
        return time.time() if self._current_at is None else self._current_at()

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
        # A shard of this process answers without a network to wait on: no timeout.
        def run() -> dict[str, Rows]:
            with self.lookup_latency.time():
                if create_only:
                    self.shard.create_rows(ids, step=step)
                    return {}
                # Float16 rows are rounded as they are copied out of the table.
                return self.shard.lookup(ids, train=train, step=step, dtype=dtype)

        return self._start(run, deferred)

    def start_push(
        self,
        grads: dict[str, tuple[U64, Rows]],
        request_id: str,
        dtype: RowDtype,
        *,
        return_rows: bool = False,
        deferred: bool = False,
    ) -> Wait[PushResult]:
        def run() -> PushResult:
            with self.push_latency.time():
                # The wire rounds gradients to the push dtype; do the same here so
                # that inproc:// and grpc:// train identically.
                cast = {
                    k: (i, np.asarray(g).astype(dtype).astype(np.float32))
                    for k, (i, g) in grads.items()
                }
                if not return_rows:
                    return self.shard.push(cast, request_id=request_id)
                # Filled as the push is applied (a peek after it could see a later push).
                _, into = row_state_reply(
                    {
                        k: (len(i), t.dim, t.state_width)
                        for k, (i, _) in grads.items()
                        for t in (self.shard.table(k),)
                    }
                )
                return replace(self.shard.push(cast, request_id=request_id, into=into), rows=into)

        return self._start(run, deferred)

    def checkpoint(
        self, directory: str, kind: CheckpointKind, metadata: dict[str, Any]
    ) -> CheckpointResult:
        return self.shard.checkpoint(directory or None, kind, metadata=metadata)

    def restore(
        self, directory: str, shard_index: int, num_shards: int, upto_seq: int | None
    ) -> RestoreResult:
        return self.shard.restore(
            directory or None, shard_index=shard_index, num_shards=num_shards, upto_seq=upto_seq
        )

    def stats(self) -> ShardStats:
        return replace(
            self.shard.stats(),
            lookup_latency=self.lookup_latency.snapshot(),
            push_latency=self.push_latency.snapshot(),
        )

    def close(self) -> None:
        pass
