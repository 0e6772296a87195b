"""Fresh reads of a rank's own pushes, against real store shard processes over gRPC.

The semantics: on one rank, a row pushed at step t is what step t + 1 trains,
at any staleness. The hybrid loop's lookups run ``staleness - 1`` batches ahead
of it (as the runner's prefetch does), on small vocabularies so that nearly
every row of a batch was pushed by the batches just before it (hot ids).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from pipeline.types import PreparedBatch
from tests.conftest import grpc_address, write_job_yaml
from tests.trainer.test_loop import (
    BATCH,
    SPEC,
    TABLES,
    chunks,
    config,
    lazy_batches,
    source,
)
from trainer.loop import DenseModel, TrainLoop

STEPS = 12


def trained_rows_against_the_store(
    store: StoreClient, staleness: int, **kw: Any
) -> tuple[TrainLoop, list[dict[str, tuple[np.ndarray, np.ndarray]]]]:
    """Run the hybrid loop; per step, the rows it trained and the store's rows of the same
    ids read just before the step (every earlier push of this one rank has landed then).
    """
    cfg = config("hybrid", staleness=staleness, **kw)
    dense = DenseModel(cfg, SPEC, store.dims, torch.device("cpu"))
    loop = TrainLoop(cfg, SPEC, store, dense)
    seen: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    step = loop._forward_backward

    def recorded(batch: PreparedBatch) -> dict[str, Any]:
        loop.pusher.drain()  # the store as of every push before this step
        now = store.lookup({k: t.unique_ids for k, t in batch.tables.items()}, train=False)
        seen.append({k: (t.rows.copy(), now[k]) for k, t in batch.tables.items()})  # type: ignore[union-attr]
        return step(batch)

    loop._forward_backward = recorded  # type: ignore[method-assign]
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    stats = loop.run(lazy_batches(source(), planned, store, ahead=staleness - 1))
    assert stats.steps == STEPS
    return loop, seen


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two shard processes for the module (each test's rows are read against the store
    as it is, so tests sharing them do not disturb each other's assertions).
    """
    tmp = tmp_path_factory.mktemp("fresh-rows")
    tables = {name: t.model_dump(mode="json") for name, t in TABLES.items()}
    job = write_job_yaml(tmp / "job.yaml", store={"tables": tables, "row_dtype": "float16"})
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token)
    procs = [ShardProcess.start(job, tmp / f"shard-{i}", token_file=tmp / "token") for i in (0, 1)]
    try:
        yield grpc_address(procs), token
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("staleness", [1, 2, 4, 8])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "socket"])
def test_a_row_pushed_at_step_t_is_what_step_t_plus_1_trains(
    shards: tuple[str, str], staleness: int, shared_memory: bool
) -> None:
    address, token = shards
    store = StoreClient.connect(address, token=token, shared_memory=shared_memory)
    loop, seen = trained_rows_against_the_store(store, staleness)
    for step, tables in enumerate(seen):
        for name, (trained, current) in tables.items():
            np.testing.assert_array_equal(trained, current, err_msg=f"step {step} table {name}")
    # The lookups ran ahead and missed pushes to these rows: the overlay did the work.
    if staleness > 1:
        assert max(loop.stats.missed_pushes_by_row) >= staleness - 1
        assert loop.stats.rows_freshened > 0
    store.close()


def test_without_fresh_rows_a_hybrid_step_trains_rows_older_than_the_store(
    shards: tuple[str, str],
) -> None:
    """The defect fresh rows fix: hot rows trained without this rank's last pushes."""
    address, token = shards
    store = StoreClient.connect(address, token=token)
    _, seen = trained_rows_against_the_store(store, 4, fresh_rows=False)
    stale = sum(
        int((trained != current).any(axis=1).sum())
        for tables in seen
        for trained, current in tables.values()
    )
    assert stale > 0
    store.close()
