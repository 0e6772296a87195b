"""The ``streamrec`` command line.

    streamrec store serve --port 7000 --data-dir /var/lib/streamrec/shard-0 \\
        --token-file token --config job.yaml

One module per command group, each with an ``add_commands(subparsers)`` that
adds its commands and their handlers: :mod:`deploy.cli.store` (``store serve``,
``replica``, ``reshard``, ``health``), :mod:`deploy.cli.synth`,
:mod:`deploy.cli.produce`, :mod:`deploy.cli.kafka` (``kafka up|down|topic``,
Tansu included), :mod:`deploy.cli.s3`, :mod:`deploy.cli.stock` (``dask``,
``torchrun``, ``rendezvous``), :mod:`deploy.cli.train` (``demo``, ``run``, ``backfill``) and
:mod:`deploy.cli.serve` (``score``, ``evaluate``, ``serve``); ``report`` comes
from :mod:`monitoring.report`. The handlers import what they need when they run,
so that ``streamrec --help`` stays fast.

>>> build_parser().parse_args(["kafka", "topic", "list"]).topic_command
'list'
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from deploy.cli import kafka, produce, s3, serve, stock, store, synth, train
from deploy.cli.stock import stock_command

__all__ = ["build_parser", "main", "stock_command"]


def build_parser() -> argparse.ArgumentParser:
    """The ``streamrec`` parser: every command group's commands, in the order ``--help`` lists."""
    from monitoring.report import add_report_command

    parser = argparse.ArgumentParser(
        prog="streamrec",
        description=(
            "Continuous training of deep recommender models from event streams, with a "
            "persistent sharded embedding store."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (store, synth, produce, kafka, s3, stock, train, serve):
        group.add_commands(sub)
    add_report_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
