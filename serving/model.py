"""What a prediction server runs: the training path's own code, the newest parameters.

A :class:`ServingModel` scores records in the job's format with the job's own
pieces, so training and serving cannot drift apart: the job's codec decodes
and validates them (the same bad-record reasons as the dead-letter topic),
``build_batch`` hashes and deduplicates their sparse features, the rows come
from the store (serving replicas that follow the training shards, see
:mod:`embedding_store.replica`), and ``pool`` and the dense network of the
newest published version (see :mod:`trainer.publish`) give one probability
per label head. Records need no labels.

The dense version is swapped whole: a :class:`DenseFollower` loads a newer
version fully off to the side and then replaces one reference, so a request
in flight finishes on the version it started with, and a server never goes
back to an older version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from connectors.codecs import Codec
from connectors.types import Chunk, RawChunk
from embedding_store.location import Location
from pipeline.batch import build_batch
from pipeline.spec import FeatureSpec
from serving.types import BadRecords, Prediction, RecordError
from trainer.config import TrainerConfig
from trainer.models import DenseNet, build_model, field_dims
from trainer.pooling import pool, to_tensors
from trainer.publish import PublishedDense, load_weights, published

log = logging.getLogger(__name__)


class RowReader(Protocol):
    """Reads rows without changing them (a ``StoreClient`` over serving replicas)."""

    def lookup(
        self, ids: Mapping[str, npt.ArrayLike], *, train: bool = ...
    ) -> Mapping[str, npt.NDArray[np.floating]]: ...


@dataclass(frozen=True)
class DenseVersion:
    """One loaded version of the dense network."""

    entry: PublishedDense
    module: DenseNet


class DenseFollower:
    """Loads the newest published dense weights, every ``poll_s`` on its own thread."""

    def __init__(
        self,
        location: Location,
        config: TrainerConfig,
        spec: FeatureSpec,
        dims: Mapping[str, int],
        *,
        poll_s: float = 0.2,
    ) -> None:
        self.location = location
        self.config = config
        self.spec = spec
        self.dims = dict(dims)
        self.poll_s = poll_s
        self.current: DenseVersion | None = None
        self.loaded_at: float | None = None  # wall time the current version was swapped in
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _build(self) -> DenseNet:
        return build_model(
            self.config.model,
            num_dense=len(self.spec.dense),
            field_dims=field_dims(self.spec, self.dims),
            num_tasks=len(self.spec.labels),
            field_names=[f.name for f in self.spec.sparse],
        )

    def refresh(self) -> bool:
        """Swap in the newest version when it is newer than the current one."""
        versions = published(self.location)
        if not versions:
            return False
        newest = versions[-1]
        if self.current is not None and newest.version <= self.current.entry.version:
            return False
        module = self._build()
        module.load_state_dict(load_weights(self.location, newest))
        module.eval()
        self.current = DenseVersion(newest, module)  # one reference: atomic for readers
        self.loaded_at = time.time()
        return True

    def start(self) -> None:
        """Load now (when anything is published) and then follow on a thread."""
        self._poll()
        self._thread = threading.Thread(target=self._run, name="dense-follower", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # a half-written upload, a store that hiccups: next poll
            self.failures += 1
            log.warning("loading published dense weights from %s: %s", self.location, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class ServingModel:
    """Scores records as the trainer would, with the newest parameters it has."""

    def __init__(
        self,
        name: str,
        spec: FeatureSpec,
        codec: Codec,
        rows: RowReader,
        dense: DenseFollower,
        *,
        sparse_version: object = None,
    ) -> None:
        """``sparse_version``: a callable giving the rows' version for responses (optional)."""
        self.name = name
        self.spec = spec.for_scoring()
        self.heads = tuple(spec.labels)
        self.codec = codec
        self.rows = rows
        self.dense = dense
        self._sparse_version = sparse_version

    def ready(self) -> bool:
        return self.dense.current is not None

    def metadata(self) -> Mapping[str, object]:
        current = self.dense.current
        return {
            "dense_version": current.entry.version if current is not None else None,
            "heads": list(self.heads),
        }

    def predict(self, records: Sequence[bytes]) -> Prediction:
        """One probability per head for each record; ``BadRecords`` names every bad one."""
        version = self.dense.current
        if version is None:
            msg = "no dense weights published yet"
            raise RuntimeError(msg)
        n = len(records)
        raw = RawChunk(Chunk("serve", "request", 0, n), np.arange(n, dtype=np.int64), records)
        table, bad = self.codec.decode(raw, self.spec)
        if bad:
            raise BadRecords([RecordError(b.position, b.field, b.reason, b.detail) for b in bad])
        batch = build_batch(table, self.spec)
        if batch.tables:
            rows = self.rows.lookup(
                {t: tb.unique_ids for t, tb in batch.tables.items()}, train=False
            )
            for t, tb in batch.tables.items():
                tb.rows = np.asarray(rows[t], dtype=np.float32)
        with torch.no_grad():
            bt = to_tensors(batch, self.spec)
            logits = version.module(bt.dense, pool(bt, self.spec))
            probs = torch.sigmoid(logits).numpy()
        entry = version.entry
        parameters: dict[str, int | float | str] = {
            "dense_version": entry.version,
            "dense_step": entry.step,
            "samples_learned": entry.samples,
        }
        if callable(self._sparse_version):
            parameters["sparse_version"] = self._sparse_version()
        return Prediction(
            probabilities={h: probs[:, j].astype(np.float32) for j, h in enumerate(self.heads)},
            parameters=parameters,
        )
