"""A disk tier's files in a checkpoint directory, and back.

A tiered table's full snapshot is its disk tier as the engine checkpoints it:
table files hard-linked (no row is copied), the engine's small manifest files
copied, each renamed ``{prefix}{name}`` so that a checkpoint directory stays
flat (its mirror copies files by name). Restoring links them back into a live
tier; a shard that holds the table untiered, or a reshard, reads the rows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from embedding_store.tier.disk_rows import DiskRows, DiskSettings, RowLayout
from embedding_store.types import RowBatch


def export_tier(disk: DiskRows, directory: Path, prefix: str) -> list[Path]:
    """The engine's checkpoint of ``disk``, its files as ``directory/{prefix}{name}``."""
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".{prefix}staging"
    shutil.rmtree(staging, ignore_errors=True)
    disk.checkpoint(staging)
    out = []
    for f in sorted(staging.iterdir()):
        target = directory / f"{prefix}{f.name}"
        os.replace(f, target)
        out.append(target)
    staging.rmdir()
    return out


def _linked(files: Sequence[Path], prefix: str, into: Path) -> Path:
    """``files`` under their engine names in ``into`` (hard links: nothing copied)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.link(f, into / f.name.removeprefix(prefix))
    return into


def restore_tier(
    files: Sequence[Path], prefix: str, path: Path, layout: RowLayout, settings: DiskSettings
) -> DiskRows:
    """A live tier at ``path`` from a checkpoint's tier ``files`` (left as they are)."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".links-") as links:
        linked = _linked(files, prefix, Path(links) / "tier")
        return DiskRows.restore(linked, path, layout, settings)


def tier_rows(files: Sequence[Path], prefix: str, layout: RowLayout) -> Iterator[RowBatch]:
    """Every row of a checkpoint's tier ``files``, in parts, read from a scratch copy
    beside them (the engine may write while it opens; the checkpoint stays as it is)."""
    parent = files[0].parent
    with tempfile.TemporaryDirectory(dir=parent, prefix=".tier-read-") as scratch:
        links = _linked(files, prefix, Path(scratch) / "links")
        with DiskRows.restore(links, Path(scratch) / "tier", layout) as disk:
            yield from disk.scan_all()
