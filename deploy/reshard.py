"""Lay a job's checkpoint of N store shards out again on M: ``streamrec store reshard``.

A job checkpoint names one checkpoint (seq) of every shard, in shard order;
rows carry their ids, so the rows of N shards can be split among M by the
same routing a client uses (``shard_of(id, M)``). For each new shard this
restores, in this process, the ids it owns from every old shard's checkpoint
(each up to the seq the job manifest names), and writes them as a full
checkpoint where the new shard will look: its data directory, or its
``--snapshots`` prefix in an object store, with a seq above any already
there. Then it writes the job manifest again, with the same step, positions
and dense state, naming the new shards' seqs. A job started with M shards
restores from it and goes on where it stopped.

The job must be stopped while this runs. Until the new manifest is written
the old one stands, and nothing it names is removed, so an interrupted
reshard can simply be run again.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.config import JobConfig
from embedding_store import mirror as snapshot_mirror
from embedding_store.errors import CheckpointError
from embedding_store.location import Location
from embedding_store.shard import StoreShard
from trainer.checkpoint import CheckpointBook, JobManifest


class ReshardError(RuntimeError):
    """The reshard cannot be done as asked (the message says why and what to give)."""


@dataclass(frozen=True)
class NewShard:
    """What one new shard got: where its checkpoint is, its seq and its rows."""

    location: str
    seq: int
    rows: int


def _source_dir(where: Location, seq: int, scratch: Path) -> Path:
    """A local directory holding the chain of checkpoint ``seq`` of one old shard."""
    if where.local is not None:
        return where.local
    snapshot_mirror.fetch_chain(where, scratch, seq)
    return scratch


def reshard(
    job: JobConfig,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[JobManifest, list[NewShard]]:
    """Split the newest job checkpoint's rows among ``len(targets)`` shards.

    ``sources``: each old shard's checkpoint folder (its data directory or its
    snapshot prefix), in shard order. ``targets``: each new shard's, in the new
    shard order (``cluster.store``'s). Returns the new job manifest and what
    each new shard holds.
    """
    from deploy.job import checkpoint_location

    book = CheckpointBook(checkpoint_location(job))
    old = book.latest()
    if old is None:
        msg = f"{book.location}: no job checkpoint to reshard (trainer.checkpoint.dir)"
        raise ReshardError(msg)
    if len(sources) != len(old.shard_seqs):
        msg = (
            f"--from: {len(sources)} location(s), but {old.path} is a checkpoint of "
            f"{len(old.shard_seqs)} shards: give every old shard's folder, in shard order"
        )
        raise ReshardError(msg)
    if not targets:
        msg = "--to: give each new shard's folder (data dir or snapshot URL), in shard order"
        raise ReshardError(msg)
    if len(set(targets)) != len(targets):
        msg = f"--to: a folder is named twice ({list(targets)})"
        raise ReshardError(msg)
    dense = book.load_dense(old)
    with tempfile.TemporaryDirectory(prefix="streamrec-reshard-", dir=work_dir) as tmp:
        scratch = Path(tmp)
        chains = [
            (_source_dir(Location.parse(src), seq, scratch / f"from-{i:03d}"), seq)
            for i, (src, seq) in enumerate(zip(sources, old.shard_seqs, strict=True))
        ]
        done = []
        for j, target in enumerate(targets):
            where = Location.parse(target)
            # A local target is the shard's data dir; a remote one its snapshot prefix,
            # written through a scratch data dir (the checkpoint's seq then also
            # clears whatever that prefix already holds).
            data_dir = where.local if where.local is not None else scratch / f"to-{j:03d}"
            shard = StoreShard(
                job.store, data_dir=data_dir, mirror=where if where.local is None else None
            )
            try:
                restored = shard.restore_sources(chains, shard_index=j, num_shards=len(targets))
                written = shard.checkpoint(kind="full", metadata={"resharded_from": old.path})
            except CheckpointError as exc:
                msg = f"new shard {j} ({target}): {exc}"
                raise ReshardError(msg) from exc
            done.append(NewShard(location=target, seq=written.seq, rows=restored.rows))
            log(f"shard {j}: {restored.rows:,} rows, checkpoint {written.seq} in {target}")
    manifest = book.save(
        step=old.step,
        samples=old.samples,
        positions=old.positions,
        shard_seqs=[s.seq for s in done],
        dense=dense,
        extra={
            **old.extra,
            "resharded": {"from_shards": len(old.shard_seqs), "sources": list(sources)},
        },
    )
    return manifest, done
