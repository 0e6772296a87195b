"""The ``streamrec`` command line.

    streamrec store serve --port 7000 --data-dir /var/lib/streamrec/shard-0 \\
        --token-file token --config job.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.config import ConfigError, load_config


def _store_serve(args: argparse.Namespace) -> int:
    from deploy.store_server import read_token, serve  # keeps `--help` fast

    try:
        job = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.token_file is None and not args.no_auth:
        print(
            "streamrec store serve: --token-file is required (or --no-auth for a "
            "loopback-only test shard)",
            file=sys.stderr,
        )
        return 2
    token = None if args.no_auth else read_token(args.token_file)
    return serve(job.store, host=args.host, port=args.port, data_dir=args.data_dir, token=token)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description=(
            "Continuous training of deep recommender models from event streams, with a "
            "persistent sharded embedding store."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    store = sub.add_parser("store", help="run and manage embedding store shards")
    store_sub = store.add_subparsers(dest="store_command", required=True, metavar="SUBCOMMAND")
    serve = store_sub.add_parser(
        "serve",
        help="serve one store shard over gRPC",
        description=(
            "Serve one embedding store shard over gRPC. On start the shard restores the "
            "newest checkpoint in --data-dir; on SIGTERM or Ctrl-C it checkpoints there "
            "and exits 0."
        ),
    )
    serve.add_argument("--config", type=Path, required=True, help="job YAML (its `store:` section)")
    serve.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--data-dir", type=Path, required=True, help="where the shard persists")
    serve.add_argument("--token-file", type=Path, help="file holding the job's auth token")
    serve.add_argument(
        "--no-auth", action="store_true", help="accept calls without a token (tests on loopback)"
    )
    serve.set_defaults(func=_store_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
