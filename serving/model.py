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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import torch
from torch import Tensor

from connectors.codecs import Codec
from connectors.codecs.json_lines import JsonLinesCodec
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, RawChunk
from connectors.validate import POSITION, validate
from embedding_store.errors import StoreUnavailable
from embedding_store.location import Location
from pipeline.batch import build_batch
from pipeline.json_scan import JsonScanBuilder
from pipeline.plain import PlainBatchBuilder
from pipeline.types import FlatBatch, PreparedBatch
from serving.types import (
    BadRecords,
    Deadline,
    DeadlineExceeded,
    ModelUnavailable,
    Prediction,
    RecordError,
)
from trainer.config import TrainerConfig
from trainer.fused_linear import LinearChain, fuse_for_inference
from trainer.joined_fields import JoinedFields, joined_flat, sparse_key
from trainer.models import FFNN, DenseNet, build_model, field_dims
from trainer.pooling import host_tensor
from trainer.publish import PublishedDense, load_weights, published

log = logging.getLogger(__name__)


class RowReader(Protocol):
    """Reads rows without changing them (a ``StoreClient`` over serving replicas)."""

    def lookup(
        self,
        ids: Mapping[str, npt.ArrayLike],
        *,
        train: bool = ...,
        timeout_s: float | None = ...,
    ) -> Mapping[str, npt.NDArray[np.floating]]: ...


@dataclass(frozen=True)
class DenseVersion:
    """One loaded version of the dense network; ``chain``: an FFNN's layers as one
    oneDNN chain (:class:`trainer.fused_linear.LinearChain`), where they fused."""

    entry: PublishedDense
    module: DenseNet
    chain: LinearChain | None = field(init=False)

    def __post_init__(self) -> None:
        module = self.module
        chain = LinearChain.of([*module.mlp, module.head]) if isinstance(module, FFNN) else None
        object.__setattr__(self, "chain", chain)  # frozen: set once, here


def inference_module(
    config: TrainerConfig, spec: FeatureSpec, dims: Mapping[str, int], state: Mapping[str, Any]
) -> DenseNet:
    """The job's dense network with ``state`` loaded, in eval mode, its linear layers
    fused for inference (:mod:`trainer.fused_linear`; the state dict keeps its keys)."""
    module = build_model(
        config.model,
        num_dense=len(spec.dense),
        field_dims=field_dims(spec, dims),
        num_tasks=len(spec.labels),
        field_names=[f.name for f in spec.sparse],
    )
    module.load_state_dict(state)
    module.eval()
    fuse_for_inference(module)
    return module


def _probabilities(version: DenseVersion, dense: Tensor, joined: Tensor) -> npt.NDArray[np.float32]:
    """The sigmoid of the network's logits, ``[B, heads]``: through its chain where it
    has one, so that every path of a version rounds alike."""
    if version.chain is not None:
        return version.chain(torch.cat([dense, joined], dim=1), "sigmoid").numpy()
    logits = version.module.forward_joined(dense, joined)
    return torch.sigmoid(logits).numpy().astype(np.float32, copy=False)


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

    def refresh(self) -> bool:
        """Swap in the newest version when it is newer than the current one."""
        versions = published(self.location)
        if not versions:
            return False
        newest = versions[-1]
        if self.current is not None and newest.version <= self.current.entry.version:
            return False
        state = load_weights(self.location, newest)
        module = inference_module(self.config, self.spec, self.dims, state)
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


class DenseSource(Protocol):
    """Where a model's dense network comes from: the newest published, or a fixed one."""

    @property
    def current(self) -> DenseVersion | None: ...


@dataclass(frozen=True)
class FixedDense:
    """One dense version that never changes (scoring a file from a job checkpoint)."""

    current: DenseVersion


@dataclass(frozen=True)
class Scored:
    """A batch's good records scored, and its bad ones.

    ``positions``: each scored record's index in the batch; ``probabilities``:
    ``[len(positions), heads]``; ``labels`` likewise (NaN where a record has none).
    """

    positions: npt.NDArray[np.int64]
    probabilities: npt.NDArray[np.float32]
    labels: npt.NDArray[np.float32]
    bad: list[BadRecord]
    parameters: dict[str, int | float | str]


class ServingModel:
    """Scores records as the trainer would, with the newest parameters it has.

    JSON records whose values are all plainly good are scanned straight from
    their bytes into a batch (:mod:`pipeline.json_scan`); what that path
    declines goes, up to ``plain_max_records`` records, through Python objects
    (:mod:`pipeline.plain`), and otherwise through the codec's columnar decode,
    which names what is wrong.
    """

    # Where the per-record Python of the plain path starts to cost more than the
    # columnar path's per-field costs, for Criteo-like records.
    plain_max_records = 64

    def __init__(
        self,
        name: str,
        spec: FeatureSpec,
        codec: Codec,
        rows: RowReader,
        dense: DenseSource,
        *,
        labels_required: bool = False,
        sparse_version: Callable[[], int] | None = None,
        rows_ready: Callable[[], bool] | None = None,
    ) -> None:
        """``labels_required``: records without labels are bad (evaluating, not serving).
        ``sparse_version``: the rows' version for responses (see ``serving.freshness``).
        ``rows_ready``: whether the rows can be read yet (replicas in this process that
        have caught up); None: the reader answers for itself."""
        self.name = name
        self.spec = spec if labels_required else spec.for_scoring()
        self.heads = tuple(spec.labels)
        self.codec = codec
        self.rows = rows
        self.dense = dense
        self._sparse_version = sparse_version
        self._rows_ready = rows_ready
        self._sparse_key = sparse_key(self.spec)
        # The scanned and plain paths read JSON only: their builders (one plain builder,
        # the scanner's), or None.
        self._scan: JsonScanBuilder | None = None
        self._plain: tuple[JsonLinesCodec, PlainBatchBuilder] | None = None
        if isinstance(codec, JsonLinesCodec):
            self._scan = JsonScanBuilder(self.spec)
            self._plain = (codec, self._scan.plain)

    def ready(self) -> bool:
        rows = self._rows_ready is None or self._rows_ready()
        return rows and self.dense.current is not None

    def metadata(self) -> Mapping[str, object]:
        current = self.dense.current
        version = current.entry.version if current is not None else None
        # The served version is the newest dense version loaded: a URL naming it
        # (/v2/models/{name}/versions/{v}) answers while it is served.
        return {"version": version, "dense_version": version, "heads": list(self.heads)}

    def _version(self) -> DenseVersion:
        version = self.dense.current
        if version is None:
            msg = "no dense weights published yet"
            raise RuntimeError(msg)
        return version

    def score_records(self, records: Sequence[bytes], deadline: Deadline | None = None) -> Scored:
        """Decode and score ``records`` (bytes in the job's format); bad ones are returned.

        ``deadline``: checked between the stages (decoding, reading rows, the forward
        pass), and the rows' read ends within the time left (``DeadlineExceeded``);
        a stage's compiled kernel, once called, runs to its end."""
        version = self._version()
        scored = self._scanned(records, version, deadline)
        if scored is None:
            scored = self._plainly(records, version, deadline)
        return scored if scored is not None else self._decoded(records, version, deadline)

    def warm_up(self) -> tuple[str, ...]:
        """Score the spec's example record (:meth:`FeatureSpec.example_record`) by each
        path a request may take, so that their kernels are compiled before the first
        request comes (numba compiles a kernel on its first call in a process: tens of
        seconds when its cache is cold, which no request's deadline should pay).
        Returns the paths that scored it (``"scan"``, ``"plain"``, ``"columns"``).
        Needs a dense version (``RuntimeError`` before one is loaded)."""
        version = self._version()
        records = self.codec.encode(pa.Table.from_pylist([self.spec.example_record()]))
        paths = {"scan": self._scanned, "plain": self._plainly, "columns": self._decoded}
        scored = {name: path(records, version, None) for name, path in paths.items()}
        return tuple(name for name, s in scored.items() if s is not None and not s.bad)

    def _scanned(
        self, records: Sequence[bytes], version: DenseVersion, deadline: Deadline | None
    ) -> Scored | None:
        """JSON records scanned from their bytes; None where the scan declines them."""
        flat = self._scan.scan(records) if self._scan is not None else None
        if flat is None:
            return None
        _check(deadline, "decoding")
        return self._score_flat(flat, version, deadline)

    def _plainly(
        self, records: Sequence[bytes], version: DenseVersion, deadline: Deadline | None
    ) -> Scored | None:
        """A few plainly good JSON records, which skip Arrow (see :mod:`pipeline.plain`);
        None for anything else."""
        if self._plain is None or len(records) > self.plain_max_records:
            return None
        json_codec, builder = self._plain
        objects = json_codec.plain_objects(records, self.spec)
        batch = builder.build(objects) if objects is not None else None
        if batch is None:
            return None
        _check(deadline, "decoding")
        positions = np.arange(len(records), dtype=np.int64)
        return self._score_batch(batch, positions, [], version, deadline)

    def _decoded(
        self, records: Sequence[bytes], version: DenseVersion, deadline: Deadline | None
    ) -> Scored:
        """Any records, by the codec's columnar decode, which names what is wrong."""
        _check(deadline, "decoding")
        n = len(records)
        raw = RawChunk(Chunk("serve", "request", 0, n), np.arange(n, dtype=np.int64), records)
        table, bad = self.codec.decode(raw, self.spec)
        _check(deadline, "decoding")
        return self._score(table, bad, version, deadline)

    def score_table(self, table: pa.Table) -> Scored:
        """Validate and score an Arrow table of records (a Parquet file's rows)."""
        version = self._version()
        n = table.num_rows
        raw = RawChunk(Chunk("file", "rows", 0, n), np.arange(n, dtype=np.int64), table=table)
        good, bad = validate(table, self.spec, raw)
        return self._score(good, bad, version)

    def _score(
        self,
        table: pa.Table,
        bad: list[BadRecord],
        version: DenseVersion,
        deadline: Deadline | None = None,
    ) -> Scored:
        positions = np.asarray(table.column(POSITION).to_numpy(), dtype=np.int64)
        if table.num_rows == 0:
            empty = np.zeros((0, len(self.heads)), np.float32)
            return Scored(positions, empty, empty, bad, self._parameters(version))
        batch = build_batch(table, self.spec)
        _check(deadline, "hashing")
        return self._score_batch(batch, positions, bad, version, deadline)

    def _parameters(self, version: DenseVersion) -> dict[str, int | float | str]:
        entry = version.entry
        parameters: dict[str, int | float | str] = {
            "dense_version": entry.version,
            "dense_step": entry.step,
            "samples_learned": entry.samples,
        }
        if self._sparse_version is not None:
            parameters["sparse_version"] = self._sparse_version()
        return parameters

    def _score_flat(
        self, flat: FlatBatch, version: DenseVersion, deadline: Deadline | None = None
    ) -> Scored:
        """Score scanned records: with replicas of this process whose tables share one dim,
        their rows in one read and the model's input in one kernel call, no per-table
        objects (``trainer.joined_fields.joined_flat``); otherwise as any batch."""
        positions = np.arange(len(flat), dtype=np.int64)
        assert self._scan is not None  # scanned records come from it
        read_flat = getattr(self.rows, "read_flat", None)
        rows = None
        if read_flat is not None:
            ids = flat.ids
            names = self._scan.plain.table_names
            try:
                if deadline is None:
                    rows = read_flat(names, ids.unique, ids.unique_at)
                else:
                    rows = read_flat(names, ids.unique, ids.unique_at, timeout_s=deadline.left())
            except StoreUnavailable as exc:
                raise _unavailable(exc, deadline) from exc
        if rows is None:
            batch = PreparedBatch(flat.labels, flat.dense, self._scan.plain.tables_of(flat.ids))
            return self._score_batch(batch, positions, [], version, deadline)
        _check(deadline, "reading rows")
        with torch.no_grad():
            if version.chain is not None:  # the FFNN's input made as one matrix
                x = joined_flat(rows, flat.ids, self._sparse_key, len(flat), lead=flat.dense)
                probs = version.chain(x, "sigmoid").numpy()
            else:
                joined = joined_flat(rows, flat.ids, self._sparse_key, len(flat))
                probs = _probabilities(version, host_tensor(flat.dense), joined)
        return Scored(positions, probs, flat.labels, [], self._parameters(version))

    def _score_batch(
        self,
        batch: PreparedBatch,
        positions: npt.NDArray[np.int64],
        bad: list[BadRecord],
        version: DenseVersion,
        deadline: Deadline | None = None,
    ) -> Scored:
        parameters = self._parameters(version)
        if batch.tables:
            ids = {t: tb.unique_ids for t, tb in batch.tables.items()}
            try:
                if deadline is None:
                    rows = self.rows.lookup(ids, train=False)
                else:
                    rows = self.rows.lookup(ids, train=False, timeout_s=deadline.left())
            except StoreUnavailable as exc:
                raise _unavailable(exc, deadline) from exc
            for t, tb in batch.tables.items():
                tb.rows = np.asarray(rows[t], dtype=np.float32)
            _check(deadline, "reading rows")
        with torch.no_grad():
            # The trainer's CPU path: every field pooled into the model's input matrix in
            # one pass; a torch op per table costs a small request dearly.
            joined = JoinedFields(batch, self.spec).gather()
            probs = _probabilities(version, host_tensor(batch.dense), joined)
        return Scored(positions, probs, batch.labels, bad, parameters)

    def predict(self, records: Sequence[bytes], *, deadline: Deadline | None = None) -> Prediction:
        """One probability per head for each record; ``BadRecords`` names every bad one;
        ``DeadlineExceeded`` once ``deadline`` passed between two stages."""
        scored = self.score_records(records, deadline)
        if scored.bad:
            raise BadRecords(
                [RecordError(b.position, b.field, b.reason, b.detail) for b in scored.bad]
            )
        return Prediction(
            probabilities={h: scored.probabilities[:, j] for j, h in enumerate(self.heads)},
            parameters=scored.parameters,
        )


def _check(deadline: Deadline | None, stage: str) -> None:
    if deadline is not None:
        deadline.check(stage)


def _unavailable(exc: StoreUnavailable, deadline: Deadline | None) -> Exception:
    """A read of rows that failed: late when the request's time ran out, else the
    replicas' 503."""
    if deadline is not None and deadline.passed():
        return DeadlineExceeded(deadline.timeout_s, "reading rows")
    return ModelUnavailable(str(exc))
