"""Scale: the same job with tables of 10M, 100M and 1B embedding parameters.

    python benchmarks/scale.py --json bench-results/scale.json              # 1e7, 1e8, 1e9
    python benchmarks/scale.py --sizes 1e6,1e7 --samples 100000 --json /tmp/scale.json

For each size P (parameters, ``--dim`` 16 floats a row, so P / 16 rows):

1. **Tables.** The synthetic Criteo-like stream's 26 fields get vocabularies in
   Criteo's proportions that add up to P / 16 rows. Each field's table is sized to hold its rows
   on ``--shards`` (4) store shard processes (``capacity`` = the field's share
   of one shard plus six standard deviations of the split), rows allocated up
   front (``initial_rows``), per-coordinate Adagrad (the default) on the rows.
2. **Bulk load.** Every row is created before training, by ``StoreClient.
   create_rows`` (a Lookup with ``create_only``: ids go out, no rows come
   back), from the field's vocabulary hashed as the pipeline hashes it
   (``SyntheticSource.vocabulary``, ``pipeline.hashing.hash_sparse``), in a
   random order of ranks, so the rows a job uses lie all over the table's
   memory. Timed (``load_rows_per_s``).
   **The same job at every size:** the stream trained on draws its ids (Zipf,
   ``new_id_rate`` 0) from the smallest size's vocabularies, the first ranks
   of every larger one, so each batch brings the same ids and the same work,
   and only the tables grow: at 1B most rows are cold, as in production, and
   the ones a batch touches are scattered over 12 GiB instead of 120 MiB.
3. **Store rows/s** (``lookup_rows_per_s``): lookup then push of the unique ids
   of one 4096-event batch of that stream (all 26 tables in one call each),
   from this process over gRPC to the 4 shards; rows (looked up + pushed) per
   second, median over ``--store-batches`` batches. ``uniform_lookup_rows_per_s``
   does the same with 65,536 ids drawn uniformly over all rows (no Zipf head
   in the CPU caches: the worst case of a large table).
4. **Training** (``train_samples_per_s``): ``deploy.job.run_job`` in hybrid mode
   on the loaded shards (``cluster.store``), 2 Dask workers, 1 trainer, the
   e2e benchmark's model and batch (FFNN 512-256, batch 4096), checkpoints
   off, ``--samples`` events; samples/s measured as ``benchmarks/e2e.py`` does.
5. **Memory** (``bytes_per_param``): the shard processes' resident memory (VmRSS)
   once trained, less that of as many shard processes with empty tables (the
   interpreter, numba, gRPC), per parameter; ``min_bytes_per_param`` is the
   weights and the Adagrad state (8 bytes a parameter) and ``bytes_vs_min``
   their ratio. ``table_bytes_per_param`` is what the shards' Stats report for
   their arrays, ``rss_bytes_per_param`` the whole processes' memory.

``throughput_1b_vs_10m`` is the largest size's ``train_samples_per_s`` over the
smallest's (the target: >= 0.8), ``store_1b_vs_10m`` the same for
``lookup_rows_per_s``. The 1B size needs about 12 GiB of memory for the shards.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_figures, wait_all, write_json, write_store_job, write_token
from e2e import HIDDEN, make_job, measured_rate, read_metrics

from connectors.synthetic import (
    CRITEO_CARDINALITIES,
    SPARSE_NAMES,
    SyntheticConfig,
    SyntheticSource,
)

if TYPE_CHECKING:
    from deploy.local.shards import ShardProcess, StartingShard

TARGETS = {"throughput_1b_vs_10m": 0.8, "bytes_vs_min": 1.5}
LOAD_CHUNK = 1 << 20
BATCH = 4096
UNIFORM_IDS = 65_536  # ids of one uniform lookup, over all tables
PARTITIONS = 2


def cardinalities(rows: int) -> tuple[int, ...]:
    """Criteo's 26 field cardinalities scaled to add up to ``rows`` (each at least 1).

    >>> c = cardinalities(625_000)
    >>> sum(c), len(c), min(c) >= 1
    (625000, 26, True)
    """
    total = sum(CRITEO_CARDINALITIES)
    out = [max(1, round(c * rows / total)) for c in CRITEO_CARDINALITIES]
    big = int(np.argmax(out))
    out[big] += rows - sum(out)
    return tuple(out)


def shard_capacity(rows: int, shards: int) -> int:
    """Rows one shard must hold of a table of ``rows`` split by a hash over ``shards``."""
    mean = rows / shards
    return math.ceil(mean + 6.0 * math.sqrt(mean) + 64)


def store_section(
    cards: tuple[int, ...],
    shards: int,
    dim: int,
    *,
    rowwise: bool = False,
    memory_rows: int | None = None,
) -> dict[str, Any]:
    """The store's tables; with ``memory_rows`` (over all tables and shards) each table
    larger than its share of it is tiered: its share in memory, the rest on disk.

    >>> cards = (10, 1_000_000) + (1,) * 24
    >>> tables = store_section(cards, 2, 4, memory_rows=100_000)["tables"]
    >>> "tier" in tables["c1"], tables["c2"]["tier"]["memory_rows"], tables["c2"]["capacity"]
    (False, 65534, 504307)
    """
    tables = {}
    for name, k in zip(SPARSE_NAMES, cards, strict=True):
        cap = shard_capacity(k, shards)
        table: dict[str, Any] = {
            "dim": dim,
            "capacity": cap,
            "initial_rows": cap,
            "initializer": {"kind": "uniform", "scale": 0.01},
            "optimizer": {"kind": "adagrad", "lr": 0.05, "rowwise": rowwise},
        }
        # Memory holds at least one call's rows: a batch's, or the uniform phase's share.
        least = max(2 * BATCH, math.ceil(2 * UNIFORM_IDS * k / sum(cards) / shards))
        share = max(least, math.ceil(memory_rows * k / sum(cards) / shards)) if memory_rows else cap
        if share < k / shards:
            table["tier"] = {"memory_rows": share}
            table["initial_rows"] = share
        tables[name.lower()] = table
    return {"tables": tables, "row_dtype": "float16"}


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    msg = f"no VmRSS for process {pid}"
    raise RuntimeError(msg)


def spawn_shards(job: Path, root: Path, n: int, token: Path) -> list[StartingShard]:
    """``n`` shard processes started, not yet waited for (see ``common.wait_all``)."""
    from deploy.local.shards import ShardProcess

    return [ShardProcess.spawn(job, root / f"shard-{i}", token_file=token) for i in range(n)]


def spawn_idle_shard(tmp: Path, dim: int) -> StartingShard:
    """A shard process whose tables are empty and tiny, started, not yet waited for."""
    tiny = {c.lower(): {"dim": dim, "capacity": 16, "initial_rows": 16} for c in SPARSE_NAMES}
    job = write_store_job(tmp / "tiny.yaml", {"tables": tiny})
    (shard,) = spawn_shards(job, tmp / "tiny", 1, write_token(tmp / "tiny.token"))
    return shard


def idle_shard_rss(shard: ShardProcess) -> int:
    """The idle shard's resident memory once it has served for a second; then it is killed."""
    try:
        time.sleep(1.0)
        return rss_bytes(shard.proc.pid)
    finally:
        shard.kill()


def bulk_load(
    client: Any, source: SyntheticSource, cards: tuple[int, ...], *, in_id_order: bool = False
) -> tuple[int, float]:
    """Create every row of every field's vocabulary, in a random order; (rows, seconds).

    ``in_id_order``: each field's ids are sent sorted, as a bulk load of tiered tables
    should be: the disk engine then writes each row once, where ids in a random order
    have it merge and rewrite its files again and again.
    """
    from pipeline.hashing import hash_sparse

    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    rows = 0
    for field, k in zip(SPARSE_NAMES, cards, strict=True):
        order = rng.permutation(k)
        parts = []
        for start in range(0, k, LOAD_CHUNK):
            values = source.vocabulary(field, order[start : start + LOAD_CHUNK])
            parts.append(hash_sparse(field, values, "string")[0])
            if not in_id_order:
                client.create_rows({field.lower(): parts.pop()})
        if in_id_order:
            ids = np.sort(np.concatenate(parts))
            del parts
            for start in range(0, k, LOAD_CHUNK):
                client.create_rows({field.lower(): ids[start : start + LOAD_CHUNK]})
        rows += k
    return rows, time.perf_counter() - t0


class PeakMemory:
    """The largest resident memory this process and all its descendants held together,
    sampled every ``every_s`` seconds while the ``with`` block runs."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss(os.getpid()))
            if self._stop.wait(self.every_s):
                return


def tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and every process under it (0 for one that is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        with suppress(OSError, RuntimeError):
            total += rss_bytes(p)
    return total


def batch_ids(source: SyntheticSource, position: int) -> dict[str, np.ndarray]:
    """The unique ids of each table in the 4096 events of partition 0 from ``position``."""
    from pipeline.hashing import hash_sparse

    table = source.records(0, position, BATCH)
    return {f.lower(): np.unique(hash_sparse(f, table[f], "string")[0]) for f in SPARSE_NAMES}


def store_rates(
    client: Any,
    stream: SyntheticSource,
    source: SyntheticSource,
    cards: tuple[int, ...],
    batches: int,
    dim: int,
) -> dict[str, float]:
    """Median rows/s of lookup+push of ``stream``'s batches, and of ids uniform over ``cards``."""
    from pipeline.hashing import hash_sparse

    rng = np.random.default_rng(0)

    def cycle(ids: dict[str, np.ndarray]) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        client.lookup(ids)
        t1 = time.perf_counter()
        grads = {
            k: (v, rng.normal(0, 1e-3, (v.shape[0], dim)).astype(np.float32))
            for k, v in ids.items()
        }
        t2 = time.perf_counter()
        client.push(grads)
        t3 = time.perf_counter()
        return t1 - t0, t3 - t2, sum(v.shape[0] for v in ids.values())

    drawn = [batch_ids(stream, 10_000_000 + i * BATCH) for i in range(batches + 1)]
    cycle(drawn[0])  # warm-up: connections, first pages
    both, look, push = [], [], []
    for ids in drawn[1:]:
        tl, tp, n = cycle(ids)
        both.append(2 * n / (tl + tp))
        look.append(n / tl)
        push.append(n / tp)
    # Uniform over all rows: each table's share of 65,536 ids, by its cardinality.
    total = sum(cards)
    uniform = []
    for _ in range(batches):
        ids = {}
        for field, k in zip(SPARSE_NAMES, cards, strict=True):
            n = max(1, round(UNIFORM_IDS * k / total))
            picked = source.vocabulary(field, np.unique(rng.integers(0, k, n)))
            ids[field.lower()] = hash_sparse(field, picked, "string")[0]
        tl, tp, n = cycle(ids)
        uniform.append(2 * n / (tl + tp))
    return {
        "lookup_rows_per_s": statistics.median(both),
        "lookup_only_rows_per_s": statistics.median(look),
        "push_rows_per_s": statistics.median(push),
        "uniform_lookup_rows_per_s": statistics.median(uniform),
        "batch_unique_ids": statistics.median(
            sum(v.shape[0] for v in ids.values()) for ids in drawn
        ),
    }


def train(
    tmp: Path,
    store: dict[str, Any],
    cards: tuple[int, ...],
    address: str,
    token: Path,
    samples: int,
    seed: int,
    log_every_s: float,
) -> dict[str, Any]:
    """Hybrid training on the loaded shards; samples/s as benchmarks/e2e.py measures it."""
    from deploy.config import JobConfig
    from deploy.job import run_job

    run_dir = tmp / "run"
    base = make_job(
        "hybrid",
        samples,
        run_dir,
        seed=seed,
        window=50_000,
        latency_ms=0.0,
        ranks=1,
        torch_threads=None,
        hidden=HIDDEN,
        log_every_s=log_every_s,
    )
    raw = base.model_dump(mode="json")
    raw["store"] = store
    raw["source"] = {**raw["source"], "cardinalities": list(cards), "new_id_rate": 0.0}
    raw["cluster"] = {
        **raw["cluster"],
        "store": address,
        "store_shards": address.count(",") + 1,
        "token_file": str(token),
    }
    job = JobConfig.model_validate(raw)
    t0 = time.monotonic()
    stats, _ = run_job(job, max_events=samples)
    lines = read_metrics(run_dir)
    rate, median_rate, _, timed_s, total = measured_rate(lines)
    return {
        "train_auc": lines[0][-1]["metrics"]["auc"],
        "train_samples_per_s": rate,
        "train_median_interval_samples_per_s": median_rate,
        "train_samples": total,
        "train_timed_s": round(timed_s, 1),
        "train_job_s": round(time.monotonic() - t0, 1),
        "stopped_by": stats.stopped_by,
    }


def memory_figures(
    params: int, dim: int, shards: int, rss: list[int], idle: int, table_bytes: int
) -> dict[str, Any]:
    """The shards' memory per parameter, over that of idle shards, against the minimum."""
    minimum = 4 * (dim + dim)  # float32 weights + Adagrad accumulators, per row
    grown = sum(rss) - shards * idle
    return {
        "bytes_per_param": grown / params,
        "min_bytes_per_param": minimum / dim,
        "bytes_vs_min": grown / params / (minimum / dim),
        "table_bytes_per_param": table_bytes / params,
        "rss_bytes_per_param": sum(rss) / params,
        "idle_shard_rss_bytes": idle,
    }


def tier_figures(stats: list[Any], before: dict[str, int]) -> dict[str, Any]:
    """The tiered tables' rows in memory and on disk, and the share of the lookups since
    ``before`` (see :func:`tier_counts`) that memory answered."""
    now = tier_counts(stats)
    asked = now["tier_asked"] - before["tier_asked"]
    missed = now["tier_missed"] - before["tier_missed"]
    return {
        "memory_rows": now["memory_rows"],
        "disk_rows": now["disk_rows"],
        "disk_bytes": now["disk_bytes"],
        "train_hit_rate": 1.0 - missed / asked if asked else None,
    }


def tier_counts(stats: list[Any]) -> dict[str, int]:
    keys = ("memory_rows", "disk_rows", "disk_bytes", "tier_asked", "tier_missed")
    return {k: sum(getattr(t, k) for s in stats for t in s.tables) for k in keys}


def one_size(params: int, stream_rows: int, args: argparse.Namespace) -> dict[str, Any]:
    with PeakMemory() as peak:
        out = measure_size(params, stream_rows, args)
    out["peak_rss_all_bytes"] = peak.peak
    print(f"  peak resident memory, all processes: {peak.peak / 2**30:.1f} GiB", flush=True)
    return out


def measure_size(params: int, stream_rows: int, args: argparse.Namespace) -> dict[str, Any]:
    from embedding_store.client import StoreClient
    from embedding_store.types import StoreConfig

    tiered = params in args.tiered
    rows = params // args.dim
    cards = cardinalities(rows)
    source = SyntheticSource(SyntheticConfig(seed=args.seed, cardinalities=cards))
    # Ranks are the same values whatever the cardinality: the stream's ids are the
    # first ranks of the loaded vocabularies.
    stream_cards = tuple(min(a, b) for a, b in zip(cardinalities(stream_rows), cards, strict=True))
    stream = SyntheticSource(
        SyntheticConfig(seed=args.seed, cardinalities=stream_cards, new_id_rate=0.0)
    )
    store = store_section(
        cards,
        args.shards,
        args.dim,
        rowwise=args.rowwise,
        memory_rows=args.memory_rows if tiered else None,
    )
    print(
        f"\n== {params:,} parameters: {rows:,} rows of dim {args.dim} on {args.shards} shards"
        + (f", at most {args.memory_rows:,} of them in memory" if tiered else ""),
        flush=True,
    )
    with (
        ExitStack() as stack,
        tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.dir) as tmp_s,
    ):
        tmp = Path(tmp_s)
        job = write_store_job(tmp / "store.yaml", store)
        token = write_token(tmp / "token")
        # The idle shard and the size's shards start side by side (a start is mostly
        # imports); the idle one is measured and gone before the bulk load.
        idle_shard, *procs = wait_all(
            [spawn_idle_shard(tmp, args.dim), *spawn_shards(job, tmp, args.shards, token)]
        )
        for p in procs:
            stack.callback(p.kill)
        idle = idle_shard_rss(idle_shard)
        address = "grpc://" + ",".join(p.address for p in procs)
        client = stack.enter_context(
            StoreClient.connect(
                address, token=token.read_text().strip(), config=StoreConfig.model_validate(store)
            )
        )
        loaded, load_s = bulk_load(client, source, cards, in_id_order=tiered)
        print(
            f"  loaded {loaded:,} rows in {load_s:.1f} s ({loaded / load_s:,.0f} rows/s)",
            flush=True,
        )
        stats = client.stats()
        present = sum(t.rows for s in stats for t in s.tables)
        if present != rows:
            msg = f"{present:,} rows in the store after the load, expected {rows:,}"
            raise RuntimeError(msg)
        rates = store_rates(client, stream, source, cards, args.store_batches, args.dim)
        print(
            f"  store: {rates['lookup_rows_per_s']:,.0f} rows/s lookup+push of stream batches, "
            f"{rates['uniform_lookup_rows_per_s']:,.0f} of uniform ids",
            flush=True,
        )
        before = tier_counts(client.stats())
        trained = train(
            tmp, store, stream_cards, address, token, args.samples, args.seed, args.log_every_s
        )
        tier = tier_figures(client.stats(), before) if tiered else {}
        print(
            f"  trained {trained['train_samples']:,} samples: "
            f"{trained['train_samples_per_s']:,.0f} samples/s",
            flush=True,
        )
        rss = [rss_bytes(p.proc.pid) for p in procs]
        table_bytes = sum(t.memory_bytes for s in client.stats() for t in s.tables)
    out = {
        "params": params,
        "rows": rows,
        "tiered": tiered,
        "load_rows_per_s": loaded / load_s,
        **rates,
        **trained,
        **tier,
        **memory_figures(params, args.dim, args.shards, rss, idle, table_bytes),
    }
    print(
        f"  memory: {out['bytes_per_param']:.2f} bytes/param "
        f"({out['bytes_vs_min']:.2f}x the minimum {out['min_bytes_per_param']:.0f})",
        flush=True,
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench-results/scale.json"))
    parser.add_argument(
        "--sizes",
        default="1e7,1e8,1e9",
        help="parameters per size, comma-separated (default 1e7,1e8,1e9)",
    )
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--samples", type=int, default=600_000, help="events trained at each size (default 600,000)"
    )
    parser.add_argument("--store-batches", type=int, default=20)
    parser.add_argument(
        "--log-every-s",
        type=float,
        default=1.0,
        help="the training run's report interval, its clock's ticks (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiered",
        default="",
        help="sizes (of --sizes) whose tables are tiered: at most --memory-rows rows in "
        "memory, the rest on disk (e.g. 1e10)",
    )
    parser.add_argument(
        "--memory-rows",
        type=int,
        default=8_000_000,
        help="a tiered size's rows in memory, over all tables and shards (default 8M)",
    )
    parser.add_argument(
        "--rowwise", action="store_true", help="row-wise Adagrad (one accumulator a row)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the shards' data (and disk tiers) go"
    )
    args = parser.parse_args(argv)
    args.tiered = {int(float(x)) for x in args.tiered.split(",") if x}
    return args


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure over the sizes, and the largest size against the smallest."""
    keys = [
        "params",
        "tiered",
        "lookup_rows_per_s",
        "train_samples_per_s",
        "train_auc",
        "peak_rss_all_bytes",
        "bytes_per_param",
        "bytes_vs_min",
        "uniform_lookup_rows_per_s",
        "load_rows_per_s",
        "table_bytes_per_param",
        "rss_bytes_per_param",
    ]
    figures: dict[str, Any] = {k: [r[k] for r in runs] for k in keys}
    figures["min_bytes_per_param"] = runs[0]["min_bytes_per_param"]
    memory = [r for r in runs if not r["tiered"]] or runs
    figures["throughput_1b_vs_10m"] = (
        memory[-1]["train_samples_per_s"] / memory[0]["train_samples_per_s"]
    )
    figures["store_1b_vs_10m"] = memory[-1]["lookup_rows_per_s"] / memory[0]["lookup_rows_per_s"]
    tiered = [r for r in runs if r["tiered"]]
    if tiered:
        figures["tiered_vs_smallest"] = (
            tiered[-1]["train_samples_per_s"] / runs[0]["train_samples_per_s"]
        )
        figures["tiered_peak_rss_gib"] = tiered[-1]["peak_rss_all_bytes"] / 2**30
        figures["tiered_train_hit_rate"] = tiered[-1]["train_hit_rate"]
    figures["targets"] = TARGETS
    figures["runs"] = runs
    figures["cpus"] = os.cpu_count()
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    runs = [one_size(p, min(sizes) // args.dim, args) for p in sizes]
    figures = summarize(runs)
    print()
    print_figures(
        {k: v for k, v in figures.items() if k not in ("runs", "targets")},
        lambda v: ", ".join(f"{x:,.3g}" for x in v) if isinstance(v, list) else f"{v:,.3g}",
    )
    write_json(args.json, figures, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
