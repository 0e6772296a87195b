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
so that ``streamrec --help`` stays fast. A handler returns its exit code (None for
0), or raises :class:`UsageError` for a command line it cannot run with, which
:func:`dispatch` alone turns into exit 2 and ``streamrec <cmd>: error: ...``.

>>> build_parser().parse_args(["kafka", "topic", "list"]).topic_command
'list'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.cli import kafka, produce, s3, serve, stock, store, synth, train
from deploy.cli.stock import stock_command
from deploy.cli.usage import USAGE_EXIT, UsageError

__all__ = ["USAGE_EXIT", "UsageError", "build_parser", "dispatch", "main", "stock_command"]

# The namespace attribute holding the prog of the command that was parsed
# (``streamrec store serve``): the prefix of its usage errors.
PROG_DEST = "command_prog"


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
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Give every command's namespace its prog, for :func:`dispatch`'s messages.

    The parser of the innermost command parsed sets it last, so it wins.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(**{PROG_DEST: command.prog})
                _name_commands(command)


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command's handler; its exit code, or :data:`USAGE_EXIT` on a usage error.

    The one place a :class:`UsageError` becomes a message and an exit code:

    >>> def handler(args: argparse.Namespace) -> int:
    ...     raise UsageError("--rate -1: expected 0 or more")
    >>> import contextlib, io
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     code = dispatch(argparse.Namespace(func=handler, command_prog="streamrec produce"))
    >>> code, err.getvalue()
    (2, 'streamrec produce: error: --rate -1: expected 0 or more\\n')
    """
    try:
        code = args.func(args)
    except UsageError as exc:
        prog = getattr(args, PROG_DEST, "streamrec")
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    return 0 if code is None else int(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script."""
    return dispatch(build_parser().parse_args(argv))
