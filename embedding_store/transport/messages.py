"""Protobuf replies of a shard to the store's result types."""

from __future__ import annotations

from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.types import CheckpointResult, LatencySnapshot, TableChanges
from embedding_store.wire import decode_ids, decode_matrix


def table_changes(r: pb.ChangesResponse) -> TableChanges:
    return TableChanges(
        epoch=r.epoch,
        version=r.version,
        complete=r.complete,
        ids=decode_ids(r.ids, "ChangesResponse.ids"),
        weights=decode_matrix(r.rows, r.dim, "float32", "ChangesResponse.rows"),
        removed=decode_ids(r.removed, "ChangesResponse.removed"),
        changed_at=r.changed_at,
    )


def latency_from_pb(r: pb.LatencyHistogram) -> LatencySnapshot:
    """A latency snapshot from its wire form; ``ValueError`` when it is inconsistent."""
    return LatencySnapshot(
        buckets=tuple(r.buckets), counts=tuple(r.counts), sum_s=r.sum_seconds, count=r.count
    )


def checkpoint_from_pb(r: pb.CheckpointResponse) -> CheckpointResult:
    return CheckpointResult(
        manifest=r.manifest,
        kind="full" if r.kind == "full" else "delta",
        seq=r.seq,
        rows=r.rows,
        tombstones=r.tombstones,
        bytes=r.bytes,
        seconds=r.seconds,
    )
