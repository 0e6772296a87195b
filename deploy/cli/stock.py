"""``streamrec dask ...`` and ``streamrec torchrun ...``: the stock tools, arguments unchanged."""

from __future__ import annotations

import argparse
import sys


def _exec_stock(argv: list[str]) -> int:
    """Replace this process with ``argv`` (signals and the exit code are the stock tool's)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 127  # pragma: no cover  (execv does not return)


def stock_command(args: argparse.Namespace) -> list[str]:
    """The stock command that ``streamrec dask ...`` / ``streamrec torchrun ...`` runs.

    >>> from deploy.cli import build_parser
    >>> stock_command(build_parser().parse_args(["dask", "worker", "--nthreads", "2"]))[1:]
    ['-m', 'dask', 'worker', '--nthreads', '2']
    >>> stock_command(build_parser().parse_args(["torchrun", "--nnodes", "2", "-m", "x"]))[1:4]
    ['-m', 'torch.distributed.run', '--nnodes']
    """
    if args.command == "dask":
        return [sys.executable, "-m", "dask", args.dask_command, *args.dask_args]
    return [sys.executable, "-m", "torch.distributed.run", *args.torchrun_args]


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dask`` and ``torchrun`` to the ``streamrec`` parser."""
    # Their arguments are the stock tool's, options included: no prefix chars of our
    # own, so argparse hands everything after the command over untouched (and
    # `--help` is the stock tool's).
    dask = sub.add_parser(
        "dask",
        prefix_chars="\0",
        add_help=False,
        help="the stock `dask scheduler` / `dask worker` (one entry point for every role)",
        description=(
            "Run the stock Dask command with the arguments unchanged: `streamrec dask worker "
            "tcp://sched:8786 --nthreads 2` is `dask worker tcp://sched:8786 --nthreads 2` "
            "in streamrec's environment (the image's one entry point)."
        ),
    )
    dask.add_argument("dask_command", choices=["scheduler", "worker"], metavar="scheduler|worker")
    dask.add_argument("dask_args", nargs=argparse.REMAINDER, help="passed to dask as they are")
    dask.set_defaults(func=lambda a: _exec_stock(stock_command(a)))
    torchrun = sub.add_parser(
        "torchrun",
        prefix_chars="\0",
        add_help=False,
        help="the stock `torchrun` (trainer hosts: ... -m deploy.cli run job.yaml)",
        description=(
            "Run torchrun (torch.distributed.run) with the arguments unchanged, e.g. "
            "`streamrec torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint trainer-0:29400 --rdzv-id ctr -m deploy.cli run job.yaml`."
        ),
    )
    torchrun.add_argument(
        "torchrun_args", nargs=argparse.REMAINDER, help="passed to torchrun as they are"
    )
    torchrun.set_defaults(func=lambda a: _exec_stock(stock_command(a)))
