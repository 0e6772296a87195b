"""Checkpoint files of a store shard: Arrow IPC row files, checksums and manifests.

A checkpoint directory holds, per checkpoint ``seq``:

- ``{seq:08d}-{kind}-{table}.rows.arrow``: the rows (all of them for a full
  snapshot, the dirty ones for a delta), each with its id;
- ``{seq:08d}-delta-{table}.tombstones.arrow``: ids removed since the parent;
- ``{seq:08d}-full-{table}.tier.{file}``: instead of a rows file, a tiered
  table's full snapshot is its disk tier: the engine's own checkpoint, its
  files hard links of the tier's (see :mod:`embedding_store.tier`);
- ``MANIFEST-{seq:08d}.json``: names those files with their size and SHA-256,
  the parent checkpoint, the table clocks and the caller's metadata. It is
  written to a temporary name, fsynced and renamed, so a manifest is either
  whole or absent; files without a manifest are ignored.

Restoring reads the newest full snapshot and the chain of deltas after it, and
verifies every file before any row is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from embedding_store.errors import CheckpointError
from embedding_store.types import RowBatch

FORMAT_VERSION = 1
MANIFEST_RE = re.compile(r"^MANIFEST-(\d{8})\.json$")


@dataclass(frozen=True)
class TableSnapshot:
    """One table's share of a checkpoint, as taken from memory."""

    name: str
    dim: int
    state_width: int
    rows: RowBatch
    tombstones: npt.NDArray[np.uint64]
    clock: int
    # A tiered table's full snapshot: its disk tier's files, already in the checkpoint
    # directory (their manifest entries), and the rows they hold; ``rows`` is empty.
    tier_files: tuple[dict[str, Any], ...] = ()
    tier_rows: int = 0


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    path: Path
    seq: int
    kind: Literal["full", "delta"]
    parent: int | None
    tables: dict[str, Any]
    metadata: dict[str, Any]

    @property
    def directory(self) -> Path:
        return self.path.parent


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` all or nothing: ``write`` fills a temporary file, fsynced, then renamed.

    A crash at any point leaves either the old file (or none) or the whole new one.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def file_entry(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """A manifest's entry for a file already in the checkpoint directory."""
    return {
        "path": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256 if sha256 is not None else _sha256(path),
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_table(path: Path, table: pa.Table, compression: str) -> dict[str, Any]:
    options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_file(sink, table.schema, options=options) as writer,
    ):
        writer.write_table(table, max_chunksize=1 << 20)
    with path.open("rb+") as f:
        os.fsync(f.fileno())
    return {
        "path": path.name,
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
        "rows": table.num_rows,
    }


def _rows_table(rows: RowBatch) -> pa.Table:
    columns: dict[str, pa.Array] = {
        "id": pa.array(rows.ids, type=pa.uint64()),
        "weights": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(rows.weights).reshape(-1)), rows.weights.shape[1]
        ),
        "row_step": pa.array(rows.row_step, type=pa.int64()),
        "last_seen": pa.array(rows.last_seen, type=pa.int64()),
        "freq": pa.array(rows.freq, type=pa.int64()),
    }
    if rows.state.shape[1] > 0:
        columns["state"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(rows.state).reshape(-1)), rows.state.shape[1]
        )
    return pa.table(columns)


def write_checkpoint(
    directory: Path,
    seq: int,
    kind: Literal["full", "delta"],
    parent: int | None,
    tables: Iterable[TableSnapshot],
    *,
    compression: str = "zstd",
    metadata: dict[str, Any] | None = None,
) -> tuple[Path, int, int, int]:
    """Write one checkpoint; returns (manifest path, rows, tombstones, bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Any] = {}
    total_rows = total_tombs = total_bytes = 0
    for snap in tables:
        if snap.tier_files:
            files = [{"role": "tier", **f} for f in snap.tier_files]
        else:
            files = [
                {
                    "role": "rows",
                    **_write_table(
                        directory / f"{seq:08d}-{kind}-{snap.name}.rows.arrow",
                        _rows_table(snap.rows),
                        compression,
                    ),
                }
            ]
        if kind == "delta" and snap.tombstones.shape[0]:
            tombs = pa.table({"id": pa.array(snap.tombstones, type=pa.uint64())})
            files.append(
                {
                    "role": "tombstones",
                    **_write_table(
                        directory / f"{seq:08d}-delta-{snap.name}.tombstones.arrow",
                        tombs,
                        compression,
                    ),
                }
            )
        entries[snap.name] = {
            "dim": snap.dim,
            "state_width": snap.state_width,
            "clock": snap.clock,
            "rows": len(snap.rows) + snap.tier_rows,
            "tombstones": int(snap.tombstones.shape[0]) if kind == "delta" else 0,
            "files": files,
        }
        total_rows += len(snap.rows) + snap.tier_rows
        total_tombs += entries[snap.name]["tombstones"]
        total_bytes += sum(f["bytes"] for f in files)
    doc = {
        "format": FORMAT_VERSION,
        "seq": seq,
        "kind": kind,
        "parent": parent,
        "created_unix": time.time(),
        "tables": entries,
        "metadata": metadata or {},
    }
    path = directory / f"MANIFEST-{seq:08d}.json"
    body = json.dumps(doc, indent=1, sort_keys=True).encode()
    write_file_atomic(path, lambda f: f.write(body))
    return path, total_rows, total_tombs, total_bytes + path.stat().st_size


def list_manifests(directory: Path) -> list[tuple[int, Path]]:
    """(seq, path) of the manifests in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = MANIFEST_RE.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def read_manifest(path: Path) -> Manifest:
    """Parse a manifest; a manifest that is not what this module writes is an error."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc["format"] != FORMAT_VERSION:
            msg = (
                f"{path}: checkpoint format {doc['format']}, this streamrec reads {FORMAT_VERSION}"
            )
            raise CheckpointError(msg)
        return Manifest(
            path=path,
            seq=int(doc["seq"]),
            kind=doc["kind"],
            parent=doc["parent"],
            tables=dict(doc["tables"]),
            metadata=dict(doc.get("metadata", {})),
        )
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"{path}: unreadable checkpoint manifest ({type(exc).__name__}: {exc})"
        raise CheckpointError(msg) from exc


def plan_restore(directory: Path, upto_seq: int | None = None) -> list[Manifest]:
    """The newest full snapshot (at or below ``upto_seq``) and the deltas after it."""
    manifests = [(s, p) for s, p in list_manifests(directory) if upto_seq is None or s <= upto_seq]
    if not manifests:
        where = f" at or below seq {upto_seq}" if upto_seq is not None else ""
        msg = f"{directory}: no checkpoint manifest{where} (expected MANIFEST-<seq>.json files)"
        raise CheckpointError(msg)
    parsed = [read_manifest(p) for _, p in manifests]
    fulls = [i for i, m in enumerate(parsed) if m.kind == "full"]
    if not fulls:
        msg = f"{directory}: no full snapshot to start from (only deltas)"
        raise CheckpointError(msg)
    chain = [parsed[fulls[-1]]]
    for m in parsed[fulls[-1] + 1 :]:
        if m.parent != chain[-1].seq:
            msg = (
                f"{m.path}: delta's parent is checkpoint {m.parent}, but the chain ends at "
                f"{chain[-1].seq}; a checkpoint in between is missing"
            )
            raise CheckpointError(msg)
        chain.append(m)
    if upto_seq is not None and chain[-1].seq != upto_seq:
        msg = f"{directory}: checkpoint {upto_seq} not found (newest is {chain[-1].seq})"
        raise CheckpointError(msg)
    return chain


def verify(chain: Iterable[Manifest]) -> None:
    """Check that every file of every manifest is present, whole and unchanged."""
    for m in chain:
        for tname, tinfo in m.tables.items():
            for f in tinfo["files"]:
                path = m.directory / f["path"]
                if not path.is_file():
                    msg = f"{path}: missing (table {tname!r}, checkpoint {m.seq})"
                    raise CheckpointError(msg)
                size = path.stat().st_size
                if size != f["bytes"]:
                    msg = f"{path}: {size} bytes, the manifest says {f['bytes']} (truncated?)"
                    raise CheckpointError(msg)
                if _sha256(path) != f["sha256"]:
                    msg = f"{path}: checksum mismatch (corrupt file)"
                    raise CheckpointError(msg)


def _read(path: Path) -> pa.Table:
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowException) as exc:
        msg = f"{path}: unreadable Arrow IPC file ({exc})"
        raise CheckpointError(msg) from exc


def _matrix(table: pa.Table, column: str, width: int) -> npt.NDArray[np.float32]:
    if width == 0:
        return np.zeros((table.num_rows, 0), dtype=np.float32)
    flat = table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat, dtype=np.float32).reshape(-1, width)


def read_rows(path: Path, dim: int, state_width: int) -> RowBatch:
    """Load a rows file written by ``write_checkpoint``."""
    t = _read(path)
    return RowBatch(
        ids=t.column("id").to_numpy().astype(np.uint64, copy=False),
        weights=_matrix(t, "weights", dim),
        state=_matrix(t, "state", state_width),
        row_step=t.column("row_step").to_numpy().astype(np.int64, copy=False),
        last_seen=t.column("last_seen").to_numpy().astype(np.int64, copy=False),
        freq=t.column("freq").to_numpy().astype(np.int64, copy=False),
    )


def read_tombstones(path: Path) -> npt.NDArray[np.uint64]:
    """Load a tombstones file written by ``write_checkpoint``."""
    ids: npt.NDArray[np.uint64] = _read(path).column("id").to_numpy().astype(np.uint64)
    return ids


def source_dirs(directory: Path) -> list[Path]:
    """The checkpoint directories under ``directory``: itself, or its ``shard-*`` folders."""
    if list_manifests(directory):
        return [directory]
    subdirs = (
        sorted(p for p in directory.glob("shard-*") if p.is_dir() and list_manifests(p))
        if directory.is_dir()
        else []
    )
    if not subdirs:
        msg = f"{directory}: no checkpoint here (no MANIFEST-*.json, no shard-*/ folders with one)"
        raise CheckpointError(msg)
    return subdirs


def collect_garbage(directory: Path, keep_full: int) -> list[Path]:
    """Delete checkpoints older than the ``keep_full`` newest full snapshots."""
    manifests = [read_manifest(p) for _, p in list_manifests(directory)]
    fulls = [m.seq for m in manifests if m.kind == "full"]
    if len(fulls) <= keep_full:
        return []
    oldest_kept = fulls[-keep_full]
    removed = []
    for m in manifests:
        if m.seq >= oldest_kept:
            continue
        for tinfo in m.tables.values():
            for f in tinfo["files"]:
                path = m.directory / f["path"]
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
        m.path.unlink(missing_ok=True)
        removed.append(m.path)
    return removed
