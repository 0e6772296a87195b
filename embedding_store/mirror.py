"""A shard's checkpoints copied to a shared location, so a shard can move hosts.

A store shard writes its checkpoints into its local data directory (see
:mod:`embedding_store.persistence`). With a *mirror* (``streamrec store serve
--snapshots s3://bucket/job/shard-000``) each checkpoint is also uploaded
there, row files first and the manifest last, so the mirror's manifests name
only files that are whole. A shard started on a host with an empty disk, or
asked to restore a checkpoint it does not hold, fetches the chain it needs
(the full snapshot and the deltas after it) from the mirror, checks it like a
local one, and restores.

The mirror is the truth: when it holds a newer checkpoint than the local disk
(the shard ran on another host meanwhile), the shard starts from the mirror's,
and numbers its next checkpoint after the newest of both.

>>> import tempfile, pathlib
>>> from embedding_store.location import Location
>>> local, remote = pathlib.Path(tempfile.mkdtemp()), Location.parse(tempfile.mkdtemp())
>>> newest_seq(remote) is None
True
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any, BinaryIO

from embedding_store import persistence
from embedding_store.errors import CheckpointError
from embedding_store.location import Location

log = logging.getLogger(__name__)


def _manifest_name(seq: int) -> str:
    return f"MANIFEST-{seq:08d}.json"


def remote_seqs(mirror: Location) -> list[int]:
    """The checkpoint seqs the mirror holds (each manifest there is whole), oldest first."""
    seqs = []
    for name in mirror.names():
        m = persistence.MANIFEST_RE.match(name)
        if m:
            seqs.append(int(m.group(1)))
    return sorted(seqs)


def newest_seq(mirror: Location) -> int | None:
    """The newest checkpoint seq in the mirror, or None when it holds none."""
    seqs = remote_seqs(mirror)
    return seqs[-1] if seqs else None


def _files(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for t in doc["tables"].values() for f in t["files"]]


def _write(body: bytes, out: BinaryIO) -> None:
    out.write(body)


def upload(manifest_path: Path, mirror: Location) -> int:
    """Copy one local checkpoint (its files, then its manifest) to ``mirror``; returns bytes."""
    doc = json.loads(manifest_path.read_text(encoding="utf-8"))
    sent = 0
    for f in _files(doc):
        mirror.upload(manifest_path.parent / f["path"])
        sent += int(f["bytes"])
    mirror.upload(manifest_path)  # last: the commit point of this checkpoint in the mirror
    return sent + manifest_path.stat().st_size


def remove(mirror: Location, local_paths: list[Path]) -> None:
    """Delete from ``mirror`` what the local garbage collection removed (manifests first)."""
    names = [p.name for p in local_paths]
    for name in sorted(names, key=lambda n: not n.startswith("MANIFEST-")):
        mirror.delete(name)


def fetch_chain(mirror: Location, local_dir: Path, upto_seq: int | None = None) -> int | None:
    """Copy the chain that restores checkpoint ``upto_seq`` (None: the newest) to ``local_dir``.

    Files already there with the right size are kept; the others are fetched,
    and each manifest is written after its files. Returns the seq fetched, or
    None when the mirror holds no checkpoint. A chain that the mirror cannot
    complete is a :class:`CheckpointError` naming what is missing.
    """
    seqs = remote_seqs(mirror)
    if upto_seq is None:
        if not seqs:
            return None
        upto_seq = seqs[-1]
    if upto_seq not in seqs:
        newest = seqs[-1] if seqs else None
        msg = (
            f"{mirror}: checkpoint {upto_seq} is not in the snapshot mirror (newest there: "
            f"{newest}); was the shard started with the same --snapshots URL as before?"
        )
        raise CheckpointError(msg)
    chain: list[tuple[int, bytes, dict[str, Any]]] = []
    seq: int | None = upto_seq
    while seq is not None:
        name = _manifest_name(seq)
        try:
            body = mirror.read_bytes(name)
            doc = json.loads(body)
        except FileNotFoundError as exc:
            msg = f"{mirror}: checkpoint {upto_seq} needs {name}, which is gone"
            raise CheckpointError(msg) from exc
        except ValueError as exc:
            msg = f"{mirror}/{name}: unreadable checkpoint manifest ({exc})"
            raise CheckpointError(msg) from exc
        chain.append((seq, body, doc))
        seq = None if doc.get("kind") == "full" else doc.get("parent")
    local_dir.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for seq, body, doc in reversed(chain):
        for f in _files(doc):
            target = local_dir / f["path"]
            if target.is_file() and target.stat().st_size == int(f["bytes"]):
                continue
            try:
                mirror.download(f["path"], target)
            except FileNotFoundError as exc:
                msg = f"{mirror}: checkpoint {seq} names {f['path']}, which is gone"
                raise CheckpointError(msg) from exc
            fetched += int(f["bytes"])
        local = local_dir / _manifest_name(seq)
        if not local.is_file() or local.read_bytes() != body:
            persistence.write_file_atomic(local, functools.partial(_write, body))
    # A local checkpoint the mirror does not hold as it is (a disk from an older life
    # of this shard) must not end up in the restore's chain: the mirror is the truth.
    in_chain = {seq for seq, _, _ in chain}
    for seq, path in persistence.list_manifests(local_dir):
        if seq > upto_seq or seq in in_chain:
            continue
        same = seq in seqs and path.read_bytes() == mirror.read_bytes(path.name)
        if not same:
            log.warning("%s: not in the snapshot mirror %s as it is; set aside", path, mirror)
            path.rename(path.with_name(f"{path.name}.stale"))
    log.info("fetched checkpoint %d (%d bytes) from %s", upto_seq, fetched, mirror)
    return upto_seq
