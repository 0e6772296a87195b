"""Scoring and evaluating a file: ``streamrec score`` and ``streamrec evaluate``.

The parameters are one job checkpoint's, so they are consistent: its dense
state and, restored in this process, the rows of every store shard at the
seq the checkpoint names (a read-only copy; the shards need not run). A
large file is cut into parts (:func:`plan_parts`) that Dask workers score
with a model each (``deploy.scoring``).

Records come from a JSON-lines file (one record per line, in the job's
codec) or a Parquet file, in batches; bad records are not scored but written
with their reasons next to the output, so nothing read is lost silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from connectors.spec import FeatureSpec
from connectors.types import BadRecord
from embedding_store.location import Location
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from serving.model import DenseVersion, Scored, ServingModel, inference_module
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.config import TrainerConfig
from trainer.metrics import auc, logloss
from trainer.publish import PublishedDense

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


class OfflineError(RuntimeError):
    """A file or checkpoint that cannot be scored as asked (the message says why)."""


def checkpoint_rows(store: StoreConfig, manifest: JobManifest, shards: list[str]) -> StoreShard:
    """A read-only shard holding every row of the job checkpoint ``manifest``.

    ``shards``: each store shard's checkpoint folder (its data dir or snapshot
    URL), in shard order, as many as the checkpoint has seqs.
    """
    if len(shards) != len(manifest.shard_seqs):
        msg = (
            f"the checkpoint at step {manifest.step} has {len(manifest.shard_seqs)} store "
            f"shard(s); {len(shards)} shard folder(s) given"
        )
        raise OfflineError(msg)
    import tempfile

    from embedding_store import mirror as snapshot_mirror

    shard = StoreShard(store, read_only=True)
    with tempfile.TemporaryDirectory(prefix="streamrec-score-") as scratch:
        sources = []
        for i, (where, seq) in enumerate(zip(shards, manifest.shard_seqs, strict=True)):
            loc = Location.parse(where)
            if loc.local is not None:
                sources.append((loc.local, seq))
            else:
                local = Path(scratch) / f"shard-{i:03d}"
                snapshot_mirror.fetch_chain(loc, local, seq)
                sources.append((local, seq))
        shard.restore_sources(sources, shard_index=0, num_shards=1)
    return shard


def checkpoint_dense(
    book: CheckpointBook,
    manifest: JobManifest,
    config: TrainerConfig,
    spec: FeatureSpec,
    dims: dict[str, int],
) -> DenseVersion:
    """Rank 0's dense network as the checkpoint ``manifest`` holds it."""
    state = book.load_dense(manifest)
    try:
        model_state = state["ranks"][0]["model"]
    except (KeyError, IndexError, TypeError) as exc:
        msg = f"{manifest.path}: no dense model state in it ({exc})"
        raise OfflineError(msg) from exc
    module = inference_module(config, spec, dims, model_state)
    entry = PublishedDense(
        version=0, step=manifest.step, samples=manifest.samples, file="", created=manifest.created
    )
    return DenseVersion(entry, module)


def pick_checkpoint(book: CheckpointBook, step: int | None) -> JobManifest:
    """The checkpoint at ``step`` (None: the newest); errors list the ones there are."""
    names = book.manifests()
    if not names:
        msg = f"no job checkpoint in {book.location}: train first, or give --store"
        raise OfflineError(msg)
    if step is None:
        return book.read(names[-1])
    for name in names:
        if name == f"JOB-{step:012d}.json":
            return book.read(name)
    steps = [int(n[4:16]) for n in names]
    msg = f"--checkpoint {step}: no such checkpoint in {book.location} (steps: {steps})"
    raise OfflineError(msg)


def read_batches(path: Path, batch: int) -> Iterator[tuple[int, list[bytes] | pa.Table]]:
    """(first record's index, records) of ``path``: JSON-lines lines, or Parquet rows."""
    if not path.is_file():
        msg = f"--from {path}: no such file"
        raise OfflineError(msg)
    groups = _parquet(path).metadata.num_row_groups if _is_parquet(path) else 0
    yield from read_part(path, FilePart(0, -1, 0, groups), batch)


@dataclass(frozen=True)
class FilePart:
    """A stretch of a file that one task scores: its first record's index in the file,
    its records (-1: to the end of the file), and where it lies (JSON lines: bytes
    ``[start, stop)``; Parquet: row groups)."""

    first: int
    records: int
    start: int
    stop: int


def plan_parts(path: Path, records_per_part: int) -> list[FilePart]:
    """``path`` cut into parts of about ``records_per_part`` records, in file order
    (Parquet: whole row groups; JSON lines: whole lines).

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "r.jsonl"
    >>> _ = f.write_bytes(b"a\\nbb\\nccc\\nd")
    >>> [(p.first, p.records, p.start, p.stop) for p in plan_parts(f, 2)]
    [(0, 2, 0, 5), (2, 2, 5, 10)]
    """
    if records_per_part < 1:
        msg = f"records per part: expected at least 1, got {records_per_part}"
        raise ValueError(msg)
    if not path.is_file():
        msg = f"--from {path}: no such file"
        raise OfflineError(msg)
    parts: list[FilePart] = []
    if _is_parquet(path):
        meta = _parquet(path).metadata
        first = start = rows = 0
        for g in range(meta.num_row_groups):
            rows += meta.row_group(g).num_rows
            if rows >= records_per_part or g == meta.num_row_groups - 1:
                parts.append(FilePart(first, rows, start, g + 1))
                first, start, rows = first + rows, g + 1, 0
        return parts
    first = start = at = lines = 0
    with path.open("rb") as fh:
        for line in fh:
            at += len(line)
            lines += 1
            if lines == records_per_part:
                parts.append(FilePart(first, lines, start, at))
                first, start, lines = first + lines, at, 0
    if lines:
        parts.append(FilePart(first, lines, start, at))
    return parts


def read_part(
    path: Path, part: FilePart, batch: int
) -> Iterator[tuple[int, list[bytes] | pa.Table]]:
    """:func:`read_batches` of one part: (record index in the file, records)."""
    at = part.first
    if _is_parquet(path):
        groups = list(range(part.start, part.stop))
        for rb in _parquet(path).iter_batches(batch_size=batch, row_groups=groups):
            table = pa.Table.from_batches([rb])
            yield at, table
            at += table.num_rows
        return
    lines: list[bytes] = []
    taken = 0
    with path.open("rb") as fh:
        fh.seek(part.start)
        for line in fh:
            if taken == part.records:
                break
            lines.append(line.rstrip(b"\r\n"))
            taken += 1
            if len(lines) == batch:
                yield at, lines
                at += len(lines)
                lines = []
    if lines:
        yield at, lines


def score_part(model: ServingModel, path: Path, part: FilePart, *, batch: int) -> FileScores:
    """Score one part of ``path`` (positions are the records' indices in the whole file)."""
    out = FileScores(model.heads)
    _score_into(out, model, read_part(path, part, batch))
    return out


def _is_parquet(path: Path) -> bool:
    return path.suffix in {".parquet", ".pq"}


def _parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as exc:
        msg = f"--from {path}: not a readable Parquet file ({exc})"
        raise OfflineError(msg) from exc


def count_records(path: Path) -> int:
    """How many records ``path`` holds (for a progress bar)."""
    if _is_parquet(path):
        return int(pq.ParquetFile(path).metadata.num_rows)
    with path.open("rb") as fh:
        return sum(1 for _ in fh)


@dataclass
class FileScores:
    """What scoring a file gave: the scored records' positions and scores, the bad ones."""

    heads: tuple[str, ...]
    positions: list[npt.NDArray[np.int64]] = field(default_factory=list)
    probabilities: list[npt.NDArray[np.float32]] = field(default_factory=list)
    labels: list[npt.NDArray[np.float32]] = field(default_factory=list)
    bad: list[BadRecord] = field(default_factory=list)
    records: int = 0

    def add(self, first: int, scored: Scored) -> None:
        self.positions.append(scored.positions + first)
        self.probabilities.append(scored.probabilities)
        self.labels.append(scored.labels)
        self.bad += [replace(b, position=b.position + first) for b in scored.bad]

    def merge(self, other: FileScores) -> None:
        """Take ``other``'s records (scored elsewhere, positions already the file's)."""
        self.positions += other.positions
        self.probabilities += other.probabilities
        self.labels += other.labels
        self.bad += other.bad
        self.records += other.records

    def arrays(
        self,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        width = len(self.heads)
        if not self.positions:
            empty = np.zeros((0, width), np.float32)
            return np.zeros(0, np.int64), empty, empty
        return (
            np.concatenate(self.positions),
            np.concatenate(self.probabilities),
            np.concatenate(self.labels),
        )


def score_file(
    model: ServingModel,
    path: Path,
    *,
    batch: int = 4096,
    on_progress: Callable[[int], None] | None = None,
) -> FileScores:
    """Score every record of ``path`` with ``model``, batch by batch."""
    out = FileScores(model.heads)
    _score_into(out, model, read_batches(path, batch), on_progress)
    return out


def _score_into(
    out: FileScores,
    model: ServingModel,
    batches: Iterator[tuple[int, list[bytes] | pa.Table]],
    on_progress: Callable[[int], None] | None = None,
) -> None:
    for first, records in batches:
        if isinstance(records, pa.Table):
            scored = model.score_table(records)
            out.records += records.num_rows
        else:
            scored = model.score_records(records)
            out.records += len(records)
        out.add(first, scored)
        if on_progress is not None:
            on_progress(out.records)


def write_scores(scores: FileScores, out: Path) -> Path | None:
    """``out`` (Parquet: ``position`` and one probability column per head) and, when
    there are bad records, ``<out>.rejected.jsonl`` with their reasons; returns that path."""
    positions, probs, _ = scores.arrays()
    columns: dict[str, pa.Array] = {"position": pa.array(positions, pa.int64())}
    for j, head in enumerate(scores.heads):
        columns[head] = pa.array(probs[:, j], pa.float32())
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), out)
    if not scores.bad:
        return None
    rejected = out.with_name(out.name + ".rejected.jsonl")
    with rejected.open("w") as fh:
        for b in scores.bad:
            fh.write(json.dumps(b.to_json()) + "\n")
    return rejected


def evaluate_scores(scores: FileScores) -> dict[str, dict[str, float | int | None]]:
    """AUC, logloss and calibration (mean prediction / mean label) per head."""
    _, probs, labels = scores.arrays()
    result: dict[str, dict[str, float | int | None]] = {}
    for j, head in enumerate(scores.heads):
        y, p = labels[:, j].astype(np.float64), probs[:, j].astype(np.float64)
        if y.size == 0:
            result[head] = {"samples": 0, "auc": None, "logloss": None, "calibration": None}
            continue
        both = 0.0 < y.mean() < 1.0
        result[head] = {
            "samples": int(y.size),
            "auc": auc(y, p) if both else None,
            "logloss": logloss(y, p),
            "calibration": float(p.mean() / y.mean()) if y.mean() > 0 else None,
        }
    return result
