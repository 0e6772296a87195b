"""Job checkpoints: one manifest ties the store shards, the dense state and the offsets.

The checkpoint location is a local path or a URL (``s3://bucket/prefix``,
``file://...``; see :mod:`embedding_store.location`), so that trainers on
different hosts share it.

A job checkpoint is taken with the stream paused and every push applied: each
store shard writes a checkpoint into its own data dir (a delta after the
first full one), the dense model and optimizer state go to ``dense-<step>.pt``,
and ``JOB-<step>.json`` names both together with the source positions that
were fully trained. The manifest is written last and whole (on a local disk
to a temporary name, fsynced and renamed; in an object store an upload that
becomes visible only once complete): a crash at any earlier point leaves the
previous checkpoint the newest, and a restore from it rolls every shard back to the
seq it names, so the model has learned each event before those positions
exactly once.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> book = CheckpointBook(d, keep=2)
>>> book.latest() is None
True
>>> m = book.save(step=10, samples=40, positions={"t/0": 40}, shard_seqs=[1, 1],
...               dense={"w": 1}, extra={"mode": "sync"})
>>> book.latest().positions, book.latest().shard_seqs, book.load_dense(book.latest())
({'t/0': 40}, [1, 1], {'w': 1})
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from embedding_store.errors import CheckpointError
from embedding_store.location import Location

FORMAT = 1
_MANIFEST = re.compile(r"^JOB-(\d{12})\.json$")


class JobCheckpointError(RuntimeError):
    """A job checkpoint that is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class JobManifest:
    """What one job checkpoint holds."""

    step: int
    samples: int
    positions: dict[str, int]
    shard_seqs: list[int]
    dense_file: str
    created: float
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT
    path: str = ""


class CheckpointBook:
    """The job manifests and dense states in one checkpoint location (a path or a URL)."""

    def __init__(self, directory: Location | Path | str, *, keep: int = 3) -> None:
        if keep < 1:
            msg = f"keep must be >= 1, got {keep}"
            raise ValueError(msg)
        self.location = directory if isinstance(directory, Location) else Location.parse(directory)
        self.keep = keep

    def manifests(self) -> list[str]:
        """The names of the job manifests, oldest first.

        Found by listing, never by a pointer file that a rename would have to
        replace: a manifest is written last, whole or not at all, so every
        name listed is a complete checkpoint.
        """
        return [n for n in self.location.names() if _MANIFEST.match(n)]

    def latest(self) -> JobManifest | None:
        """The newest job checkpoint, or None when there is none."""
        found = self.manifests()
        return self.read(found[-1]) if found else None

    def read(self, name: str | Path) -> JobManifest:
        """The manifest called ``name`` (a name from :meth:`manifests`, or a local path)."""
        name = name.name if isinstance(name, Path) else name
        where = f"{self.location}/{name}"
        try:
            raw = json.loads(self.location.read_bytes(name))
        except (OSError, ValueError, CheckpointError) as exc:
            msg = f"{where}: unreadable job manifest ({exc})"
            raise JobCheckpointError(msg) from exc
        if raw.get("format") != FORMAT:
            msg = f"{where}: job manifest format {raw.get('format')!r}, expected {FORMAT}"
            raise JobCheckpointError(msg)
        raw["path"] = where
        try:
            return JobManifest(**raw)
        except TypeError as exc:
            msg = f"{where}: malformed job manifest ({exc})"
            raise JobCheckpointError(msg) from exc

    def save(
        self,
        *,
        step: int,
        samples: int,
        positions: dict[str, int],
        shard_seqs: list[int],
        dense: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> JobManifest:
        """Write the dense state, then the manifest (whole or not at all), then drop old ones."""
        dense_file = f"dense-{step:012d}.pt"
        buffer = io.BytesIO()
        torch.save(dense, buffer)
        self.location.write_bytes(dense_file, buffer.getvalue())
        manifest = JobManifest(
            step=step,
            samples=samples,
            positions=dict(positions),
            shard_seqs=list(shard_seqs),
            dense_file=dense_file,
            created=time.time(),
            extra=dict(extra or {}),
        )
        body = {k: v for k, v in asdict(manifest).items() if k != "path"}
        name = f"JOB-{step:012d}.json"
        self.location.write_bytes(name, json.dumps(body, indent=1, sort_keys=True).encode())
        self._collect_garbage()
        return replace(manifest, path=f"{self.location}/{name}")

    def load_dense(self, manifest: JobManifest) -> dict[str, Any]:
        where = f"{self.location}/{manifest.dense_file}"
        try:
            data = self.location.read_bytes(manifest.dense_file)
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError, CheckpointError) as exc:
            msg = f"{where}: cannot load the dense state of {manifest.path} ({exc})"
            raise JobCheckpointError(msg) from exc
        if not isinstance(state, dict):
            msg = f"{where}: expected a dict of states, got {type(state).__name__}"
            raise JobCheckpointError(msg)
        return state

    def _collect_garbage(self) -> None:
        found = self.manifests()
        for old in found[: -self.keep]:
            m = self.read(old)
            # The manifest first: a reader never finds one whose dense state is gone.
            self.location.delete(old)
            self.location.delete(m.dense_file)
