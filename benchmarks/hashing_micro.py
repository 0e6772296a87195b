"""``build_batch`` throughput on a Criteo-like table, and where the time goes.

    python benchmarks/hashing_micro.py [--rows 100000] [--repeats 7] [--shared-table] [--json PATH]

The table has a label, 13 dense integer counts (10% missing, ``log1p``, clipped)
and 26 single-hot string fields of 8 hex characters (5% missing) whose
cardinalities span 4 to 10M, values drawn Zipf-like (P(rank k) ~ 1/k), as in
the Criteo display-ads logs. Each sparse field feeds its own embedding table
(as DLRM does), or with ``--shared-table`` all feed one.

Prints the median seconds and events/s of ``build_batch`` and of its parts on
one thread (after a warm-up call that loads the compiled kernels), then
``dedup`` against ``np.unique`` on ``--dedup-ids`` Zipf-like ids. With
``--json``, the same figures: ``build_batch_events_per_s``,
``hash_events_per_s``, ``bags_dedup_events_per_s``,
``dense_matrix_events_per_s``, ``label_matrix_events_per_s``,
``unique_fraction`` and, per size N, ``dedup_N_ids_s``,
``np_unique_N_ids_s`` and ``dedup_N_vs_np_unique``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    CRITEO_DENSE,
    CRITEO_SPARSE,
    criteo_spec,
    median_seconds,
    write_json,
    zipf_ranks,
)

from pipeline.batch import build_batch, dedup, dedup_bags, dense_matrix, label_matrix
from pipeline.hashing import FieldHasher

if TYPE_CHECKING:
    from connectors.spec import FeatureSpec

N_DENSE = len(CRITEO_DENSE)
CARDINALITIES = [
    4, 10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000,
    3_000_000, 10_000_000, 20, 500, 5_000, 50_000, 500_000, 2_000_000, 7, 60, 800,
    8_000, 80_000, 800_000,
]  # fmt: skip


def hex_strings(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """uint32 values as 8-character lowercase hex strings, built without Python objects."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    nib = (values[:, None] >> np.arange(28, -4, -4, dtype=np.uint32)) & 0xF
    data = digits[nib].astype(np.uint8).reshape(-1)
    offsets = np.arange(values.shape[0] + 1, dtype=np.int32) * 8
    mask = pa.array(~valid)
    arr = pa.StringArray.from_buffers(values.shape[0], pa.py_buffer(offsets), pa.py_buffer(data))
    return pa.compute.if_else(mask, pa.scalar(None, pa.string()), arr)


def criteo_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"label": pa.array(rng.random(rows) < 0.25)}
    for name in CRITEO_DENSE:
        counts = np.floor(rng.pareto(1.2, rows) * 3).astype(np.int64)
        cols[name] = pa.array(counts, mask=rng.random(rows) < 0.1)
    for i, (name, card) in enumerate(zip(CRITEO_SPARSE, CARDINALITIES, strict=True)):
        ranks = zipf_ranks(rng.random(rows), card, np.uint64)
        scrambled = ((ranks + np.uint64(i * 7919)) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)
        cols[name] = hex_strings(scrambled.astype(np.uint32), rng.random(rows) >= 0.05)
    return pa.table(cols)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shared-table", action="store_true")
    parser.add_argument(
        "--dedup-ids",
        default="100000,1000000",
        help="sizes of the dedup against np.unique, comma-separated (default 100000,1000000)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def parts_of(table: pa.Table, spec: FeatureSpec) -> list[tuple[str, str, Callable[[], object]]]:
    """``build_batch`` and its parts: (label printed, JSON key, the call)."""
    fields = spec.tables()
    hashed: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}

    def hash_all() -> None:
        for name, names in fields.items():
            hashers = [FieldHasher(f, table.column(f), "string") for f in names]
            ids = np.empty(sum(h.bound for h in hashers), dtype=np.uint64)
            lengths = np.empty((len(names), table.num_rows), dtype=np.int32)
            starts = np.empty(len(names), dtype=np.int64)
            pos = 0
            for f, h in enumerate(hashers):
                starts[f] = pos
                pos = h.into(ids, pos, lengths[f])
            hashed[name] = (ids, starts, lengths, pos)

    def dedup_all() -> None:
        for ids, starts, lengths, total in hashed.values():
            dedup_bags(ids, starts, lengths, total)

    return [
        ("build_batch", "build_batch", lambda: build_batch(table, spec)),
        ("  hash (26 string fields)", "hash", hash_all),
        ("  bags + dedup", "bags_dedup", dedup_all),
        ("  dense_matrix (13 fields)", "dense_matrix", lambda: dense_matrix(table, spec)),
        ("  label_matrix", "label_matrix", lambda: label_matrix(table, spec)),
    ]


def build_batch_phase(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """``build_batch`` and each of its parts, timed; the unique share of the ids."""
    table = criteo_table(args.rows, seed=0)
    spec = criteo_spec({"transform": "log1p", "clip_max": 20.0}, shared_table=args.shared_table)
    layout = "one shared table" if args.shared_table else f"{len(spec.tables())} tables"
    print(f"{args.rows} rows, {N_DENSE} dense + {len(CARDINALITIES)} string fields, {layout}")
    for label, key, fn in parts_of(table, spec):
        s = median_seconds(lambda _, fn=fn: fn(), args.repeats)
        print(f"{label:<28} {s * 1e3:8.2f} ms  {args.rows / s / 1e6:8.2f} M events/s")
        figures[f"{key}_events_per_s"] = args.rows / s
    batch = build_batch(table, spec)
    unique = sum(len(t.unique_ids) for t in batch.tables.values())
    ids = sum(len(t.inverse) for t in batch.tables.values())
    print(f"ids {ids}, unique {unique} ({unique / max(ids, 1):.0%})")
    figures["unique_fraction"] = unique / max(ids, 1)


def dedup_phase(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    """dedup against numpy's sort-based np.unique on Zipf-like scrambled ids, as a
    ratio measured side by side (this was once a timed test; timings belong here)."""
    rng = np.random.default_rng(0)
    for n in (int(float(x)) for x in args.dedup_ids.split(",")):
        ranks = np.floor(np.exp(rng.random(n) * np.log(n))).astype(np.uint64)
        scrambled = ranks * np.uint64(0x9E3779B97F4A7C15)
        ours = median_seconds(lambda _, x=scrambled: dedup(x), args.repeats)
        theirs = median_seconds(
            lambda _, x=scrambled: np.unique(x, return_inverse=True), args.repeats
        )
        print(
            f"dedup {n:>9,} ids  {ours * 1e3:8.2f} ms  np.unique {theirs * 1e3:8.2f} ms  "
            f"({theirs / ours:.1f}x faster)"
        )
        figures[f"dedup_{n}_ids_s"] = ours
        figures[f"np_unique_{n}_ids_s"] = theirs
        figures[f"dedup_{n}_vs_np_unique"] = theirs / ours


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures: dict[str, Any] = {
        "rows": args.rows,
        "repeats": args.repeats,
        "shared_table": args.shared_table,
    }
    build_batch_phase(args, figures)
    dedup_phase(args, figures)
    if args.json is not None:
        write_json(args.json, figures, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
