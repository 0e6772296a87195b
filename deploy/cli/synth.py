"""``streamrec synth``: the synthetic Criteo-like stream written to Parquet (for backfill)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _synth(args: argparse.Namespace) -> int:
    from connectors.synthetic import SyntheticConfig, SyntheticSource, write_parquet
    from trainer.metrics import best_auc

    config = SyntheticConfig(seed=args.seed)
    path = write_parquet(args.to, config, events=args.events, row_group_size=args.row_group_size)
    best = best_auc(SyntheticSource(config), n_samples=min(args.events, 200_000))
    print(f"wrote {args.events} synthetic events to {path}")
    print(f"best achievable AUC of this stream: {best:.4f}")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``synth`` to the ``streamrec`` parser."""
    synth = sub.add_parser(
        "synth",
        help="write the synthetic Criteo-like stream to Parquet (for backfill)",
        description="Write the first N events of the synthetic stream to one Parquet file.",
    )
    synth.add_argument("--to", type=Path, required=True, help="output PATH.parquet")
    synth.add_argument("--events", type=int, required=True, help="how many events")
    synth.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    synth.add_argument("--row-group-size", type=int, default=65536, help="rows per row group")
    synth.set_defaults(func=_synth)
