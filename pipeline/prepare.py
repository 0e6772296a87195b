"""The ``prepare`` task: one chunk in, one ``PreparedBatch`` (plus its bad records) out.

It runs on a Dask worker: read the chunk from its source, decode and validate,
hash and deduplicate the sparse features, and look the unique ids up in the
embedding store through the worker's one ``StoreClient`` (see
``StoreClientPlugin``). A chunk lost with a worker is prepared again elsewhere
with the same result: what it is prepared with is either in the call or, for a
runner, in a ``PrepareContext`` every worker holds (``prepare_in_context``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from distributed import Worker, WorkerPlugin, get_worker

from connectors.codecs import Codec
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, Chunk, Source
from connectors.validate import count_reasons, validate
from embedding_store.client import StoreClient
from embedding_store.types import RowDtype
from pipeline.batch import build_batch
from pipeline.types import PreparedBatch

PLUGIN_NAME = "streamrec-store"


@dataclass(frozen=True)
class StoreAddress:
    """How workers reach the store: an address, the job's token, the row dtype.

    ``latency_s`` (a benchmarking aid) is added to every store call of the workers.
    """

    address: str
    token: str | None = None
    row_dtype: RowDtype | None = None
    latency_s: float = 0.0


class StoreClientPlugin(WorkerPlugin):
    """Gives each Dask worker one ``StoreClient`` (connections are reused by every task)."""

    name = PLUGIN_NAME

    def __init__(self, store: StoreAddress) -> None:
        self.store = store
        self._client: StoreClient | None = None
        self._lock = threading.Lock()

    def setup(self, worker: Worker) -> None:
        self._lock = threading.Lock()
        self._client = None

    @property
    def client(self) -> StoreClient:
        # Connect lazily, so a worker that starts before the store does not fail.
        with self._lock:
            if self._client is None:
                self._client = StoreClient.connect(
                    self.store.address,
                    token=self.store.token,
                    row_dtype=self.store.row_dtype,
                    latency_s=self.store.latency_s,
                )
            return self._client

    def teardown(self, worker: Worker) -> None:
        if self._client is not None:
            self._client.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.store = state["store"]
        self._client = None
        self._lock = threading.Lock()


def worker_store_client() -> StoreClient:
    """The ``StoreClient`` of the worker this task runs on."""
    worker = get_worker()
    try:
        plugin = worker.plugins[PLUGIN_NAME]
    except KeyError:
        msg = (
            f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: register "
            "StoreClientPlugin on the Dask client before submitting prepare tasks"
        )
        raise RuntimeError(msg) from None
    assert isinstance(plugin, StoreClientPlugin)  # registered under our name only
    return plugin.client


class PrepareContext(WorkerPlugin):
    """A runner's source, spec and codec, held by every worker once instead of sent per task.

    In every task they would cost the scheduler, which unpickles each task it is
    given (a spec of a few dozen fields is hundreds of objects) and keeps the last
    thousand messages of each stream: a continuous job would churn small objects
    through the scheduler's heap and grow its memory. On a worker, one source
    serves every chunk, so its broker
    connections (cached per thread) outlive a chunk instead of being opened for each.
    A worker started later gets the plugin from the scheduler before any task.
    """

    def __init__(self, name: str, source: Source, spec: FeatureSpec, codec: Codec | None) -> None:
        self.name = name
        self.source = source
        self.spec = spec
        self.codec = codec

    def teardown(self, worker: Worker) -> None:
        self.source.close()


def prepare_in_context(
    chunk: Chunk, context: str, *, lookup: bool = True
) -> tuple[PreparedBatch, list[BadRecord]]:
    """:func:`prepare` with the source, spec and codec of this worker's ``context`` plugin."""
    worker = get_worker()
    plugin = worker.plugins.get(context)
    if not isinstance(plugin, PrepareContext):
        msg = (
            f"worker {worker.address} has no prepare context {context!r}: register a "
            "PrepareContext of that name on the Dask client before submitting its chunks"
        )
        raise RuntimeError(msg)
    return prepare(chunk, plugin.source, plugin.spec, plugin.codec, lookup=lookup)


def prepare(
    chunk: Chunk,
    source: Source,
    spec: FeatureSpec,
    codec: Codec | None,
    *,
    lookup: bool = True,
    step: int | None = None,
    store: StoreClient | None = None,
) -> tuple[PreparedBatch, list[BadRecord]]:
    """Read, decode, validate, hash, deduplicate and look up one chunk.

    ``store`` defaults to the worker's client; ``lookup=False`` skips the store
    (rows stay None). Bad records are returned, not raised: the caller
    dead-letters them.
    """
    raw = source.read(chunk)
    if raw.table is not None:
        table, bad = validate(raw.table, spec, raw)
    else:
        if codec is None:
            msg = f"source {source.name!r} yields raw payloads: a codec is needed to decode them"
            raise ValueError(msg)
        table, bad = codec.decode(raw, spec)
    batch = build_batch(table, spec)
    batch.source = chunk.source
    batch.partition = chunk.partition
    batch.start = chunk.start
    batch.end = chunk.end
    batch.bad_records = len(bad)
    batch.bad_by_reason = count_reasons(bad)
    if lookup and batch.tables:
        client = store if store is not None else worker_store_client()
        # Wall-clock, so the trainer (another process) can tell which of its pushes
        # this lookup saw: the observed staleness.
        batch.looked_up_at = time.time()
        rows = client.lookup(
            {name: t.unique_ids for name, t in batch.tables.items()}, train=True, step=step
        )
        for name, t in batch.tables.items():
            t.rows = rows[name]
    return batch, bad
