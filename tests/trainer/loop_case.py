"""The synthetic case the ``TrainLoop`` tests share: a spec, its tables, chunks and batches.

A small stream (seed 5, small vocabularies) planned in ``BATCH``-record chunks,
prepared lazily as the loop asks for batches, and the trainer config of the
oracle comparisons (FFNN, Adam, no checkpoints, torch's own initial weights).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from connectors.spec import FeatureSpec
from connectors.synthetic import SyntheticConfig, SyntheticSource
from connectors.types import Chunk
from embedding_store.client import StoreClient
from embedding_store.types import StoreConfig, TableConfig
from pipeline.prepare import prepare
from pipeline.types import PreparedBatch
from trainer.config import CheckpointConfig, DenseOptimizerConfig, TrainerConfig
from trainer.models import FFNNConfig

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["click"],
        "dense": [{"name": f"I{i}", "transform": "log1p", "min_value": 0} for i in (1, 2, 3, 4)],
        "sparse": [
            {"name": "C1", "table": "a"},
            {"name": "C2", "table": "a", "pooling": "mean"},
            {"name": "C3", "table": "b"},
            {"name": "C4", "table": "b"},
        ],
    }
)
TABLES = {
    "a": TableConfig(
        dim=4,
        optimizer={"kind": "adagrad", "lr": 0.1},
        initializer={"kind": "normal", "std": 0.1},
    ),
    "b": TableConfig(
        dim=6,
        optimizer={"kind": "adagrad", "lr": 0.1, "rowwise": True},
        initializer={"kind": "uniform", "scale": 0.1},
    ),
}
STORE = StoreConfig(tables=TABLES, row_dtype="float32")
BATCH = 48
MODEL = FFNNConfig(hidden=[16, 8])
ADAM = DenseOptimizerConfig(kind="adam", lr=0.01)
NO_CHECKPOINTS = CheckpointConfig(enabled=False)


def source(partitions: int = 1) -> SyntheticSource:
    """The synthetic stream of these tests (seed 5), in chunks of ``BATCH`` records."""
    # Small vocabularies: ids come back batch after batch, so a stale row shows.
    return SyntheticSource(
        SyntheticConfig(seed=5, partitions=partitions, cardinalities=(20,) * 26, chunk_size=BATCH)
    )


def chunks(src: SyntheticSource, partition: str, start: int, stop: int) -> list[Chunk]:
    """``partition``'s records ``[start, stop)`` planned as chunks of ``BATCH`` or fewer."""
    out = []
    pos = start
    while pos < stop:
        chunk = src.plan(partition, pos, min(BATCH, stop - pos))
        assert chunk is not None
        out.append(chunk)
        pos = chunk.end
    return out


def lazy_batches(
    src: SyntheticSource,
    planned: Sequence[Chunk],
    store: StoreClient | None,
    *,
    ahead: int = 0,
    prepared_after: list[int] | None = None,
    pushes: Callable[[], int] | None = None,
) -> Iterator[PreparedBatch]:
    """Prepare (and look up) chunk i only when the loop asks for batch i - ``ahead``.

    ``ahead=0`` is what the runner does in sync mode; ``ahead>0`` prefetches, so
    a lookup may miss the pushes of the batches still ahead of it.
    ``prepared_after`` records ``pushes()`` (pushes applied so far) at each lookup.
    """
    todo = deque(planned)
    ready: deque[PreparedBatch] = deque()
    while True:
        while todo and len(ready) <= ahead:
            if prepared_after is not None and pushes is not None:
                prepared_after.append(pushes())
            batch, bad = prepare(
                todo.popleft(), src, SPEC, None, lookup=store is not None, store=store
            )
            assert not bad
            ready.append(batch)
        if not ready:
            return
        yield ready.popleft()


def config(mode: str, **kw: Any) -> TrainerConfig:
    """The oracle comparisons' trainer in ``mode``; ``kw`` replaces fields."""
    base: dict[str, Any] = {
        "mode": mode,
        "batch_size": BATCH,
        "model": MODEL,
        "optimizer": ADAM,
        "device": "cpu",
        "log_every_s": 3600.0,
        "checkpoint": NO_CHECKPOINTS,
        "label_prior": None,  # the oracles start from torch's init
    }
    return TrainerConfig(**{**base, **kw})
