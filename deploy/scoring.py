"""A file scored with a job checkpoint's parameters, in this process or on a Dask cluster.

In this process (the default) one model scores the file batch by batch. For a
large file, ``--workers N`` (a local cluster of N worker processes) or
``--scheduler ADDRESS`` (a running one) cuts the file into parts
(:func:`serving.offline.plan_parts`: whole row groups, or whole lines) and
scores them as tasks: each worker loads the model once (a
:class:`ScoringModelPlugin`: the checkpoint's dense state and every shard's
rows, restored in the worker) and scores the parts it is given, reading them
from the file itself; the parts' scores come back in file order. The file and
the checkpoint must be where every worker can read them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client, WorkerPlugin, get_worker

from connectors.codecs import make_codec
from deploy.config import JobConfig, load_config
from deploy.job import build_codec, checkpoint_location
from embedding_store.client import StoreClient
from serving.model import FixedDense, ServingModel
from serving.offline import (
    FilePart,
    FileScores,
    checkpoint_dense,
    checkpoint_rows,
    pick_checkpoint,
    score_part,
)
from trainer.checkpoint import CheckpointBook, JobManifest

PLUGIN_NAME = "streamrec-scoring-model"


@dataclass(frozen=True)
class ScoringParameters:
    """Which parameters score: a job, its checkpoint at ``step`` (None: the newest), each
    store shard's checkpoint folder (None: the local job's run_dir/store/shard-NNN)."""

    job: Path
    step: int | None = None
    shards: Sequence[str] | None = None
    labels_required: bool = False


def load_model(
    params: ScoringParameters, job: JobConfig | None = None
) -> tuple[ServingModel, JobManifest, str]:
    """The job's :class:`ServingModel` over the checkpoint's parameters, the checkpoint, and
    where it was read. Raises ``OfflineError``, ``JobCheckpointError`` or ``OSError``."""
    job = job if job is not None else load_config(params.job)
    if job.features is None:
        msg = f"{params.job} has no `features:` section"
        raise ValueError(msg)
    dims = {name: t.dim for name, t in job.store.tables.items()}
    book = CheckpointBook(checkpoint_location(job))
    manifest = pick_checkpoint(book, params.step)
    dense = checkpoint_dense(book, manifest, job.trainer, job.features, dims)
    shards = list(params.shards or [])
    if not shards:
        shards = [
            str(job.run_dir / "store" / f"shard-{i:03d}") for i in range(len(manifest.shard_seqs))
        ]
    rows = StoreClient.from_shards([checkpoint_rows(job.store, manifest, shards)])
    codec = build_codec(job) or make_codec("json")
    model = ServingModel(
        "streamrec", job.features, codec, rows, FixedDense(dense),
        labels_required=params.labels_required,
    )  # fmt: skip
    return model, manifest, str(book.location)


class ScoringModelPlugin(WorkerPlugin):
    """Gives each Dask worker the scoring model, loaded on its first part."""

    name = PLUGIN_NAME

    def __init__(self, params: ScoringParameters) -> None:
        self.params = params
        self._model: ServingModel | None = None
        self._lock = threading.Lock()

    @property
    def model(self) -> ServingModel:
        with self._lock:
            if self._model is None:
                self._model = load_model(self.params)[0]
            return self._model

    def __getstate__(self) -> dict[str, Any]:
        return {"params": self.params}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.params = state["params"]
        self._model = None
        self._lock = threading.Lock()


def score_part_on_worker(path: str, part: FilePart, batch: int) -> FileScores:
    """A task: one part of the file scored with this worker's model."""
    plugin = get_worker().plugins[PLUGIN_NAME]
    assert isinstance(plugin, ScoringModelPlugin)  # registered under our name only
    return score_part(plugin.model, Path(path), part, batch=batch)


def score_on_cluster(
    client: Client,
    params: ScoringParameters,
    path: Path,
    parts: Sequence[FilePart],
    heads: tuple[str, ...],
    *,
    batch: int,
    on_progress: Callable[[int], None] | None = None,
) -> FileScores:
    """Score ``parts`` of ``path`` on the cluster of ``client``; the scores in file order."""
    client.register_plugin(ScoringModelPlugin(params), name=PLUGIN_NAME)
    futures = [
        client.submit(score_part_on_worker, str(path.resolve()), part, batch, pure=False)
        for part in parts
    ]
    out = FileScores(heads)
    for future in futures:  # in file order; the progress moves as each part is taken
        out.merge(future.result())
        if on_progress is not None:
            on_progress(out.records)
    return out
