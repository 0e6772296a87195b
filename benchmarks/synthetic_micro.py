"""Synthetic source throughput: events per second of ``SyntheticSource.read`` on one core.

    python benchmarks/synthetic_micro.py --json bench-results/synthetic.json

Reads ``--chunks`` consecutive chunks of ``--chunk-size`` events (Criteo-like:
1 label, 13 dense, 26 string fields; Arrow table out) after a warm-up read that
compiles the numba kernel. Figures: ``read_events_per_s`` (the median over
chunks), ``json_lines_per_s`` (``iter_json_lines``, the ``streamrec produce``
path) and ``best_auc`` (200k events).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_figures, write_json

from connectors.synthetic import SyntheticConfig, SyntheticSource, iter_json_lines
from trainer.metrics import best_auc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--json-events", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    cfg = SyntheticConfig(seed=args.seed, chunk_size=args.chunk_size)
    src = SyntheticSource(cfg)
    part = src.partitions()[0]
    first = src.plan(part, 0, args.chunk_size)
    assert first is not None  # an endless stream always plans
    src.read(first)  # warm-up: numba compile or cache load
    rates = []
    for k in range(args.chunks):
        chunk = src.plan(part, (k + 1) * args.chunk_size, args.chunk_size)
        assert chunk is not None
        t0 = time.perf_counter()
        src.read(chunk)
        rates.append(len(chunk) / (time.perf_counter() - t0))

    t0 = time.perf_counter()
    lines = sum(1 for _ in iter_json_lines(cfg, events=args.json_events))
    json_rate = lines / (time.perf_counter() - t0)

    figures = {
        "read_events_per_s": round(statistics.median(rates)),
        "read_events_per_s_min": round(min(rates)),
        "json_lines_per_s": round(json_rate),
        "best_auc": round(best_auc(src, 200_000), 4),
        "chunk_size": args.chunk_size,
    }
    print_figures(figures, lambda v: f"{v:,}" if isinstance(v, int) else f"{v}")
    if args.json is not None:
        write_json(args.json, figures, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
