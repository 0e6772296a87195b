"""Embedding store throughput, measured side by side in one run.

    python benchmarks/store.py --json bench-results/store.json

A table of ``--distinct`` ids (10M by default), dim 16, Adagrad, float16 rows on
the wire; every batch holds ``--batch-ids`` (65,536) distinct ids drawn Zipf-like
(P(rank k) ~ 1/k) from the table, as a batch prepared by the pipeline does after
deduplication. The table is filled first, so lookups are steady-state hits.

Figures (rows per second, the median over ``--repeats`` batches):

- ``gather_limit_rows_per_s``: numpy gather of the same rows from a float32
  array of the same size, the physical reference;
- ``inproc_lookup_rows_per_s`` / ``inproc_push_rows_per_s``: a ``StoreShard``
  in this process (training lookups, Adagrad pushes);
- ``grpc_*_rows_per_s``: the same calls through ``StoreClient`` to one, then two,
  shard processes on loopback (keys ``grpc_lookup_rows_per_s``,
  ``grpc_push_rows_per_s``, and ``..._2_shards``); Lookup and Push travel as raw
  frames (``embedding_store.wire``), float16 rows and float32 gradients, through
  a shared-memory area, as a client on the shards' host does by default;
- ``grpc_network_*_rows_per_s``: one shard again with ``shared_memory=False``,
  every byte through the loopback socket (a client on another host);
- ``inproc_lookup_vs_limit``: the ratio of the in-process lookup to the gather;
- ``grpc_vs_inproc_lookup`` / ``grpc_vs_inproc_push``: one shard over gRPC against
  the same table in this process (what gRPC and the two processes cost), and
  ``grpc_network_vs_inproc_*`` the same without the shared area.

The in-process lookup returns float32 rows, the gRPC one float16 rows (the store's
``row_dtype``): each as its caller gets them. The machine is shared by both ends
of the gRPC figures (client and shard process), so on a 2-core machine they also
measure the two competing for the cores.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    median_rate,
    print_figures,
    store_shards,
    write_json,
    write_store_job,
    write_token,
    zipf_ranks,
)

from embedding_store.client import StoreClient
from embedding_store.hashing import mix64
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig

DIM = 16
BATCH = 65_536


def zipf_batches(distinct: int, n_batches: int, seed: int, batch: int = BATCH) -> list[np.ndarray]:
    """Batches of ``batch`` distinct ids, ranks drawn with P(k) ~ 1/k, ids scrambled."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        chosen = np.zeros(0, dtype=np.int64)
        while chosen.shape[0] < batch:
            u = rng.random(batch * 2)
            ranks = zipf_ranks(u, distinct, np.int64)
            both = np.concatenate([chosen, ranks])
            _, first = np.unique(both, return_index=True)
            chosen = both[np.sort(first)]
        out.append(chosen[:batch])
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


def store_config(distinct: int, shards: int, batch: int = BATCH) -> dict:  # type: ignore[type-arg]
    return {
        "tables": {
            "emb": {
                "dim": DIM,
                "optimizer": {"kind": "adagrad", "lr": 0.01},
                "capacity": int(distinct * 1.1 / shards) + batch,
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
    *,
    shared_memory: bool = True,
) -> tuple[float, float]:
    batch = grads.shape[0]
    job = write_store_job(tmp / f"job-{n_shards}.yaml", store_config(distinct, n_shards, batch))
    token_file = tmp / "token"
    dirs = [tmp / f"grpc{n_shards}-{i}-{shared_memory}" for i in range(n_shards)]
    with (
        store_shards(job, dirs, token_file) as address,
        StoreClient.connect(
            address,
            token=token_file.read_text().strip(),
            max_message_bytes=256 << 20,
            shared_memory=shared_memory,
        ) as client,
    ):
        fill(lambda ids: client.lookup({"emb": ids}), distinct)
        lookup = median_rate(
            lambda i: client.lookup({"emb": batches[i % len(batches)]}), batch, repeats
        )
        push = median_rate(
            lambda i: client.push({"emb": (batches[i % len(batches)], grads)}), batch, repeats
        )
        return lookup, push


def gather_rate(distinct: int, positions: list[np.ndarray], repeats: int) -> float:
    """numpy gathering the same rows from a float32 array of the table's size."""
    table = np.random.default_rng(3).random((distinct, DIM), dtype=np.float32)
    return median_rate(
        lambda i: np.take(table, positions[i % len(positions)], axis=0),
        positions[0].shape[0],
        repeats,
    )


def bench_inproc(
    distinct: int, batches: list[np.ndarray], grads: np.ndarray, repeats: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    # The physical reference: gather rows at the same skewed positions.
    positions = [np.asarray(b % np.uint64(distinct), dtype=np.int64) for b in batches]
    out["gather_limit_rows_per_s"] = gather_rate(distinct, positions, repeats)
    gc.collect()
    batch = grads.shape[0]
    shard = StoreShard(StoreConfig.model_validate(store_config(distinct, 1, batch)))
    fill(lambda ids: shard.lookup({"emb": ids}), distinct)
    out["inproc_lookup_rows_per_s"] = median_rate(
        lambda i: shard.lookup({"emb": batches[i % len(batches)]}), batch, repeats
    )
    out["inproc_push_rows_per_s"] = median_rate(
        lambda i: shard.push({"emb": (batches[i % len(batches)], grads)}), batch, repeats
    )
    out["inproc_lookup_vs_limit"] = out["inproc_lookup_rows_per_s"] / out["gather_limit_rows_per_s"]
    return out


def shown(v: Any) -> str:
    """A figure as printed: rates to the unit with thousands separators, ratios to 3 places."""
    return (
        f"{v:,.0f}"
        if isinstance(v, float) and v > 100
        else (f"{v:.3f}" if isinstance(v, float) else str(v))
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument(
        "--distinct", type=int, default=10_000_000, help="distinct ids in the table"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed batches per figure")
    parser.add_argument(
        "--batch-ids",
        type=int,
        default=BATCH,
        help=f"distinct ids per call (default {BATCH:,}; at most half of --distinct)",
    )
    parser.add_argument("--skip-grpc", action="store_true", help="only the in-process figures")
    args = parser.parse_args(argv)

    if args.batch_ids * 2 > args.distinct:
        # Zipf draws reach the table's tail slowly: a batch of most of it would take ages.
        parser.error(f"--batch-ids {args.batch_ids} is more than half of --distinct")
    return args


def grpc_phase(
    args: argparse.Namespace,
    batches: list[np.ndarray],
    grads: np.ndarray,
    results: dict[str, float | int | str],
) -> None:
    """Over gRPC to one and two shard processes, and through the socket alone; each
    against the in-process rates."""
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        tmp_path = Path(tmp)
        write_token(tmp_path / "token")
        for n in (1, 2):
            lookup, push = bench_grpc(n, args.distinct, batches, grads, args.repeats, tmp_path)
            suffix = "" if n == 1 else "_2_shards"
            results[f"grpc_lookup_rows_per_s{suffix}"] = lookup
            results[f"grpc_push_rows_per_s{suffix}"] = push
        lookup, push = bench_grpc(
            1, args.distinct, batches, grads, args.repeats, tmp_path, shared_memory=False
        )
        results["grpc_network_lookup_rows_per_s"] = lookup
        results["grpc_network_push_rows_per_s"] = push
    results["grpc_vs_inproc_lookup"] = float(results["grpc_lookup_rows_per_s"]) / float(
        results["inproc_lookup_rows_per_s"]
    )
    results["grpc_vs_inproc_push"] = float(results["grpc_push_rows_per_s"]) / float(
        results["inproc_push_rows_per_s"]
    )
    for kind in ("lookup", "push"):
        results[f"grpc_network_vs_inproc_{kind}"] = float(
            results[f"grpc_network_{kind}_rows_per_s"]
        ) / float(results[f"inproc_{kind}_rows_per_s"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [rank_to_id(b) for b in zipf_batches(args.distinct, 8, 1, args.batch_ids)]
    grads = np.random.default_rng(2).normal(scale=0.01, size=(args.batch_ids, DIM))
    grads = grads.astype(np.float32)
    results: dict[str, float | int | str] = {
        "distinct_ids": args.distinct,
        "dim": DIM,
        "batch_ids": args.batch_ids,
        "repeats": args.repeats,
    }
    results.update(bench_inproc(args.distinct, batches, grads, args.repeats))
    gc.collect()
    if not args.skip_grpc:
        grpc_phase(args, batches, grads, results)
    print_figures(results, shown)
    if args.json:
        write_json(args.json, results, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
