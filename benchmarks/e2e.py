"""End-to-end training: a plain PyTorch model and streamrec's modes, side by side.

    python benchmarks/e2e.py --json bench-results/e2e.json           # the full run (2M samples)
    python benchmarks/e2e.py --samples 200000 --json /tmp/e2e.json   # a quick one

The same synthetic Criteo-like stream (2 partitions, 26 sparse fields, 13 dense)
and the same model (embeddings of dim 16, the FFNN 512-256-1 over them, batch
4096, Adagrad lr 0.05 on the rows, Adam lr 1e-3 on the dense net), trained by:

- ``baseline``: one process, plain PyTorch: per field an ``nn.EmbeddingBag``
  (``sparse=True``) over the field's hashed ids mod a fixed size (the store's
  total capacity for the table), ``torch.optim.Adagrad`` (element-wise: plain
  PyTorch has no row-wise one) on those, ``Adam`` on the dense net; the batches
  are decoded and hashed before the clock starts;
- ``torchrec``: the same in TorchRec 1.8, a ``FusedEmbeddingBagCollection``
  (FBGEMM's batched CPU kernels, row-wise Adagrad fused into the backward
  pass); skipped, saying so, where torchrec is not installed (``make install``
  installs it);
- ``step``: streamrec's trainer alone on the baseline's footing: one process,
  the same batches decoded and hashed before the clock starts, the job's loop
  (``trainer.loop.TrainLoop``, ``staleness: 0``) over the store's own code in
  this process (2 ``inproc://`` shards with row-wise Adagrad): each batch is
  looked up just before its step and its gradients pushed after it, inside the
  clock; no Dask, no gRPC, no other process on the cores. What the trainer
  costs against the peers' steps, apart from the pipeline and the store
  processes that share the same cores in the job modes;
- ``sync``, ``hybrid``, ``async``: ``deploy.job.run_job`` as ``streamrec demo``
  runs it (2 local store shard processes with row-wise Adagrad, a
  local Dask cluster of 2 workers that read, decode, hash and look up, its
  scheduler in a process of its own, checkpoints off, ``trainer.torch_threads``
  and ``step_threads`` unset: the job picks them; on 2 cores the default model's
  step is split over 2 threads, the small model's runs on one), with 1
  trainer rank for sync and hybrid and ``--async-ranks`` (2) for async: with
  one rank async would be hybrid without the dense allreduce, which one rank
  does not do either;
- ``sync`` and ``hybrid`` again with ``--store-latency-ms`` (default 2) added to
  every store call of the workers and of the trainer (``cluster.store_latency_ms``),
  standing for a cross-rack round trip: with the default model (keys
  ``*_at_2ms``) and with a small one, MLP 64-32 (``*_small_at_2ms``), whose
  step is short next to the store's round trips: where the paper's hybrid
  mode earns its speed-up.

Throughput (``*_samples_per_s``) is samples per second from the trainer's first
progress report (the end of the first step that ends at least ``log_every_s`` =
1 s into the loop) to its last (after the last push): start-up (processes,
connections, the first batch) is excluded. The in-process trainers' clock
starts by the same rule (the end of their first step that ends 1 s into their
loop): their first steps touch the tables' pages for the first time, TorchRec's
take several times a steady step. With several ranks it is the sum of
their rates. The median rate over the ~1 s report intervals is written next to
it (``runs.<mode>.median_interval_samples_per_s``): on a shared 2-core machine
another process's burst moves the overall rate, much less the median. The AUC
is the progressive AUC (every batch scored before it is learned) over the last
``--window`` samples once every mode has trained the same ``--samples`` (rounded
up to whole batches of both partitions).

The streamrec runs also go into an HTML report (``--report``, default
``bench-results/e2e-report.html``; ``--report ''`` skips it): their loss, AUC,
throughput and staleness over samples learned, on the same axes, as
``streamrec report`` draws them (the baseline writes no metrics files). It is
written once every mode has run, from the metrics read before each temporary
run directory went away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import MachineCpu, shared_dask, write_json

from connectors.synthetic import (
    SyntheticConfig,
    SyntheticSource,
    synthetic_feature_spec,
    synthetic_store_tables,
)
from trainer.run_files import read_lines

if TYPE_CHECKING:
    from monitoring.runs import RunData
    from pipeline.types import PreparedBatch

SPEC = synthetic_feature_spec()
BATCH = 4096
PARTITIONS = 2
DIM = 16
HIDDEN = [512, 256]
DENSE_LR = 1e-3
SMALL_HIDDEN = [64, 32]  # the small-model scenario: a short step against store round trips
ROW_LR = 0.05  # Adagrad on the rows, as the synthetic tables have it
ROW_EPS = 1e-8  # FBGEMM's default; the store's row-wise Adagrad is given the same
INIT_SCALE = 0.01  # rows start uniform in [-0.01, 0.01], as the synthetic tables do
# hybrid_stale: hybrid with trainer.fresh_rows off (rows trained as looked up), beside
# hybrid in the same run, so the cost of reading one's own pushes fresh is measured.
MODES = ("baseline", "torchrec", "step", "sync", "hybrid", "hybrid_stale", "async")
STALE = "_stale"
IN_PROCESS = ("baseline", "torchrec", "step")

# The speed and accuracy targets; the other ratios (hybrid_vs_sync_at_2ms, ...) are written
# as figures.
TARGETS = {
    "hybrid_vs_baseline": 1.0,
    "hybrid_vs_torchrec": 1.0,
    "auc_gap": 0.001,  # at most
    "hybrid_vs_sync": 1.0,
    "hybrid_vs_sync_small_at_2ms": 1.6,
    # What fresh rows may cost against hybrid without them, and the job against its trainer.
    "hybrid_vs_hybrid_stale": 0.95,
    "hybrid_vs_hybrid_stale_small_at_2ms": 0.9,
    "hybrid_vs_step": 0.8,
}


@dataclass
class Run:
    """One mode's figures."""

    mode: str
    samples_per_s: float
    auc: float | None
    samples: int  # trained in all
    timed_samples: int  # trained after the clock started
    timed_s: float
    startup_s: float  # from the call to the end of the first step
    median_rate: float = 0.0  # the median rate of the >= 1 s intervals (load spikes aside)
    breakdown: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    metrics: RunData | None = None  # the run's metrics files, read for the report
    window: tuple[float, float] | None = None  # the timed part, unix s (job modes)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def median_interval_rate(marks: list[tuple[float, int]], every_s: float = 1.0) -> float:
    """The median samples/s over consecutive intervals of at least ``every_s`` seconds.

    ``marks`` are (seconds, samples trained) points; the median shrugs off the
    moments another process took the CPU, which the overall rate does not.
    """
    rates = []
    t0, n0 = marks[0]
    for t, n in marks[1:]:
        if t - t0 >= every_s:
            rates.append((n - n0) / (t - t0))
            t0, n0 = t, n
    return float(np.median(rates)) if rates else 0.0


# --- the plain PyTorch baseline --------------------------------------------------------


def hashed_batches(samples: int, seed: int) -> list[PreparedBatch]:
    """The batches the streamrec runs train on, read, validated and hashed, not looked up.

    The chunks of partitions 0 and 1 taken in turn, prepared by the pipeline's own
    code (``prepare`` without the store lookup): the in-process trainers' input,
    made before their clock starts.
    """
    from pipeline.prepare import prepare

    per_partition = samples // PARTITIONS
    source = SyntheticSource(
        SyntheticConfig(seed=seed, partitions=PARTITIONS, events=per_partition)
    )
    out = []
    for start in range(0, per_partition, BATCH):
        for name in source.partitions():
            chunk = source.plan(name, start, BATCH)
            assert chunk is not None
            batch, bad = prepare(chunk, source, SPEC, None, lookup=False)
            assert not bad, f"{len(bad)} bad synthetic records"
            out.append(batch)
    return out


def baseline_batches(samples: int, seed: int, sizes: list[int]) -> list[tuple[Any, Any, Any]]:
    """(field indices [F, B], dense [B, 13], labels [B, 1]) per batch, as torch tensors.

    The :func:`hashed_batches`, each field's ids taken mod its size.
    """
    import torch

    mods = np.array(sizes, dtype=np.uint64)
    out = []
    for batch in hashed_batches(samples, seed):
        b = len(batch)
        idx = np.empty((len(SPEC.sparse), b), dtype=np.int64)
        for f, s in enumerate(SPEC.sparse):
            tb = batch.tables[s.table]
            assert tb.offsets.shape[0] == b + 1, "one bag per sample"
            assert int(tb.offsets[-1]) == b, "one id per bag"
            idx[f] = (tb.unique_ids[tb.inverse] % mods[f]).astype(np.int64)
        out.append(
            (
                torch.from_numpy(idx),
                torch.from_numpy(np.ascontiguousarray(batch.dense)),
                torch.from_numpy(np.ascontiguousarray(batch.labels)),
            )
        )
    return out


@dataclass
class InProcessModel:
    """A single-process trainer of the whole model: ``step`` trains one batch.

    ``step(idx, dense, labels)`` returns the logits (before the update) and
    charges its time to ``timers`` (forward, backward, dense step, sparse step).
    """

    step: Any
    timers: dict[str, float]


def build_plain(sizes: list[int], seed: int, bf16: bool = False) -> InProcessModel:
    """Plain PyTorch: an ``nn.EmbeddingBag(sparse=True)`` per field, torch's Adagrad on them."""
    import torch
    from torch import nn

    from trainer.models import loss_fn

    # torch's sparse Adagrad says, once, that it skips sparse invariant checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.manual_seed(seed)
    bags = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in sizes)
    for bag in bags:
        nn.init.uniform_(bag.weight, -INIT_SCALE, INIT_SCALE)
    dense = dense_net(len(sizes))
    sparse_opt = torch.optim.Adagrad(list(bags.parameters()), lr=ROW_LR)
    dense_opt = torch.optim.Adam(dense.parameters(), lr=DENSE_LR)
    timers = dict.fromkeys(("forward_s", "backward_s", "dense_step_s", "sparse_step_s"), 0.0)

    def step(idx: Any, x: Any, y: Any) -> Any:
        ta = time.perf_counter()
        offsets = torch.arange(y.shape[0])
        pooled = [bag(idx[f], offsets) for f, bag in enumerate(bags)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = dense(x, pooled).float()
        loss = loss_fn(logits, y)
        tb = time.perf_counter()
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        tc = time.perf_counter()
        dense_opt.step()
        td = time.perf_counter()
        sparse_opt.step()
        te = time.perf_counter()
        timers["forward_s"] += tb - ta
        timers["backward_s"] += tc - tb
        timers["dense_step_s"] += td - tc
        timers["sparse_step_s"] += te - td
        return logits

    return InProcessModel(step, timers)


def torchrec_missing() -> str | None:
    """Why the TorchRec baseline cannot run here, or None when it can."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as exc:  # ImportError, or a library that fails to load
        return (
            f"torchrec is not usable here ({type(exc).__name__}: {exc}); "
            "`make install` installs it, or by hand: pip install -e '.[peers]' && "
            "pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0"
        )
    return None


def build_torchrec(sizes: list[int], seed: int, bf16: bool = False) -> InProcessModel:
    """TorchRec 1.8: a ``FusedEmbeddingBagCollection`` (FBGEMM's batched CPU kernels).

    One table per field, row-wise Adagrad fused into the backward pass (as
    TorchRec trains its tables), the same dense network and Adam.
    """
    import torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from trainer.models import loss_fn

    torch.manual_seed(seed)
    names = [s.name for s in SPEC.sparse]
    ebc = FusedEmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{name}",
                embedding_dim=DIM,
                num_embeddings=n,
                feature_names=[name],
                weight_init_min=-INIT_SCALE,
                weight_init_max=INIT_SCALE,
            )
            for name, n in zip(names, sizes, strict=True)
        ],
        optimizer_type=RowWiseAdagrad,
        optimizer_kwargs={"lr": ROW_LR, "eps": ROW_EPS},
    )
    dense = dense_net(len(sizes))
    dense_opt = torch.optim.Adam(dense.parameters(), lr=DENSE_LR)
    timers = dict.fromkeys(("forward_s", "backward_s", "dense_step_s"), 0.0)

    def step(idx: Any, x: Any, y: Any) -> Any:
        ta = time.perf_counter()
        b = y.shape[0]
        kjt = KeyedJaggedTensor(
            keys=names,
            values=idx.reshape(-1),
            lengths=torch.ones(len(names) * b, dtype=torch.int64),
        )
        pooled = ebc(kjt).values()  # [B, F * DIM]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = dense(x, list(pooled.split(DIM, dim=1))).float()
        loss = loss_fn(logits, y)
        tb = time.perf_counter()
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # the rows are updated in here
        tc = time.perf_counter()
        dense_opt.step()
        td = time.perf_counter()
        timers["forward_s"] += tb - ta
        timers["backward_s"] += tc - tb
        timers["dense_step_s"] += td - tc
        return logits

    return InProcessModel(step, timers)


def dense_net(fields: int) -> Any:
    from trainer.models import FFNNConfig, build_model

    return build_model(
        FFNNConfig(hidden=HIDDEN), num_dense=len(SPEC.dense), field_dims=[DIM] * fields, num_tasks=1
    )


def run_in_process(
    mode: str,
    samples: int,
    seed: int,
    window: int,
    log: bool,
    warmup_s: float = 1.0,
    bf16: bool = False,
) -> Run:
    """Train ``mode`` (``baseline`` or ``torchrec``) in this process on pre-hashed batches."""
    import torch

    from trainer.metrics import ProgressiveMetrics

    tables = synthetic_store_tables(dim=DIM)
    # Each field hashes into as many rows as the store may hold for its table (per
    # shard capacity x shards); the rows start and learn as the store's do.
    sizes = [tables[s.table].capacity * PARTITIONS for s in SPEC.sparse]
    t_gen = time.perf_counter()
    batches = baseline_batches(samples, seed, sizes)
    gen_s = time.perf_counter() - t_gen
    if log:
        print(f"  {mode}: {len(batches)} batches decoded and hashed in {gen_s:.1f}s (untimed)")
    build = build_torchrec if mode == "torchrec" else build_plain
    model = build(sizes, seed, bf16)
    metrics = ProgressiveMetrics(window=window)
    t_start = time.perf_counter()
    t0 = 0.0  # when the clock started; 0 until then
    timed_from = 0
    trained = 0
    marks: list[tuple[float, int]] = []
    for idx, x, y in batches:
        logits = model.step(idx, x, y)
        with torch.no_grad():
            metrics.update(y.numpy(), torch.sigmoid(logits).numpy())
        te = time.perf_counter()
        trained += y.shape[0]
        if t0:
            marks.append((te, trained))
        elif te - t_start >= warmup_s or trained >= len(batches) * y.shape[0] // 2:
            # The clock starts as streamrec's does: at the end of the first step that
            # ends warmup_s (--log-every-s) into the loop (first touches of the tables' pages, lazy
            # initialisations), or half-way through a run too short for that.
            t0, timed_from = te, trained
            marks.append((te, trained))
            for k in model.timers:
                model.timers[k] = 0.0
    end = time.perf_counter()
    snap = metrics.snapshot()
    timed = trained - timed_from
    return Run(
        mode=mode,
        samples_per_s=timed / (end - t0),
        median_rate=median_interval_rate(marks) if len(marks) > 1 else 0.0,
        auc=snap.auc,
        samples=trained,
        timed_samples=timed,
        timed_s=end - t0,
        startup_s=t0 - t_start,
        breakdown={k: round(v, 2) for k, v in model.timers.items()},
        extra={"decode_hash_untimed_s": round(gen_s, 1), "hash_sizes": sizes},
    )


def run_step_in_process(
    samples: int, seed: int, window: int, log: bool, warmup_s: float = 1.0, bf16: bool = False
) -> Run:
    """streamrec's trainer alone: the job's loop over in-process shards, pre-hashed batches."""
    import torch

    from embedding_store.client import StoreClient
    from trainer.dense_model import DenseModel
    from trainer.loop import TrainLoop
    from trainer.loop_options import Compute, Outputs

    t_gen = time.perf_counter()
    prepared = hashed_batches(samples, seed)
    gen_s = time.perf_counter() - t_gen
    if log:
        print(f"  step: {len(prepared)} batches decoded and hashed in {gen_s:.1f}s (untimed)")
    with tempfile.TemporaryDirectory(prefix="bench-e2e-step-") as tmp:
        run_dir = Path(tmp)
        job = make_job(
            "sync",
            samples,
            run_dir,
            seed=seed,
            window=window,
            latency_ms=0.0,
            ranks=1,
            torch_threads=None,
            hidden=HIDDEN,
            log_every_s=warmup_s,
            bf16=bf16,
        )
        # The job's store section (row-wise Adagrad), its 2 shards in this process.
        store = StoreClient.connect(f"inproc://{job.cluster.store_shards}", config=job.store)
        # Alone on its host the job's rule gives the step every core on torch's
        # intra-op threads and no split, as the baseline runs.
        torch.set_num_threads(os.cpu_count() or 1)
        dense = DenseModel(job.trainer, SPEC, store.dims, torch.device("cpu"))
        # Its metrics file, as a job's rank writes it: timed by the job modes' clock.
        loop = TrainLoop(
            job.trainer,
            SPEC,
            store,
            dense,
            compute=Compute(step_threads=1),
            outputs=Outputs(run_dir=run_dir),
        )

        def looked_up() -> Any:
            for batch in prepared:  # staleness 0: the loop pushed the last batch before asking
                rows = store.lookup({k: t.unique_ids for k, t in batch.tables.items()}, train=True)
                for k, t in batch.tables.items():
                    t.rows = rows[k]
                yield batch

        t_call = time.perf_counter()
        try:
            stats = loop.run(looked_up())
        finally:
            store.close()
        lines = read_metrics(run_dir)
    if 0 not in lines:
        msg = "step: the loop wrote no metrics"
        raise RuntimeError(msg)
    rate, median_rate, timed_samples, timed_s, total = measured_rate(lines)
    first = next(r for r in lines[0] if r["samples"] > 0)
    return Run(
        mode="step",
        samples_per_s=rate,
        median_rate=median_rate,
        auc=lines[0][-1]["metrics"]["auc"],
        samples=total,
        timed_samples=timed_samples,
        timed_s=timed_s,
        startup_s=first["elapsed_s"],
        breakdown={
            "loop_wait_s": round(stats.wait_s, 2),
            "loop_compute_s": round(stats.compute_s, 2),
            "loop_push_wait_s": round(stats.push_wait_s, 2),
        },
        extra={
            "decode_hash_untimed_s": round(gen_s, 1),
            "job_call_s": round(time.perf_counter() - t_call, 1),
            "steps": stats.steps,
        },
        window=timed_window(lines),
    )


# --- streamrec through the job path ----------------------------------------------------


def make_job(
    mode: str,
    samples: int,
    run_dir: Path,
    *,
    seed: int,
    window: int,
    latency_ms: float,
    ranks: int,
    torch_threads: int | None,
    hidden: list[int],
    log_every_s: float = 1.0,
    bf16: bool = False,
    fresh_rows: str = "bounded",
    scheduler: str | None = None,
) -> Any:
    """The job of ``mode``; with ``scheduler``, one that names that Dask cluster's scheduler
    (``cluster.scheduler``) instead of starting its own."""
    from deploy.cli.train import demo_job
    from deploy.config import JobConfig

    base = demo_job(run_dir, events=samples, partitions=PARTITIONS, seed=seed, dim=DIM)
    raw = base.model_dump(mode="json")
    trainer = {
        **raw["trainer"],
        "mode": mode,
        "ranks": ranks,
        "batch_size": BATCH,
        "metrics_window": window,
        "log_every_s": log_every_s,
        "bf16_autocast": bf16,
        "torch_threads": torch_threads,
        "checkpoint": {"enabled": False, "on_exit": False},
        "model": {"kind": "ffnn", "hidden": hidden},
        "optimizer": {"kind": "adam", "lr": DENSE_LR},
        "fresh_rows": fresh_rows,
    }
    if mode == "sync":
        trainer["staleness"] = 0
        trainer.pop("push_queue", None)
    raw["trainer"] = trainer
    # Row-wise Adagrad on the rows, as TorchRec's fused tables are trained here.
    for table in raw["store"]["tables"].values():
        table["optimizer"] = {"kind": "adagrad", "lr": ROW_LR, "eps": ROW_EPS, "rowwise": True}
    raw["source"] = {**raw["source"], "deadletter": "none"}
    raw["cluster"] = {
        **raw["cluster"],
        "workers": 2,
        "store_shards": 2,
        "dashboard_address": ":0",
        "store_latency_ms": latency_ms,
    }
    if scheduler is not None:
        raw["cluster"]["scheduler"] = scheduler
    return JobConfig.model_validate(raw)


def read_metrics(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for path in sorted(run_dir.glob("metrics-rank*.jsonl")):
        rank = int(path.stem.removeprefix("metrics-rank"))
        out[rank] = [json.loads(line) for line in read_lines(path) if line.strip()]
    return out


def measured_rate(lines: dict[int, list[dict[str, Any]]]) -> tuple[float, float, int, float, int]:
    """(samples/s, median interval samples/s, timed samples, timed seconds, all samples).

    Per rank, the clock runs from its first report (the end of its first step,
    or later: reports come every log_every_s) to its last (after the pushes
    drained); the ranks' rates add up.
    """
    rate = 0.0
    median_rate = 0.0
    timed_samples = 0
    timed_s = 0.0
    total = 0
    for rank_lines in lines.values():
        started = [r for r in rank_lines if r["samples"] > 0]
        first, end = started[0], rank_lines[-1]
        dt = end["elapsed_s"] - first["elapsed_s"]
        n = end["samples"] - first["samples"]
        rate += n / dt if dt > 0 else 0.0
        marks = [(r["elapsed_s"], r["samples"]) for r in started]
        median_rate += median_interval_rate(marks, every_s=0.99) if len(marks) > 1 else 0.0
        timed_samples += n
        timed_s = max(timed_s, dt)
        total += end["samples"]
    return rate, median_rate, timed_samples, timed_s, total


def timed_window(lines: dict[int, list[dict[str, Any]]]) -> tuple[float, float]:
    """The unix times the clock of :func:`measured_rate` ran between, over all ranks."""
    starts, ends = [], []
    for rank_lines in lines.values():
        started = [r for r in rank_lines if r["samples"] > 0]
        starts.append(started[0]["time"])
        ends.append(rank_lines[-1]["time"])
    return min(starts), max(ends)


def read_for_report(run_dir: Path, label: str) -> RunData | None:
    """The run's metrics as ``streamrec report`` reads them; None (and why) if it cannot."""
    from monitoring.runs import ReportError, load_run

    try:
        return load_run(run_dir, name=label)
    except ReportError as exc:  # the report is a by-product: the figures stand without it
        print(f"  {label}: left out of the report: {exc}", file=sys.stderr, flush=True)
        return None


def run_streamrec(
    mode: str,
    samples: int,
    *,
    seed: int,
    window: int,
    latency_ms: float,
    ranks: int,
    torch_threads: int | None,
    hidden: list[int],
    keep_dir: Path | None,
    log_every_s: float = 1.0,
    bf16: bool = False,
    log: bool,
    report: bool = False,
    scheduler: str | None = None,
) -> Run:
    from deploy.job import run_job

    fresh_rows = "off" if mode.endswith(STALE) else "bounded"
    label = mode if hidden == HIDDEN else f"{mode}-mlp{'-'.join(map(str, hidden))}"
    mode = mode.removesuffix(STALE)
    label += f"@{latency_ms:g}ms" if latency_ms else ""
    with tempfile.TemporaryDirectory(prefix=f"bench-e2e-{mode}-") as tmp:
        run_dir = (keep_dir / label) if keep_dir is not None else Path(tmp)
        if keep_dir is not None and run_dir.exists():
            shutil.rmtree(run_dir)  # metrics files are appended to: start afresh
        job = make_job(
            mode,
            samples,
            run_dir,
            seed=seed,
            window=window,
            latency_ms=latency_ms,
            ranks=ranks,
            torch_threads=torch_threads,
            hidden=hidden,
            log_every_s=log_every_s,
            bf16=bf16,
            fresh_rows=fresh_rows,
            scheduler=scheduler,
        )
        last = [0.0]

        def progress(p: Any) -> None:
            now = time.monotonic()
            if log and now - last[0] >= 10.0:
                auc = p.metrics.auc
                print(
                    f"  {label}: {p.samples:>10,} samples  {p.samples_per_s:>8,.0f}/s  "
                    f"AUC {auc if auc is None else round(auc, 4)}  wait {p.wait_s:.1f}s  "
                    f"compute {p.compute_s:.1f}s",
                    flush=True,
                )
                last[0] = now

        t_call = time.monotonic()
        stats, _ = run_job(job, max_events=samples, on_progress=progress)
        call_s = time.monotonic() - t_call
        lines = read_metrics(run_dir)
        # Read before the temporary run directory is deleted; drawn after every mode ran.
        metrics = read_for_report(run_dir, label) if report else None
    if not lines or 0 not in lines:
        msg = f"{label}: the run wrote no metrics"
        raise RuntimeError(msg)
    rate, median_rate, timed_samples, timed_s, total = measured_rate(lines)
    r0 = lines[0]
    first0 = next(r for r in r0 if r["samples"] > 0)
    auc = r0[-1]["metrics"]["auc"]
    # Where rank 0's time went after the first report (the loop's own counters).
    end0 = r0[-1]
    elapsed = stats.elapsed()
    return Run(
        mode=label,
        samples_per_s=rate,
        median_rate=median_rate,
        auc=auc,
        samples=total,
        timed_samples=timed_samples,
        timed_s=timed_s,
        startup_s=first0["elapsed_s"],
        breakdown={
            "wait_for_batch_s": round(end0["wait_s"] - first0["wait_s"], 2),
            "compute_s": round(end0["compute_s"] - first0["compute_s"], 2),
            "loop_total_s": round(elapsed, 2),
            "loop_wait_s": round(stats.wait_s, 2),
            "loop_compute_s": round(stats.compute_s, 2),
            "loop_push_wait_s": round(stats.push_wait_s, 2),
            "loop_sync_s": round(stats.sync_s, 2),
        },
        extra={
            "ranks": ranks,
            "steps": stats.steps,
            "stopped_by": stats.stopped_by,
            "job_call_s": round(call_s, 1),
            "rank_samples": {str(k): v[-1]["samples"] for k, v in lines.items()},
        },
        metrics=metrics,
        window=timed_window(lines),
    )


# --- main --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench-results/e2e.json"))
    parser.add_argument(
        "--samples", type=int, default=2_000_000, help="per mode (rounded up to whole batches)"
    )
    parser.add_argument(
        "--latency-samples",
        type=int,
        default=None,
        help="samples of the runs with added store latency (default: --samples)",
    )
    parser.add_argument(
        "--small-samples",
        type=int,
        default=None,
        help="samples of the small-model runs with added latency (default: --latency-samples)",
    )
    parser.add_argument(
        "--skip-small",
        action="store_true",
        help="leave out the small-model (MLP 64-32) sync/hybrid pair with added latency",
    )
    parser.add_argument(
        "--skip-default-at-latency",
        action="store_true",
        help="leave out the default-model sync/hybrid pair with added latency",
    )
    parser.add_argument("--window", type=int, default=100_000, help="progressive AUC window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--store-latency-ms",
        type=float,
        default=2.0,
        help="ms added to every store call in the second sync/hybrid pair (0: skip it)",
    )
    parser.add_argument(
        "--async-ranks", type=int, default=2, help="trainer ranks of the async mode"
    )
    parser.add_argument(
        "--log-every-s",
        type=float,
        default=1.0,
        help="trainer.log_every_s of the streamrec runs; every clock starts this far in",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="every trainer's dense network in bfloat16 autocast (trainer.bf16_autocast)",
    )
    parser.add_argument("--torch-threads", type=int, default=None, help="trainer.torch_threads")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep run dirs here")
    parser.add_argument(
        "--report",
        default="bench-results/e2e-report.html",
        metavar="PATH",
        help="HTML report of the streamrec runs, PNGs next to it ('': none)",
    )
    parser.add_argument(
        "--share-cluster",
        action="store_true",
        help="the streamrec runs after the first name one local Dask cluster started for "
        "them all (each still starts its own store shards): the smoke test's; their rates "
        "are not the full run's, where every job starts its own",
    )
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Planned:
    """One run of the benchmark: its key in the figures and how it trains."""

    key: str
    mode: str
    samples: int
    latency_ms: float
    ranks: int
    hidden: list[int]


def whole_batches(samples: int) -> int:
    """``samples`` rounded up to whole batches of both partitions.

    >>> whole_batches(1), whole_batches(8192)
    (8192, 8192)
    """
    step = BATCH * PARTITIONS
    return -(-samples // step) * step


def header(args: argparse.Namespace) -> dict[str, Any]:
    """The figures' first keys: the run's sizes and options."""
    samples = whole_batches(args.samples)
    lat_samples = whole_batches(args.latency_samples or args.samples)
    return {
        "samples": samples,
        "batch_size": BATCH,
        "window": args.window,
        "seed": args.seed,
        "cpus": os.cpu_count(),
        "async_ranks": args.async_ranks,
        "bf16": args.bf16,
        "store_latency_ms": args.store_latency_ms,
        "latency_samples": lat_samples,
        "small_samples": whole_batches(args.small_samples or lat_samples),
        "small_hidden": SMALL_HIDDEN,
        "load_before": load(),
    }


def plan_runs(args: argparse.Namespace, results: dict[str, Any]) -> list[Planned]:
    """The runs in order: each mode, then the pairs with added store latency
    (``torchrec`` left out, and said so in ``results``, where it is not installed)."""
    samples = results["samples"]
    plan: list[Planned] = []
    missing = torchrec_missing() if "torchrec" in args.modes else None
    if missing:
        print(f"torchrec: skipped: {missing}", flush=True)
        results["torchrec_skipped"] = missing
    for mode in args.modes:
        if mode == "torchrec" and missing:
            continue
        ranks = args.async_ranks if mode == "async" else 1
        plan.append(Planned(mode, mode, samples, 0.0, ranks, HIDDEN))
    lat = args.store_latency_ms
    if lat > 0:
        lat_key = f"{lat:g}ms"
        pairs = [m for m in ("sync", "hybrid", "hybrid_stale") if m in args.modes]
        if not args.skip_default_at_latency:
            n = results["latency_samples"]
            plan += [Planned(f"{m}_at_{lat_key}", m, n, lat, 1, HIDDEN) for m in pairs]
        if not args.skip_small:
            n = results["small_samples"]
            plan += [Planned(f"{m}_small_at_{lat_key}", m, n, lat, 1, SMALL_HIDDEN) for m in pairs]
    return plan


def train(args: argparse.Namespace, p: Planned, scheduler: str | None, log: bool) -> Run:
    """One planned run: in this process (``baseline``, ``torchrec``, ``step``) or as a job."""
    if p.mode == "step":
        return run_step_in_process(
            p.samples, args.seed, args.window, log, args.log_every_s, args.bf16
        )
    if p.mode in IN_PROCESS:
        return run_in_process(
            p.mode, p.samples, args.seed, args.window, log, args.log_every_s, args.bf16
        )
    return run_streamrec(
        p.mode,
        p.samples,
        seed=args.seed,
        window=args.window,
        latency_ms=p.latency_ms,
        ranks=p.ranks,
        torch_threads=args.torch_threads,
        hidden=p.hidden,
        keep_dir=args.keep_runs,
        log_every_s=args.log_every_s,
        bf16=args.bf16,
        log=log,
        report=bool(args.report),
        scheduler=scheduler,
    )


def with_machine_cpu(run: Run, cpu: MachineCpu, before: list[float]) -> Run:
    """The run with the load averages around it and the machine's busy cores over its clock."""
    run.extra["load_before"] = before
    run.extra["load_after"] = load()
    if run.window is not None:
        machine = cpu.over(*run.window)
        if machine:
            machine["cpu_ms_per_1k_samples"] = round(
                1e6 * machine["busy_cpu_s"] / max(run.timed_samples, 1), 1
            )
        run.extra["machine_cpu"] = machine
    return run


class Clusters:
    """With ``--share-cluster``: the first streamrec run starts its own Dask cluster, as
    every run of the full run does; the later ones name one shared cluster, started
    here when the second comes."""

    def __init__(self, stack: contextlib.ExitStack, share: bool) -> None:
        self.stack, self.share = stack, share
        self.scheduler: str | None = None
        self.ran_own = False

    def for_run(self, mode: str) -> str | None:
        if self.share and self.scheduler is None and mode not in IN_PROCESS:
            if self.ran_own:
                tmp = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-e2e-"))
                self.scheduler = self.stack.enter_context(shared_dask(Path(tmp) / "dask.log"))
            self.ran_own = True
        return self.scheduler


def run_plan(
    args: argparse.Namespace, plan: list[Planned], results: dict[str, Any]
) -> tuple[dict[str, Run], dict[str, str]]:
    """Every planned run in turn; the figures summarized and written after each."""
    log = not args.quiet
    runs: dict[str, Run] = {}
    errors: dict[str, str] = {}
    t_all = time.monotonic()
    results["shared_cluster"] = args.share_cluster
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(MachineCpu())
        clusters = Clusters(stack, args.share_cluster)
        for p in plan:
            scheduler = clusters.for_run(p.mode)
            before = load()
            if log:
                added = f", {p.latency_ms:g} ms per store call" if p.latency_ms else ""
                added += f", MLP {'-'.join(map(str, p.hidden))}" if p.hidden != HIDDEN else ""
                print(f"{p.key}: {p.samples:,} samples{added} (load {before})", flush=True)
            try:
                run = train(args, p, scheduler, log)
            except Exception as exc:  # one mode failing must not lose the others' figures
                errors[p.key] = f"{type(exc).__name__}: {exc}"
                print(f"{p.key} FAILED: {errors[p.key]}", file=sys.stderr, flush=True)
            else:
                runs[p.key] = with_machine_cpu(run, cpu, before)
            results["total_s"] = round(time.monotonic() - t_all, 1)
            results["load_after"] = load()
            summarize(
                results, runs, errors, args, results["samples"], f"{args.store_latency_ms:g}ms"
            )
            if args.json:  # after every mode: a later failure keeps what was measured
                write_json(args.json, results)
    return runs, errors


def print_runs(runs: dict[str, Run], errors: dict[str, str], results: dict[str, Any]) -> None:
    """The table of runs and the targets."""
    print()
    print(
        f"{'mode':<16} {'samples/s':>11} {'median 1s':>10} {'AUC':>8} {'timed':>24} "
        f"{'start-up':>9} {'busy cores':>10} {'CPU ms/1k':>9}  load before/after"
    )
    for k, r in runs.items():
        a = f"{r.auc:.4f}" if r.auc is not None else "-"
        timed = f"{r.timed_samples:,} in {r.timed_s:.1f}s"
        machine = r.extra.get("machine_cpu") or {}
        busy = machine.get("busy_cores", "-")
        per_k = machine.get("cpu_ms_per_1k_samples", "-")
        print(
            f"{k:<16} {r.samples_per_s:>11,.0f} {r.median_rate:>10,.0f} {a:>8} {timed:>24} "
            f"{r.startup_s:>8.1f}s {busy:>10} {per_k:>9}  "
            f"{r.extra['load_before'][0]}/{r.extra['load_after'][0]}"
        )
    for k, e in errors.items():
        print(f"{k:<16} FAILED: {e}")
    print()
    for key, t in results["targets"].items():
        v = t["value"]
        shown = "-" if v is None else f"{v:.4f}" if key == "auc_gap" else f"{v:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"{key:<24} {shown:>8}  (target {t['target']}): {verdict}")
    if "async_note" in results:
        print(results["async_note"])
    print(f"load average before {results['load_before']}, after {results['load_after']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = header(args)
    plan = plan_runs(args, results)
    runs, errors = run_plan(args, plan, results)
    samples = results["samples"]
    report = write_run_report(Path(args.report), runs, samples) if args.report else None
    print_runs(runs, errors, results)
    if args.json:
        print(f"wrote {args.json}")
    if report is not None:
        print(f"wrote {report}")
    return 1 if errors else 0


def write_run_report(path: Path, runs: dict[str, Run], samples: int) -> Path | None:
    """The HTML report of the streamrec runs (after the timing: it costs no measured time)."""
    from monitoring.report import write_report
    from monitoring.runs import ReportError

    loaded = [r.metrics for r in runs.values() if r.metrics is not None]
    if not loaded:
        return None
    try:
        return write_report(
            loaded, path, title=f"benchmarks/e2e.py: streamrec modes ({samples:,} samples)"
        )
    except (ReportError, OSError) as exc:
        print(f"report not written: {exc}", file=sys.stderr)
        return None


def summarize(
    results: dict[str, Any],
    runs: dict[str, Run],
    errors: dict[str, str],
    args: argparse.Namespace,
    samples: int,
    lat_key: str,
) -> None:
    """Put the figures of ``runs`` so far, the ratios and the targets into ``results``."""
    for key, run in runs.items():
        results[f"{key}_samples_per_s"] = run.samples_per_s
        results[f"{key}_auc"] = run.auc
    rate = {k: r.samples_per_s for k, r in runs.items()}
    auc = {k: r.auc for k, r in runs.items()}
    results["hybrid_vs_baseline"] = ratio(rate.get("hybrid"), rate.get("baseline"))
    results["hybrid_vs_torchrec"] = ratio(rate.get("hybrid"), rate.get("torchrec"))
    results["torchrec_vs_baseline"] = ratio(rate.get("torchrec"), rate.get("baseline"))
    results["hybrid_vs_sync"] = ratio(rate.get("hybrid"), rate.get("sync"))
    # The trainer alone against the peers' steps, and what the job's other parts cost it.
    results["step_vs_baseline"] = ratio(rate.get("step"), rate.get("baseline"))
    results["step_vs_torchrec"] = ratio(rate.get("step"), rate.get("torchrec"))
    results["hybrid_vs_step"] = ratio(rate.get("hybrid"), rate.get("step"))
    h_auc, s_auc = auc.get("hybrid"), auc.get("sync")
    results["auc_gap"] = abs(h_auc - s_auc) if h_auc is not None and s_auc is not None else None
    # What reading one's own pushes fresh costs: hybrid against hybrid_stale (fresh_rows off).
    results["hybrid_vs_hybrid_stale"] = ratio(rate.get("hybrid"), rate.get("hybrid_stale"))
    # The control: the machine's CPU per sample of hybrid_stale against hybrid's. Where
    # every core is busy in both, this is the throughput ratio the extra CPU alone makes.
    cpu = {k: r.extra.get("machine_cpu", {}).get("cpu_ms_per_1k_samples") for k, r in runs.items()}
    for suffix in ("", f"_small_at_{lat_key}"):
        results[f"cpu_per_sample_hybrid_stale_vs_hybrid{suffix}"] = ratio(
            cpu.get(f"hybrid_stale{suffix}"), cpu.get(f"hybrid{suffix}")
        )
    for kind in ("", "small_"):
        results[f"hybrid_vs_sync_{kind}at_{lat_key}"] = ratio(
            rate.get(f"hybrid_{kind}at_{lat_key}"), rate.get(f"sync_{kind}at_{lat_key}")
        )
        results[f"hybrid_vs_hybrid_stale_{kind}at_{lat_key}"] = ratio(
            rate.get(f"hybrid_{kind}at_{lat_key}"), rate.get(f"hybrid_stale_{kind}at_{lat_key}")
        )
    targets = {}
    for key, bound in TARGETS.items():
        value = results.get(key)
        met = None if value is None else (value <= bound if key == "auc_gap" else value >= bound)
        targets[key] = {
            "target": f"{'<=' if key == 'auc_gap' else '>='} {bound}",
            "value": value,
            "met": met,
        }
    results["targets"] = targets
    results["runs"] = {
        k: {
            "samples": r.samples,
            "timed_samples": r.timed_samples,
            "timed_s": round(r.timed_s, 2),
            "startup_s": round(r.startup_s, 2),
            "median_interval_samples_per_s": round(r.median_rate, 1),
            "breakdown": r.breakdown,
            **r.extra,
        }
        for k, r in runs.items()
    }
    results["errors"] = dict(errors)
    if "async" in runs:
        results["async_note"] = (
            "async ran with 1 trainer rank: the same as hybrid without the dense allreduce "
            "(which one rank does not do either)"
            if args.async_ranks == 1
            else f"async ran with {args.async_ranks} trainer ranks (one partition each, dense "
            "nets averaged every 50 steps): samples/s is their sum, the AUC rank 0's "
            f"after {samples:,} samples in all"
        )


if __name__ == "__main__":
    sys.exit(main())
