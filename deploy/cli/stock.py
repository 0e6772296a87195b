"""``streamrec dask ...`` and ``streamrec torchrun ...``: the stock tools, arguments unchanged;
``streamrec rendezvous``: torchrun's c10d rendezvous store on a host of its own.

``streamrec torchrun`` runs torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(unless set otherwise): with the default, torch 2.13's c10d rendezvous never
re-forms a world with a replaced trainer host. The surviving agent that was
the rendezvous' rank 0 keeps the master address it published for the first
round and does not publish it for the next one, so the new host waits for that
key, and the survivor waits for the new host, until the join timeout. Without
the shared store, rank 0 publishes it again every round.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

# See the module docstring: set for torchrun by `streamrec torchrun`.
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _exec_stock(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """Replace this process with ``argv`` (signals and the exit code are the stock tool's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, dict(os.environ if env is None else env))
    return 127  # pragma: no cover  (execve does not return)


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for torchrun: the rendezvous store not shared with the agents, unless the
    user said otherwise.

    >>> torchrun_env({"PATH": "/bin"})[SHARE_STORE_ENV], torchrun_env({SHARE_STORE_ENV: "0"})
    ('1', {'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '0'})
    """
    return {SHARE_STORE_ENV: "1", **env}


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
    """Add ``dask``, ``torchrun`` and ``rendezvous`` to the ``streamrec`` parser."""
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
            "`streamrec torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 100 "
            "--rdzv-backend c10d --rdzv-endpoint rendezvous-host:29400 --rdzv-conf is_host=0 "
            "--rdzv-id ctr -m deploy.cli run job.yaml` (the endpoint: `streamrec "
            "rendezvous`), with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless set otherwise, "
            "so that a replaced trainer host can join the world again."
        ),
    )
    torchrun.add_argument(
        "torchrun_args", nargs=argparse.REMAINDER, help="passed to torchrun as they are"
    )
    torchrun.set_defaults(func=lambda a: _exec_stock(stock_command(a), torchrun_env(os.environ)))
    add_rendezvous_command(sub)


def cmd_rendezvous(args: argparse.Namespace) -> int:
    """Serve torchrun's c10d rendezvous store until SIGTERM or Ctrl-C."""
    import signal
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(
        args.host,
        args.port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=900),
    )
    endpoint = f"{args.host}:{store.port}"
    print(
        f"streamrec rendezvous: torchrun's c10d store on {endpoint}; on every trainer host: "
        f"streamrec torchrun --nnodes N --max-restarts 100 --rdzv-backend c10d "
        f"--rdzv-endpoint {endpoint} --rdzv-conf is_host=0 --rdzv-id JOB "
        "-m deploy.cli run job.yaml",
        flush=True,
    )
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    signal.sigwait(signals)
    print("streamrec rendezvous: stopped", flush=True)
    return 0


def add_rendezvous_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``rendezvous`` to the ``streamrec`` parser."""
    rendezvous = sub.add_parser(
        "rendezvous",
        help="torchrun's c10d rendezvous store, on a host that runs no trainer",
        description=(
            "Serve the key-value store (a torch TCPStore) where the trainer hosts' torchrun "
            "agents meet, on a host of its own: a world can then re-form when any trainer "
            "host dies (with the store on a trainer host, that host's death takes the "
            "rendezvous with it). Every torchrun then names it with --rdzv-endpoint "
            "HOST:PORT --rdzv-conf is_host=0. It holds no state that outlives a world: "
            "restarted, the agents meet again at the next restart."
        ),
    )
    rendezvous.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default: every address)"
    )
    rendezvous.add_argument(
        "--port", type=int, default=29400, help="port (default 29400, torchrun's; 0: a free one)"
    )
    rendezvous.set_defaults(func=cmd_rendezvous)
