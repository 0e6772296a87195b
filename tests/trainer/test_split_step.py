"""A step split in chunks over threads is the whole batch's step, deterministically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.spec import FeatureSpec
from pipeline.types import PreparedBatch, TableBatch
from trainer.config import DCNv2Config, DLRMConfig, FFNNConfig
from trainer.joined_fields import JoinedFields
from trainer.models import build_model, loss_fn
from trainer.pooling import host_tensor, pool, row_grads, to_tensors
from trainer.split_step import SplitStep

# Two fields share table "t" (one of them mean-pooled lists), one has table "u".
SPEC = FeatureSpec.model_validate(
    {
        "labels": ["y"],
        "dense": [{"name": "d0"}, {"name": "d1"}],
        "sparse": [
            {"name": "a", "table": "t"},
            {"name": "tags", "table": "t", "type": "list_int", "pooling": "mean"},
            {"name": "b", "table": "u"},
        ],
    }
)
DIM = 4


def batch(n: int, seed: int = 0) -> PreparedBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(n, 2))
    lengths[:, 0] = 1  # field "a": one id per sample
    offsets = np.concatenate(([0], np.cumsum(lengths.ravel()))).astype(np.int32)
    u_t = 7
    return PreparedBatch(
        labels=(rng.random((n, 1)) < 0.4).astype(np.float32),
        dense=rng.standard_normal((n, 2)).astype(np.float32),
        tables={
            "t": TableBatch(
                fields=("a", "tags"),
                unique_ids=np.arange(u_t, dtype=np.uint64),
                inverse=rng.integers(0, u_t, size=int(offsets[-1])).astype(np.int32),
                offsets=offsets,
                rows=rng.standard_normal((u_t, DIM)).astype(np.float32),
                pooling=("sum", "mean"),
            ),
            "u": TableBatch(
                fields=("b",),
                unique_ids=np.arange(5, dtype=np.uint64),
                inverse=rng.integers(0, 5, size=n).astype(np.int32),
                offsets=np.arange(n + 1, dtype=np.int32),
                rows=rng.standard_normal((5, DIM)).astype(np.float32),
                pooling=("sum",),
            ),
        },
    )


MODELS: dict[str, Any] = {
    "ffnn": FFNNConfig(hidden=[16, 8]),
    "dlrm": DLRMConfig(bottom=[8], top=[8]),
    "dcnv2": DCNv2Config(cross_layers=2, deep=[8]),
}


def step(
    kind: str, b: PreparedBatch, split: SplitStep | None, bf16: bool = False
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """(logits, loss, dense grads, row grads) of one step from the seed-0 model.

    Unsplit, the general path (a leaf per table, torch's pooling); split, the
    trainer's CPU path (the fields joined by ``JoinedFields``).
    """
    torch.manual_seed(0)
    model = build_model(MODELS[kind], num_dense=2, field_dims=[DIM] * 3, num_tasks=1)
    if split is None:
        bt = to_tensors(b, SPEC)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(bt.dense, pool(bt, SPEC)).float()
        loss = loss_fn(logits, bt.labels)
        loss.backward()
        rows = row_grads(bt)
    else:
        joined = JoinedFields(b, SPEC)
        logits, loss = split.forward_backward(
            model, host_tensor(b.dense), joined.tensor(), host_tensor(b.labels), bf16=bf16
        )
        rows = joined.row_grads()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), float(loss.detach()), grads, rows


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(("threads", "chunks", "n"), [(2, 4, 64), (3, 5, 61), (2, 8, 3)])
def test_split_step_equals_the_whole_batch_step(
    kind: str, threads: int, chunks: int, n: int
) -> None:
    b = batch(n)
    want_logits, want_loss, want_grads, want_rows = step(kind, b, None)
    with SplitStep(threads, chunks) as split:
        logits, loss, grads, rows = step(kind, b, split)
        again = step(kind, b, split)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for name, r in rows.items():
        np.testing.assert_allclose(r, want_rows[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert np.abs(rows["t"]).sum() > 0  # gradients reached the shared table's rows
    # Chunk order, not thread timing, decides the sums: the same step twice is equal.
    assert torch.equal(again[0], logits)
    for name, g in again[2].items():
        assert torch.equal(g, grads[name]), name
    for name, r in again[3].items():
        assert np.array_equal(r, rows[name]), name


def test_split_step_adds_to_gradients_already_there() -> None:
    b = batch(32)
    torch.manual_seed(0)
    model = build_model(MODELS["ffnn"], num_dense=2, field_dims=[DIM] * 3, num_tasks=1)
    head = model.head.weight
    head.grad = torch.ones_like(head)
    bt = to_tensors(b, SPEC)
    with SplitStep(2) as split:
        split.forward_backward(model, bt.dense, torch.cat(pool(bt, SPEC), dim=1), bt.labels)
    _, _, grads, _ = step("ffnn", b, None)
    torch.testing.assert_close(head.grad, grads["head.weight"] + 1.0, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_applies_in_the_step_threads() -> None:
    # Autocast is per thread: the split step must enter it in each of its threads.
    b = batch(256)
    f32 = step("ffnn", b, None)[0]
    bf16 = step("ffnn", b, None, bf16=True)[0]
    with SplitStep(2) as split:
        split_bf16 = step("ffnn", b, split, bf16=True)[0]
    assert not torch.allclose(bf16, f32, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(split_bf16, bf16, rtol=0.0, atol=1e-6)


def test_bad_thread_or_chunk_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        SplitStep(0)
    with pytest.raises(ValueError, match="chunks must be at least 1, got 0"):
        SplitStep(2, chunks=0)


def test_the_job_splits_the_step_where_it_shares_two_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deploy.cli.train import demo_job
    from deploy.job import SPLIT_MIN_WORK, step_threads_for

    job = demo_job(tmp_path, events=1000, partitions=2, seed=0, dim=4)
    raw = job.model_dump(mode="json")

    def with_(cpus: int, params: int | None = None, **trainer: Any) -> int:
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cpus)))
        cfg = type(job).model_validate({**raw, "trainer": {**raw["trainer"], **trainer}})
        return step_threads_for(cfg, local_ranks=1, device_type="cpu", dense_params=params)

    assert with_(2) == 2  # the demo on 2 cores: its workers and shards leave 1 thread
    assert with_(1) == 1
    assert with_(16) == 1  # 13 intra-op threads left: torch's own threads do
    assert with_(2, torch_threads=1) == 1  # threads set by hand: no split unless asked
    assert with_(2, step_threads=3) == 3
    batch = job.trainer.batch_size
    assert with_(2, params=SPLIT_MIN_WORK // batch) == 2  # a step long enough to split
    assert with_(2, params=SPLIT_MIN_WORK // batch - 1) == 1  # too short: the split costs
    assert with_(2, params=1, step_threads=2) == 2  # asked for
    cfg = type(job).model_validate(raw)
    assert step_threads_for(cfg, local_ranks=1, device_type="cuda") == 1
