"""Job checkpoints: one manifest ties the store shards, the dense state and the offsets.

A job checkpoint is taken with the stream paused and every push applied: each
store shard writes a checkpoint into its own data dir (a delta after the
first full one), the dense model and optimizer state go to ``dense-<step>.pt``,
and ``JOB-<step>.json`` names both together with the source positions that
were fully trained. The manifest is written last, to a temporary name,
fsynced and renamed: a crash at any earlier point leaves the previous
checkpoint the newest, and a restore from it rolls every shard back to the
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

import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from embedding_store.persistence import write_file_atomic

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
    """The job manifests and dense states in one checkpoint directory."""

    def __init__(self, directory: Path | str, *, keep: int = 3) -> None:
        if keep < 1:
            msg = f"keep must be >= 1, got {keep}"
            raise ValueError(msg)
        self.directory = Path(directory)
        self.keep = keep

    def manifests(self) -> list[Path]:
        """Job manifests, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _MANIFEST.match(p.name))

    def latest(self) -> JobManifest | None:
        """The newest job checkpoint, or None when there is none."""
        found = self.manifests()
        return self.read(found[-1]) if found else None

    def read(self, path: Path) -> JobManifest:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            msg = f"{path}: unreadable job manifest ({exc})"
            raise JobCheckpointError(msg) from exc
        if raw.get("format") != FORMAT:
            msg = f"{path}: job manifest format {raw.get('format')!r}, expected {FORMAT}"
            raise JobCheckpointError(msg)
        raw["path"] = str(path)
        try:
            return JobManifest(**raw)
        except TypeError as exc:
            msg = f"{path}: malformed job manifest ({exc})"
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
        """Write the dense state, then the manifest (atomically), then drop old ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        dense_file = f"dense-{step:012d}.pt"
        write_file_atomic(self.directory / dense_file, lambda f: torch.save(dense, f))
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
        path = self.directory / f"JOB-{step:012d}.json"
        text = json.dumps(body, indent=1, sort_keys=True).encode()
        write_file_atomic(path, lambda f: f.write(text))
        self._collect_garbage()
        return replace(manifest, path=str(path))

    def load_dense(self, manifest: JobManifest) -> dict[str, Any]:
        path = self.directory / manifest.dense_file
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError) as exc:
            msg = f"{path}: cannot load the dense state of {manifest.path} ({exc})"
            raise JobCheckpointError(msg) from exc
        if not isinstance(state, dict):
            msg = f"{path}: expected a dict of states, got {type(state).__name__}"
            raise JobCheckpointError(msg)
        return state

    def _collect_garbage(self) -> None:
        found = self.manifests()
        for old in found[: -self.keep]:
            m = self.read(old)
            (self.directory / m.dense_file).unlink(missing_ok=True)
            old.unlink(missing_ok=True)
