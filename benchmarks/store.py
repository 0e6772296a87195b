"""Embedding store throughput, measured side by side in one run.

    python benchmarks/store.py --json bench-results/store.json

A table of ``--distinct`` ids (10M by default), dim 16, Adagrad, float16 rows on
the wire; every batch holds 65,536 distinct ids drawn Zipf-like (P(rank k) ~ 1/k)
from the table, as a batch prepared by the pipeline does after deduplication.
The table is filled first, so lookups are steady-state hits.

Figures (rows per second, the median over ``--repeats`` batches):

- ``gather_limit_rows_per_s``: numpy gather of the same rows from a float32
  array of the same size, the physical reference;
- ``inproc_lookup_rows_per_s`` / ``inproc_push_rows_per_s``: a ``StoreShard``
  in this process (training lookups, Adagrad pushes);
- ``grpc_*_rows_per_s``: the same calls through ``StoreClient`` to one, then two,
  shard processes on loopback (keys ``grpc_lookup_rows_per_s``,
  ``grpc_push_rows_per_s``, and ``..._2_shards``);
- ``inproc_lookup_vs_limit``: the ratio of the in-process lookup to the gather.
"""

from __future__ import annotations

import argparse
import gc
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.hashing import mix64
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig

DIM = 16
BATCH = 65_536


def zipf_batches(distinct: int, n_batches: int, seed: int) -> list[np.ndarray]:
    """Batches of BATCH distinct ids, ranks drawn with P(k) ~ 1/k, ids scrambled."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        chosen = np.zeros(0, dtype=np.int64)
        while chosen.shape[0] < BATCH:
            u = rng.random(BATCH * 2)
            ranks = np.floor(np.exp(u * np.log(distinct + 1.0))).astype(np.int64) - 1
            both = np.concatenate([chosen, ranks])
            _, first = np.unique(both, return_index=True)
            chosen = both[np.sort(first)]
        out.append(chosen[:BATCH])
    return out


def rank_to_id(ranks: np.ndarray) -> np.ndarray:
    ids = np.empty(ranks.shape[0], dtype=np.uint64)
    _scramble(ranks.astype(np.uint64), ids)
    return ids


def _scramble_py(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.shape[0]):
        dst[i] = mix64(src[i])


try:
    import numba as nb

    _scramble = nb.njit(cache=True)(_scramble_py)
except ImportError:  # pragma: no cover
    _scramble = _scramble_py


def median_rate(fn: Callable[[int], object], repeats: int, rows: int) -> float:
    fn(0)  # warm-up (compilation, connections)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return rows / statistics.median(times)


def store_config(distinct: int, shards: int) -> dict:  # type: ignore[type-arg]
    return {
        "tables": {
            "emb": {
                "dim": DIM,
                "optimizer": {"kind": "adagrad", "lr": 0.01},
                "capacity": int(distinct * 1.1 / shards) + BATCH,
                "initial_rows": int(distinct * 1.05 / shards),
            }
        },
        "row_dtype": "float16",
        "max_message_bytes": 256 << 20,
    }


def fill(lookup: Callable[[np.ndarray], object], distinct: int) -> None:
    for start in range(0, distinct, 1 << 18):
        lookup(rank_to_id(np.arange(start, min(distinct, start + (1 << 18)))))


def bench_grpc(
    n_shards: int,
    distinct: int,
    batches: list[np.ndarray],
    grads: np.ndarray,
    repeats: int,
    tmp: Path,
) -> tuple[float, float]:
    job = tmp / f"job-{n_shards}.yaml"
    job.write_text(yaml.safe_dump({"store": store_config(distinct, n_shards)}))
    token_file = tmp / "token"
    procs = [
        ShardProcess.start(job, tmp / f"grpc{n_shards}-{i}", token_file=token_file)
        for i in range(n_shards)
    ]
    try:
        address = "grpc://" + ",".join(p.address for p in procs)
        with StoreClient.connect(
            address, token=token_file.read_text().strip(), max_message_bytes=256 << 20
        ) as client:
            fill(lambda ids: client.lookup({"emb": ids}), distinct)
            lookup = median_rate(
                lambda i: client.lookup({"emb": batches[i % len(batches)]}), repeats, BATCH
            )
            push = median_rate(
                lambda i: client.push({"emb": (batches[i % len(batches)], grads)}), repeats, BATCH
            )
            return lookup, push
    finally:
        for p in procs:
            p.kill()


def gather_rate(distinct: int, positions: list[np.ndarray], repeats: int) -> float:
    """numpy gathering the same rows from a float32 array of the table's size."""
    table = np.random.default_rng(3).random((distinct, DIM), dtype=np.float32)
    return median_rate(
        lambda i: np.take(table, positions[i % len(positions)], axis=0), repeats, BATCH
    )


def bench_inproc(
    distinct: int, batches: list[np.ndarray], grads: np.ndarray, repeats: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    # The physical reference: gather rows at the same skewed positions.
    positions = [np.asarray(b % np.uint64(distinct), dtype=np.int64) for b in batches]
    out["gather_limit_rows_per_s"] = gather_rate(distinct, positions, repeats)
    gc.collect()
    shard = StoreShard(StoreConfig.model_validate(store_config(distinct, 1)))
    fill(lambda ids: shard.lookup({"emb": ids}), distinct)
    out["inproc_lookup_rows_per_s"] = median_rate(
        lambda i: shard.lookup({"emb": batches[i % len(batches)]}), repeats, BATCH
    )
    out["inproc_push_rows_per_s"] = median_rate(
        lambda i: shard.push({"emb": (batches[i % len(batches)], grads)}), repeats, BATCH
    )
    out["inproc_lookup_vs_limit"] = out["inproc_lookup_rows_per_s"] / out["gather_limit_rows_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument(
        "--distinct", type=int, default=10_000_000, help="distinct ids in the table"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed batches per figure")
    parser.add_argument("--skip-grpc", action="store_true", help="only the in-process figures")
    args = parser.parse_args(argv)

    batches = [rank_to_id(b) for b in zipf_batches(args.distinct, 8, seed=1)]
    grads = np.random.default_rng(2).normal(scale=0.01, size=(BATCH, DIM)).astype(np.float32)
    results: dict[str, float | int | str] = {
        "distinct_ids": args.distinct,
        "dim": DIM,
        "batch_ids": BATCH,
        "repeats": args.repeats,
    }

    results.update(bench_inproc(args.distinct, batches, grads, args.repeats))
    gc.collect()

    if not args.skip_grpc:
        with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
            tmp_path = Path(tmp)
            (tmp_path / "token").write_text(secrets.token_hex(16))
            for n in (1, 2):
                lookup, push = bench_grpc(n, args.distinct, batches, grads, args.repeats, tmp_path)
                suffix = "" if n == 1 else "_2_shards"
                results[f"grpc_lookup_rows_per_s{suffix}"] = lookup
                results[f"grpc_push_rows_per_s{suffix}"] = push

    width = max(len(k) for k in results)
    for k, v in results.items():
        shown = (
            f"{v:,.0f}"
            if isinstance(v, float) and v > 100
            else (f"{v:.3f}" if isinstance(v, float) else str(v))
        )
        print(f"{k:<{width}}  {shown}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
