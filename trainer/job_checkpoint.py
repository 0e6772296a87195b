"""Coordinated job checkpoints across the ranks, and the restore from the newest one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from embedding_store.client import StoreClient
from trainer.checkpoint import CheckpointBook, JobCheckpointError, JobManifest
from trainer.dense_model import DenseModel
from trainer.dense_sync import DenseSync
from trainer.errors import Rollback, store_failure


class JobCheckpointer:
    """Takes a coordinated checkpoint: all ranks drained, store, dense state, manifest."""

    def __init__(
        self,
        book: CheckpointBook,
        store: StoreClient,
        *,
        on_saved: Callable[[JobManifest], None] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.book = book
        self.store = store
        self.on_saved = on_saved
        self.extra = dict(extra or {})

    def take(
        self,
        sync: DenseSync,
        *,
        rank: int,
        step: int,
        positions: dict[str, int],
        samples: int,
        dense: dict[str, Any],
        samples_before: int = 0,
        failure: BaseException | None = None,
    ) -> JobManifest | None:
        """Every rank calls this at the same step, with its pushes drained.

        ``samples`` is what this rank learned since the job (re)started,
        ``samples_before`` what the restored checkpoint held (the same on every rank).
        ``failure``: this rank could not get ready (a push or a dead-letter flush
        failed). Every rank learns of any rank's failure, and of one in the store's
        checkpoint, through the collectives here, so all raise together:
        :class:`Rollback` when the store failed, else the failure itself (rank 0)
        or a :class:`JobCheckpointError` naming it (the others). No manifest is
        written then, so no offset is committed past what is durable.
        """
        # Rank 0 must not checkpoint the store while another rank still pushes.
        ranks = cast(
            list[dict[str, Any]],
            sync.gather(
                {
                    "positions": positions,
                    "samples": samples,
                    "dense": dense,
                    "failure": _describe(failure),
                }
            ),
        )
        manifest = None
        error: BaseException | None = None
        if any(r["failure"] for r in ranks):
            error = failure
        elif rank == 0:
            try:
                results = self.store.checkpoint(None, "auto", metadata={"job_step": step})
                manifest = self.book.save(
                    step=step,
                    samples=samples_before + sum(int(r["samples"]) for r in ranks),
                    positions={p: n for r in ranks for p, n in r["positions"].items()},
                    shard_seqs=[r.seq for r in results],
                    dense={"ranks": [r["dense"] for r in ranks]},
                    extra={
                        **self.extra,
                        "store_bytes": sum(r.bytes for r in results),
                        "store_kinds": [r.kind for r in results],
                    },
                )
            except Exception as exc:
                error = exc
            if manifest is not None and self.on_saved is not None:
                self.on_saved(manifest)
        # Instead of a barrier: every rank learns whether the checkpoint happened.
        outcome = cast(list[dict[str, Any]], sync.gather({"failure": _describe(error)}))
        failures = [r["failure"] for r in ranks + outcome if r["failure"]]
        if failures:
            store_failed = any(f["store"] for f in failures)
            text = "; ".join(sorted({f["text"] for f in failures}))
            if error is not None and not store_failed:
                raise error
            if store_failed:
                msg = f"checkpoint at step {step} not taken: {text}"
                raise Rollback(msg) from error
            msg = f"checkpoint at step {step} failed on another rank: {text}"
            raise JobCheckpointError(msg)
        return manifest


def _describe(exc: BaseException | None) -> dict[str, Any] | None:
    """What other ranks need to know of a failure (exceptions need not pickle)."""
    if exc is None:
        return None
    return {"text": f"{type(exc).__name__}: {exc}", "store": store_failure(exc)}


def restore_job(
    book: CheckpointBook, store: StoreClient, dense: DenseModel, *, rank: int = 0
) -> JobManifest | None:
    """Roll the store back to the newest job checkpoint and load this rank's dense state."""
    manifest = book.latest()
    if manifest is None:
        return None
    if len(manifest.shard_seqs) != store.num_shards:
        msg = (
            f"{manifest.path}: checkpoint of {len(manifest.shard_seqs)} store shards, the "
            f"store has {store.num_shards}; restore it with `streamrec store` onto the new "
            "shards first or start the job with the same number of shards"
        )
        raise RuntimeError(msg)
    if rank == 0:
        store.restore(None, upto_seq=manifest.shard_seqs)
    state = book.load_dense(manifest)["ranks"]
    dense.load(state[min(rank, len(state) - 1)])
    return manifest
