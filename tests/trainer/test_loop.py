"""``TrainLoop`` itself, in one process (and two ranks over gloo), against the oracle.

- ``mode: sync`` with one rank is a plain single-process PyTorch model: the
  real loop (in-process store, pusher thread, lazy prepare of each chunk) gives
  the losses, dense weights and every embedding row of ``ReferenceModel``
  (``nn.EmbeddingBag``-style tables with sparse gradients, the same initial
  rows and optimizers), step by step; a hybrid run (stale lookups) does not.
- A job checkpoint taken by the loop, a crash after it (the store goes on
  with pushes the checkpoint does not know), ``restore_job`` and a resume from
  the manifest's positions end with the model of an uninterrupted run.
- Two ranks over torch.distributed (gloo, CPU) with uneven streams finish in
  every mode; hybrid and sync ranks end with the same dense weights and the
  checkpoints count every rank's samples, the finished rank included.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.types import Chunk
from embedding_store.client import StoreClient
from embedding_store.shard import StoreShard
from pipeline.types import PreparedBatch
from tests.support.processes import run_ranks
from tests.trainer.loop_case import (
    ADAM,
    BATCH,
    MODEL,
    SPEC,
    STORE,
    TABLES,
    chunks,
    config,
    lazy_batches,
    source,
)
from trainer.checkpoint import CheckpointBook
from trainer.config import CheckpointConfig
from trainer.dense_model import DenseModel
from trainer.job_checkpoint import JobCheckpointer, restore_job
from trainer.ledger import ledger_entries
from trainer.loop import TrainLoop
from trainer.loop_options import Compute, Outputs, Recovery, Start, Until
from trainer.models import build_model, field_dims, loss_fn
from trainer.progress import Progress
from trainer.reference import ReferenceModel

STEPS = 10


def store_rows(shards: Sequence[StoreShard]) -> dict[str, dict[str, np.ndarray]]:
    """Every row of every table (ids sorted), with its optimizer state and step count."""
    out = {}
    for name in TABLES:
        parts = [s.tables[name].export(dirty_only=False, mark_clean=False)[0] for s in shards]
        ids = np.concatenate([p.ids for p in parts])
        order = np.argsort(ids)
        out[name] = {
            "ids": ids[order],
            "weights": np.concatenate([p.weights for p in parts])[order],
            "state": np.concatenate([p.state for p in parts])[order],
            "row_step": np.concatenate([p.row_step for p in parts])[order],
        }
    return out


def dense_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# --- 1. the oracle: sync mode with one rank is plain PyTorch ----------------------------


def reference_run(planned: Sequence[Chunk]) -> tuple[list[float], ReferenceModel]:
    """Single-process PyTorch: the same initial dense weights (seed 0), Adam, Adagrad rows."""
    torch.manual_seed(0)
    dims = field_dims(SPEC, {name: cfg.dim for name, cfg in TABLES.items()})
    dense = build_model(MODEL, num_dense=len(SPEC.dense), field_dims=dims, num_tasks=1)
    ref = ReferenceModel(SPEC, TABLES, dense)
    opt = torch.optim.Adam(ref.parameters(), lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps)
    losses = [ref.train_step(b, opt).loss for b in lazy_batches(source(), planned, None)]
    return losses, ref


def loop_run(
    mode: str,
    planned: Sequence[Chunk],
    *,
    ahead: int = 0,
    step_threads: int | None = None,
    device: str = "cpu",
    **kw: Any,
) -> tuple[TrainLoop, StoreClient, list[int], list[Progress]]:
    cfg = config(mode, **kw)
    store = StoreClient.connect("inproc://2", config=STORE)
    dense = DenseModel(cfg, SPEC, store.dims, torch.device(device))
    reports: list[Progress] = []
    loop = TrainLoop(
        cfg,
        SPEC,
        store,
        dense,
        compute=Compute(device=torch.device(device), step_threads=step_threads),
        outputs=Outputs(on_progress=reports.append),
    )
    prepared_after: list[int] = []
    batches = lazy_batches(
        source(),
        planned,
        store,
        ahead=ahead,
        prepared_after=prepared_after,
        pushes=lambda: loop.pusher.applied,
    )
    stats = loop.run(batches)
    assert stats.steps == len(planned)
    assert stats.samples == sum(len(c) for c in planned)
    assert stats.stopped_by == "end_of_stream"
    return loop, store, prepared_after, reports


def assert_like_reference(
    loop: TrainLoop,
    store: StoreClient,
    ref_losses: list[float],
    ref: ReferenceModel,
    slack: float = 1.0,
) -> None:
    """``slack`` scales the tolerances (sums over the batch taken in another order)."""
    np.testing.assert_allclose(loop._losses, ref_losses, rtol=1e-5 * slack, atol=1e-7 * slack)
    for (name, got), want in zip(
        loop.dense.module.named_parameters(), ref.dense.parameters(), strict=True
    ):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5 * slack, atol=1e-6 * slack, msg=name)
    for name, table in ref.embeddings.tables.items():
        ids = np.fromiter(table._index, np.uint64, len(table))
        got_rows = store.lookup({name: ids}, train=False)[name]
        np.testing.assert_allclose(
            got_rows,
            ref.embeddings.rows(name, ids),
            rtol=1e-5 * slack,
            atol=1e-6 * slack,
            err_msg=name,
        )
        # ... and the store holds no row the reference does not.
        assert sum(t.rows for s in store.stats() for t in s.tables if t.name == name) == len(ids)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], ReferenceModel]:
    return reference_run(chunks(source(), "synthetic/0", 0, STEPS * BATCH))


def test_sync_loop_with_one_rank_equals_single_process_pytorch(
    reference: tuple[list[float], ReferenceModel],
) -> None:
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    loop, store, prepared_after, reports = loop_run("sync", planned)
    ref_losses, ref = reference
    # Sync: chunk i is looked up only after the pushes of batches 0..i-1 are applied.
    assert prepared_after == list(range(STEPS))
    assert len(loop._losses) == STEPS
    assert len(set(ref_losses)) == STEPS  # training moves the model
    assert_like_reference(loop, store, ref_losses, ref)
    # The report on the way out says the same.
    assert reports[-1].step == STEPS
    assert reports[-1].samples == STEPS * BATCH
    assert reports[-1].loss == pytest.approx(float(np.mean(ref_losses)), rel=1e-5)
    # Rows were learned, not only created.
    for name, table in ref.embeddings.tables.items():
        ids = np.fromiter(table._index, np.uint64, len(table))
        fresh = StoreClient.connect("inproc://1", config=STORE).lookup({name: ids})[name]
        assert not np.allclose(fresh, store.lookup({name: ids}, train=False)[name], atol=1e-4)
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_loop_on_a_gpu_equals_single_process_pytorch_on_the_cpu(
    reference: tuple[list[float], ReferenceModel], mode: str
) -> None:
    """The dense network on ``cuda``, the rows and the oracle on the CPU: the same losses,
    weights and rows, up to the GPU's other order of summation (and TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    # Hybrid: lookups a batch early and a push in flight, every row read fresh.
    hybrid = {"staleness": 2, "push_queue": 1, "fresh_rows": "exact"}
    kw: dict[str, Any] = hybrid if mode == "hybrid" else {}
    loop, store, _, reports = loop_run(mode, planned, ahead=1 if kw else 0, device="cuda", **kw)
    assert next(loop.dense.module.parameters()).device.type == "cuda"
    assert reports[-1].samples == STEPS * BATCH
    ref_losses, ref = reference
    assert_like_reference(loop, store, ref_losses, ref, slack=20.0)
    store.close()


@pytest.mark.parametrize("threads", [2, 3])  # 4 and 6 chunks, the latter uneven
def test_sync_loop_with_a_split_step_equals_single_process_pytorch(
    reference: tuple[list[float], ReferenceModel], threads: int
) -> None:
    # trainer.step_threads: each step's batch in chunks over the threads, the chunks'
    # gradients added up in chunk order. Only float rounding tells it apart (Adam's
    # normalised steps carry it into the weights): 10x the tolerances.
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    cfg = config("sync")
    store = StoreClient.connect("inproc://2", config=STORE)
    loop = TrainLoop(cfg, SPEC, store, DenseModel(cfg, SPEC, store.dims, torch.device("cpu")))
    assert loop._split is None  # the config's default: no split
    store.close()
    loop, store, _, _ = loop_run("sync", planned, step_threads=threads)
    assert loop._split is not None
    assert loop._split.threads == threads
    ref_losses, ref = reference
    assert_like_reference(loop, store, ref_losses, ref, slack=10.0)
    store.close()


def test_split_step_threads_come_from_the_config() -> None:
    store = StoreClient.connect("inproc://1", config=STORE)
    cfg = config("hybrid", step_threads=3)
    loop = TrainLoop(cfg, SPEC, store, DenseModel(cfg, SPEC, store.dims, torch.device("cpu")))
    assert loop._split is not None
    assert loop._split.threads == 3
    loop.run(iter([]))  # the run's end stops the step's threads
    assert loop._split._pool._shutdown
    store.close()


def test_hybrid_loop_with_stale_lookups_differs_from_the_reference(
    reference: tuple[list[float], ReferenceModel],
) -> None:
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    loop, store, prepared_after, _ = loop_run(
        "hybrid", planned, ahead=1, staleness=2, fresh_rows="off"
    )
    ref_losses, ref = reference
    # Batch i + 1 was looked up before batch i was learned: it missed at least one push.
    assert all(applied < i for i, applied in enumerate(prepared_after) if i > 0)
    # The first batch saw every push there was (none).
    np.testing.assert_allclose(loop._losses[:1], ref_losses[:1], rtol=1e-5)
    with pytest.raises(AssertionError):
        assert_like_reference(loop, store, ref_losses, ref)
    assert not np.allclose(loop._losses, ref_losses, rtol=1e-5, atol=1e-7)
    # Nothing was freshened, and the stale rows show per row.
    assert loop.stats.rows_freshened == 0
    assert loop.stats.missed_pushes_by_row == {}
    store.close()


@pytest.mark.parametrize(("ahead", "push_queue"), [(1, 0), (3, 0), (1, 1), (3, 1)])
def test_hybrid_loop_reading_its_pushes_fresh_equals_the_reference(
    reference: tuple[list[float], ReferenceModel], ahead: int, push_queue: int
) -> None:
    """One rank, lookups ``ahead`` batches early, ``push_queue`` pushes left in flight:
    every row this rank pushed since a batch's lookup is trained with the push's
    value (the one in flight predicted, or waited for), so hybrid learns what sync does.
    """
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    loop, store, prepared_after, reports = loop_run(
        "hybrid",
        planned,
        ahead=ahead,
        staleness=ahead + push_queue,
        push_queue=push_queue,
        fresh_rows="exact",
    )
    # The lookups did miss pushes (the prefetch), and those rows were replaced.
    assert all(applied < i for i, applied in enumerate(prepared_after) if i > 0)
    assert max(loop.stats.missed_pushes) >= ahead
    missed_rows = loop.stats.missed_pushes_by_row
    assert max(missed_rows) >= ahead
    assert loop.stats.rows_freshened == sum(n for k, n in missed_rows.items() if k > 0) > 0
    assert reports[-1].missed_pushes_by_row == {str(k): n for k, n in missed_rows.items()}
    ref_losses, ref = reference
    assert_like_reference(loop, store, ref_losses, ref)
    store.close()


def test_bf16_autocast_on_the_cpu_trains_close_to_float32(
    reference: tuple[list[float], ReferenceModel],
) -> None:
    # trainer.bf16_autocast now applies on a CPU too: the dense matmuls in bfloat16,
    # the loss, the pushed row gradients and the dense weights float32.
    planned = chunks(source(), "synthetic/0", 0, STEPS * BATCH)
    loop, store, _, _ = loop_run("sync", planned, bf16_autocast=True)
    ref_losses, _ = reference
    got = np.array(loop._losses)
    assert not np.allclose(got, ref_losses, rtol=1e-6, atol=0.0)  # it did run in bfloat16
    np.testing.assert_allclose(got, ref_losses, rtol=2e-2)
    assert all(p.dtype == torch.float32 for p in loop.dense.module.parameters())
    store.close()


# --- 2. checkpoint, crash, restore_job, resume ------------------------------------------


def shards_in(directory: Path, n: int = 2) -> list[StoreShard]:
    return [StoreShard(STORE, data_dir=directory / f"shard-{i:03d}") for i in range(n)]


def test_checkpoint_crash_restore_and_resume_equal_an_uninterrupted_run(tmp_path: Path) -> None:
    partition = "synthetic/0"
    src = source()
    planned = chunks(src, partition, 0, STEPS * BATCH)
    crash_after = 8

    # Uninterrupted, without checkpoints.
    plain_shards = [StoreShard(STORE) for _ in range(2)]
    plain_store = StoreClient.from_shards(plain_shards)
    plain = TrainLoop(
        config("sync"),
        SPEC,
        plain_store,
        DenseModel(config("sync"), SPEC, plain_store.dims, torch.device("cpu")),
    )
    plain.run(lazy_batches(src, planned, plain_store))
    want_rows = store_rows(plain_shards)
    want_dense = dense_state(plain.dense.module)
    plain_store.close()

    # Checkpointed every 3 steps, then killed after `crash_after` steps.
    every = CheckpointConfig(every_steps=3, every_s=None, on_exit=False)
    cfg = config("sync", checkpoint=every)
    shards = shards_in(tmp_path / "store")
    store = StoreClient.from_shards(shards)
    book = CheckpointBook(tmp_path / "checkpoints", keep=10)
    run_dir = tmp_path / "run"
    first = TrainLoop(
        cfg,
        SPEC,
        store,
        DenseModel(cfg, SPEC, store.dims, torch.device("cpu")),
        outputs=Outputs(run_dir=run_dir),
        recovery=Recovery(checkpointer=JobCheckpointer(book, store)),
    )
    first.run(lazy_batches(src, planned[:crash_after], store))
    assert first.stats.checkpoints >= 2
    manifest = book.latest()
    assert manifest is not None
    assert 0 < manifest.step < crash_after, "the crash must come after the last checkpoint"
    assert manifest.positions == {partition: manifest.step * BATCH}
    assert manifest.samples == manifest.step * BATCH
    saved_dense = book.load_dense(manifest)["ranks"][0]["model"]

    # The store outlives the trainer: it has the pushes after the checkpoint, one
    # more store checkpoint that no job manifest names (a crash between the two),
    # and then rows and pushes the job never made.
    store.checkpoint(None, "auto")
    stray = np.arange(10_000, 10_050, dtype=np.uint64)
    known = store_rows(shards)["a"]["ids"][:20]
    store.lookup({"a": stray, "b": stray})
    store.push({"a": (known, np.ones((20, 4), np.float32))})
    assert np.isin(stray, store_rows(shards)["a"]["ids"]).all()

    # Restart: a new dense model, restore_job, resume from the manifest's positions.
    dense = DenseModel(cfg, SPEC, store.dims, torch.device("cpu"))
    restored = restore_job(book, store, dense)
    assert restored is not None
    assert restored.step == manifest.step
    for k, v in saved_dense.items():
        assert torch.equal(dense.module.state_dict()[k], v), k
    back = store_rows(shards)
    assert not np.isin(stray, back["a"]["ids"]).any(), "rows the job never made survived"
    start = restored.positions[partition]
    resumed = TrainLoop(
        cfg.model_copy(update={"checkpoint": every.model_copy(update={"on_exit": True})}),
        SPEC,
        store,
        dense,
        outputs=Outputs(run_dir=run_dir),
        recovery=Recovery(checkpointer=JobCheckpointer(book, store)),
        start=Start(positions=restored.positions, step=restored.step, samples=restored.samples),
    )
    resumed.run(lazy_batches(src, chunks(src, partition, start, STEPS * BATCH), store))
    assert resumed.step == STEPS

    # The same model as the uninterrupted run: dense weights and every row, bit for bit.
    got_dense = dense_state(dense.module)
    for k in want_dense:
        torch.testing.assert_close(got_dense[k], want_dense[k], rtol=0, atol=0, msg=k)
    got_rows = store_rows(shards)
    for name, want in want_rows.items():
        for part, arr in want.items():
            np.testing.assert_array_equal(got_rows[name][part], arr, err_msg=f"{name}.{part}")

    # The final checkpoint (taken after a restore onto an older seq) restores too.
    final = book.latest()
    assert final is not None
    assert final.step == STEPS
    assert final.samples == STEPS * BATCH
    assert final.positions == {partition: STEPS * BATCH}
    reopened = [StoreShard.open(STORE, tmp_path / "store" / f"shard-{i:03d}") for i in range(2)]
    again = store_rows(reopened)
    for name, want in want_rows.items():
        for part in ("ids", "weights", "state"):
            np.testing.assert_array_equal(again[name][part], want[part], err_msg=f"{name}.{part}")

    # Every offset was learned exactly once across the restart: the resumed run's
    # rollback line voids what the crashed one learned after its checkpoint.
    lines = (run_dir / "learned-rank0.log").read_text().splitlines()
    # (Each run starts with its own rollback line: "rollback 0" for the first.)
    assert lines[0].split()[:2] == ["rollback", "0"]
    assert lines[crash_after + 1].split()[:2] == ["rollback", str(restored.step)]
    kept = ledger_entries(run_dir / "learned-rank0.log")
    assert [e[2] for e in kept] == [c.start for c in planned]
    assert [e[0] for e in kept] == list(range(1, STEPS + 1))
    store.close()


# --- 3. two ranks over gloo, uneven streams ----------------------------------------------

RANK_BATCHES = (7, 3)
# Fresh rows "exact": which rows a "bounded" step predicts depends on when the last push
# landed, and these scenarios compare runs step for step.
SCENARIOS: dict[str, dict[str, Any]] = {
    "hybrid": {"mode": "hybrid", "staleness": 2, "fresh_rows": "exact"},
    "sync": {"mode": "sync"},
    "async-avg2": {"mode": "async", "staleness": 2, "average_every": 2, "fresh_rows": "exact"},
    "async-noavg": {
        "mode": "async",
        "staleness": 2,
        "average_every": 1000,
        "fresh_rows": "exact",
    },
}


def _rank_main(rank: int, init: str, tmp: str, out: Any) -> None:
    """One trainer rank: every scenario in turn, in one process group."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=init,
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )
        src = source(partitions=2)
        partition = f"synthetic/{rank}"
        results: dict[str, Any] = {}
        for name, kw in SCENARIOS.items():
            cfg = config(
                checkpoint=CheckpointConfig(every_steps=2, every_s=None, on_exit=True), **kw
            )
            shards = shards_in(Path(tmp) / name / f"store-rank{rank}")
            store = StoreClient.from_shards(shards)
            dense = DenseModel(cfg, SPEC, store.dims, torch.device("cpu"))
            book = CheckpointBook(Path(tmp) / name / "checkpoints", keep=100)
            loop = TrainLoop(
                cfg,
                SPEC,
                store,
                dense,
                rank=rank,
                recovery=Recovery(checkpointer=JobCheckpointer(book, store)),
            )
            planned = chunks(src, partition, 0, RANK_BATCHES[rank] * BATCH)
            ahead = 0 if kw["mode"] == "sync" else 1
            stats = loop.run(lazy_batches(src, planned, store, ahead=ahead))
            results[name] = {
                "steps": stats.steps,
                "samples": stats.samples,
                "stopped_by": stats.stopped_by,
                "checkpoints": stats.checkpoints,
                "exchanges": loop.sync.exchanges,
                "averages": loop.sync.averages,
                "dense": {k: v.numpy() for k, v in dense_state(dense.module).items()},
                "losses": list(loop._losses),
            }
            store.close()
            dist.barrier()
        dist.destroy_process_group()
        out.put((rank, results))
    except BaseException:
        out.put((rank, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Any], Path]:
    tmp = tmp_path_factory.mktemp("ranks")
    return run_ranks(_rank_main, 2, str(tmp)), tmp


def _same_dense(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.processes
@pytest.mark.parametrize("scenario", ["hybrid", "sync"])
def test_two_ranks_with_uneven_streams_finish_in_step(
    two_ranks: tuple[dict[int, Any], Path], scenario: str
) -> None:
    results, tmp = two_ranks
    r0, r1 = results[0][scenario], results[1][scenario]
    longest = max(RANK_BATCHES)
    for rank, r in ((0, r0), (1, r1)):
        assert r["stopped_by"] == "end_of_stream"
        assert r["samples"] == RANK_BATCHES[rank] * BATCH
        assert len(r["losses"]) == RANK_BATCHES[rank]
        # The finished rank kept stepping (zero gradients) until the other was done.
        assert r["steps"] == longest
        assert r["exchanges"] == longest + 1
    # One all-reduced gradient per step: the same dense weights on both ranks.
    assert _same_dense(r0["dense"], r1["dense"])
    # ... which a single rank's own data would not give.
    assert r0["losses"][:3] != r1["losses"]
    # Checkpoints during and after the uneven end count every rank's samples.
    book = CheckpointBook(tmp / scenario / "checkpoints")
    manifests = [book.read(p) for p in book.manifests()]
    assert r0["checkpoints"] == r1["checkpoints"] >= len(manifests) >= 3
    for m in manifests:
        per_rank = [min(m.step, n) * BATCH for n in RANK_BATCHES]
        assert m.samples == sum(per_rank), m
        assert m.positions == {f"synthetic/{r}": per_rank[r] for r in range(2)}
    final = manifests[-1]
    assert final.step == longest
    assert final.samples == sum(RANK_BATCHES) * BATCH
    ranks = book.load_dense(final)["ranks"]
    assert len(ranks) == 2
    for k, v in ranks[0]["model"].items():
        assert torch.equal(v, ranks[1]["model"][k]), k


@pytest.mark.processes
def test_two_async_ranks_average_their_dense_weights(
    two_ranks: tuple[dict[int, Any], Path],
) -> None:
    results, _ = two_ranks
    longest = max(RANK_BATCHES)
    avg = [results[r]["async-avg2"] for r in range(2)]
    solo = [results[r]["async-noavg"] for r in range(2)]
    for r in (*avg, *solo):
        assert r["stopped_by"] == "end_of_stream"
        assert r["steps"] == longest
    assert [r["samples"] for r in avg] == [n * BATCH for n in RANK_BATCHES]
    # Every exchange, the last (nobody active) one included, counts towards the average.
    assert avg[0]["exchanges"] == avg[1]["exchanges"] == longest + 1
    # One average every 2 exchanges, plus the one the loop takes on the way out.
    assert avg[0]["averages"] == avg[1]["averages"] == (longest + 1) // 2 + 1
    assert solo[0]["averages"] == solo[1]["averages"] == 1
    # Either way the job ends with one network (the final average), but the
    # periodically averaged ranks learned from each other on the way.
    assert _same_dense(solo[0]["dense"], solo[1]["dense"])
    assert _same_dense(avg[0]["dense"], avg[1]["dense"])
    assert not _same_dense(avg[0]["dense"], solo[0]["dense"])
    # Before the first average (exchange 2) both modes trained rank 0 alike.
    assert avg[0]["losses"][:2] == solo[0]["losses"][:2]
    assert avg[0]["losses"][2:] != solo[0]["losses"][2:]


def two_rank_reference() -> tuple[list[list[float]], torch.nn.Module]:
    """Sync data parallelism in one process: each rank's batch, rows and loss of its own,
    the dense gradients summed over the ranks that had a batch and divided by two."""
    src = source(partitions=2)
    torch.manual_seed(0)
    dims = field_dims(SPEC, {name: cfg.dim for name, cfg in TABLES.items()})
    dense = build_model(MODEL, num_dense=len(SPEC.dense), field_dims=dims, num_tasks=1)
    opt = torch.optim.Adam(dense.parameters(), lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps)
    # Each rank has a store of its own here, so a table of its own in the reference.
    ranks = [ReferenceModel(SPEC, TABLES, dense) for _ in RANK_BATCHES]
    batches = [
        list(lazy_batches(src, chunks(src, f"synthetic/{r}", 0, n * BATCH), None))
        for r, n in enumerate(RANK_BATCHES)
    ]
    losses: list[list[float]] = [[] for _ in RANK_BATCHES]
    for step in range(max(RANK_BATCHES)):
        total = [torch.zeros_like(p) for p in dense.parameters()]
        for r, model in enumerate(ranks):
            if step >= len(batches[r]):
                continue
            opt.zero_grad()
            loss = loss_fn(model(batches[r][step]), torch.from_numpy(batches[r][step].labels))
            torch.autograd.backward(loss)
            model.embeddings.step()  # this rank's rows, with its own gradients
            losses[r].append(float(loss.detach()))
            for t, p in zip(total, dense.parameters(), strict=True):
                assert p.grad is not None
                t.add_(p.grad)
        for t, p in zip(total, dense.parameters(), strict=True):
            p.grad = t / len(RANK_BATCHES)
        opt.step()
    return losses, dense


@pytest.mark.processes
def test_two_sync_ranks_equal_one_process_averaging_their_gradients(
    two_ranks: tuple[dict[int, Any], Path],
) -> None:
    results, _ = two_ranks
    want_losses, want_dense = two_rank_reference()
    for r in range(2):
        np.testing.assert_allclose(
            results[r]["sync"]["losses"], want_losses[r], rtol=1e-5, err_msg=f"rank {r}"
        )
    got = results[0]["sync"]["dense"]
    for name, p in want_dense.named_parameters():
        np.testing.assert_allclose(
            got[name], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name
        )


def test_a_quiet_stream_still_gets_its_due_checkpoint(tmp_path: Path) -> None:
    """What was learned before the stream went quiet is checkpointed when `every_s` is due.

    It used to wait for records to come again (or for the stop): the offsets of the
    last steps stayed uncommitted for as long as the stream was quiet.
    """
    src = source()
    planned = chunks(src, "synthetic/0", 0, 7 * BATCH)  # 7 steps: not a multiple of 5
    cfg = config("sync", checkpoint=CheckpointConfig(every_steps=5, every_s=0.3, on_exit=False))
    shards = shards_in(tmp_path / "store")
    store = StoreClient.from_shards(shards)
    book = CheckpointBook(tmp_path / "checkpoints", keep=10)
    stop = threading.Event()
    loop = TrainLoop(
        cfg,
        SPEC,
        store,
        DenseModel(cfg, SPEC, store.dims, torch.device("cpu")),
        recovery=Recovery(checkpointer=JobCheckpointer(book, store)),
        until=Until(stop=stop),
    )

    def then_quiet() -> Iterator[PreparedBatch | None]:
        yield from lazy_batches(src, planned, store)
        while True:
            yield None  # a quiet stream (StreamRunner(idle_ticks=True))

    seen: list[int] = []
    runner = threading.Thread(target=loop.run, args=(then_quiet(),), daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        latest = book.latest()
        if latest is not None:
            seen.append(latest.step)
            if latest.step == 7:
                break
        time.sleep(0.05)
    stop.set()
    runner.join(30)
    assert seen, "no checkpoint at all"
    assert seen[-1] == 7, f"checkpointed steps seen while quiet: {sorted(set(seen))}"
    latest = book.latest()
    assert latest is not None
    assert latest.positions == {"synthetic/0": 7 * BATCH}
    # One at step 5 (or earlier ones when `every_s` fell due between slow steps), then
    # one when due while quiet; none repeated.
    steps = [book.read(name).step for name in book.manifests()]
    assert len(steps) >= 2, steps
    assert steps == sorted(set(steps)), steps
    assert loop.stats.checkpoints == len(steps)
    store.close()


@pytest.mark.parametrize(
    ("requested", "gpus", "local_ranks", "index", "want"),
    [
        ("auto", 0, 1, 0, "cpu"),
        ("auto", 1, 1, 0, "cuda:0"),
        ("auto", 1, 2, 1, "cpu"),  # two ranks cannot share one GPU under NCCL
        ("auto", 4, 2, 1, "cuda:1"),
        ("cpu", 4, 1, 0, "cpu"),
        ("cuda", 2, 2, 1, "cuda:1"),
    ],
)
def test_pick_device_gives_each_local_rank_its_own_gpu_or_none(
    monkeypatch: pytest.MonkeyPatch,
    requested: str,
    gpus: int,
    local_ranks: int,
    index: int,
    want: str,
) -> None:
    """A GPU machine ran 2 ranks on cuda:0 and NCCL refused ("Duplicate GPU detected")."""
    from trainer.device import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert str(pick_device(requested, index, local_ranks)) == want


@pytest.mark.parametrize(("gpus", "local_ranks"), [(0, 1), (1, 2)])
def test_pick_device_says_why_cuda_cannot_be_had(
    monkeypatch: pytest.MonkeyPatch, gpus: int, local_ranks: int
) -> None:
    from trainer.device import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(RuntimeError, match=r"trainer\.device: 'cuda'"):
        pick_device("cuda", 0, local_ranks)
