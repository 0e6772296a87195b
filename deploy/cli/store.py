"""``streamrec store ...``: run and manage embedding store shards.

``serve`` runs a training shard, ``replica`` a read-only copy of one for
prediction servers, ``reshard`` lays a job checkpoint out on another number
of shards and ``health`` is a readiness probe.

>>> parser = argparse.ArgumentParser(prog="streamrec")
>>> add_commands(parser.add_subparsers(dest="command"))
>>> args = parser.parse_args(["store", "health", "--address", "127.0.0.1:7000"])
>>> args.func is _store_health, args.timeout
(True, 5.0)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.cli.usage import UsageError, load_job
from embedding_store.follow import FOLLOW_POLL_S

if TYPE_CHECKING:
    from embedding_store.location import Location

TOKEN_FILE_HELP = "file holding the job's auth token (default: $STREAMREC_STORE_TOKEN)"


def _store_token(args: argparse.Namespace) -> str | None:
    """The job's token for a store process (None with --no-auth); checks --metrics-port too."""
    import os

    from deploy.cluster import TOKEN_ENV
    from deploy.store_server import read_token

    env_token = os.environ.get(TOKEN_ENV, "").strip()
    if args.token_file is None and not env_token and not args.no_auth:
        msg = (
            f"give the job's token with --token-file or ${TOKEN_ENV} "
            "(or --no-auth for a loopback-only test shard)"
        )
        raise UsageError(msg)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        msg = f"--metrics-port {args.metrics_port}: expected 0-65535 (0: any free port)"
        raise UsageError(msg)
    if args.no_auth:
        return None
    return read_token(args.token_file) if args.token_file is not None else env_token


def _snapshots(args: argparse.Namespace) -> Location | None:
    """The --snapshots location (None when not given)."""
    if args.snapshots is None:
        return None
    from embedding_store.errors import CheckpointError
    from embedding_store.location import Location

    try:
        mirror = Location.parse(args.snapshots)
        mirror.check()
    except CheckpointError as exc:
        msg = f"--snapshots {exc}"
        raise UsageError(msg) from exc
    return mirror


def _store_serve(args: argparse.Namespace) -> int:
    # Imported here, not above: `--help` must not pay for the job config's imports.
    from deploy.store_server import serve

    job = load_job(args.config)
    token = _store_token(args)
    mirror = _snapshots(args)
    return serve(
        job.store,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        token=token,
        metrics_port=args.metrics_port,
        allow_dirs=tuple(args.allow_dir),
        mirror=mirror,
        advertise=args.advertise_host,
    )


def _store_replica(args: argparse.Namespace) -> int:
    from deploy.store_server import serve_replica

    job = load_job(args.config)
    token = _store_token(args)
    mirror = _snapshots(args)
    if not args.poll_s > 0:
        msg = f"--poll-s: must be > 0, got {args.poll_s}"
        raise UsageError(msg)
    return serve_replica(
        job.store,
        follow=args.follow,
        host=args.host,
        port=args.port,
        token=token,
        data_dir=args.data_dir,
        snapshots=mirror,
        poll_s=args.poll_s,
        metrics_port=args.metrics_port,
        advertise=args.advertise_host,
    )


def _store_reshard(args: argparse.Namespace) -> int:
    from deploy.config import ConfigError, load_config
    from deploy.reshard import ReshardError, reshard
    from trainer.checkpoint import JobCheckpointError

    try:
        job = load_config(args.config)
        manifest, shards = reshard(
            job, args.sources, args.targets, work_dir=args.work_dir, log=print
        )
    except (ConfigError, ReshardError, JobCheckpointError) as exc:
        print(f"streamrec store reshard: {exc}", file=sys.stderr)
        return 1
    rows = sum(s.rows for s in shards)
    print(
        f"job checkpoint step {manifest.step} ({manifest.path}) now names {len(shards)} "
        f"shards holding {rows:,} rows; start the job with cluster.store_shards: "
        f"{len(shards)} (or those shards in cluster.store, in this order)"
    )
    return 0


def _store_health(args: argparse.Namespace) -> int:
    """Exit 0 when the shard at ``--address`` answers Health with SERVING (a readiness probe)."""
    import os

    import grpc

    from deploy.cluster import TOKEN_ENV
    from deploy.store_server import read_token
    from embedding_store.proto import embedding_store_pb2 as pb
    from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
    from embedding_store.service import AUTH_HEADER

    token = read_token(args.token_file) if args.token_file else os.environ.get(TOKEN_ENV, "")
    metadata = ((AUTH_HEADER, f"Bearer {token.strip()}"),) if token.strip() else ()
    with grpc.insecure_channel(args.address) as channel:
        try:
            stub = pb_grpc.EmbeddingStoreStub(channel)  # type: ignore[no-untyped-call]
            reply = stub.Health(pb.HealthRequest(), metadata=metadata, timeout=args.timeout)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "ERROR"
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            print(f"streamrec store health: {args.address}: {code}: {detail}", file=sys.stderr)
            return 1
    if reply.status != "SERVING":
        print(f"streamrec store health: {args.address}: {reply.status}", file=sys.stderr)
        return 1
    print(f"{args.address}: SERVING {len(reply.dims)} table(s)")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``store`` (``serve``, ``replica``, ``reshard``, ``health``) to the parser."""
    store = sub.add_parser("store", help="run and manage embedding store shards")
    store_sub = store.add_subparsers(dest="store_command", required=True, metavar="SUBCOMMAND")
    _add_serve(store_sub)
    _add_replica(store_sub)
    _add_reshard(store_sub)
    _add_health(store_sub)


def _add_serve(store_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    serve.add_argument(
        "--advertise-host",
        metavar="HOST",
        help=(
            "the host name clients reach this shard by (its label in metrics and logs), when "
            "--host is 0.0.0.0 or a private address (default: --host)"
        ),
    )
    serve.add_argument("--data-dir", type=Path, required=True, help="where the shard persists")
    serve.add_argument(
        "--token-file",
        type=Path,
        help=TOKEN_FILE_HELP,
    )
    serve.add_argument(
        "--snapshots",
        metavar="URL",
        help=(
            "also copy every checkpoint to this shard's own folder in an object store "
            "(s3://bucket/job/shard-000?endpoint_override=HOST:PORT&scheme=http; credentials "
            "from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), so that the shard restarted on any "
            "host, with an empty --data-dir, restores from there"
        ),
    )
    serve.add_argument(
        "--no-auth", action="store_true", help="accept calls without a token (tests on loopback)"
    )
    serve.add_argument(
        "--allow-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help=(
            "a folder outside --data-dir that Checkpoint and Restore calls may name (e.g. a "
            "shared export folder for resharding); repeatable. Any other path is refused"
        ),
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help=(
            "also serve Prometheus metrics at http://HOST:N/metrics, on the --host address "
            "(0: any free port, printed on start; default: no metrics server)"
        ),
    )
    serve.set_defaults(func=_store_serve)


def _add_replica(store_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replica = store_sub.add_parser(
        "replica",
        help="serve a read-only replica of one store shard, for prediction servers",
        description=(
            "Serve a read-only copy of the training shard at --follow, which follows its "
            "changes every --poll-s seconds (the rows pushed and evicted since the version it "
            "holds), so that prediction servers read fresh rows without loading the shards "
            "that train. With --snapshots (the training shard's --data-dir or --snapshots URL) "
            "it starts from the newest checkpoint there, serving even while the training shard "
            "is down. `streamrec store health` answers SYNCING until it has caught up, then "
            "SERVING. An id without a row is read as the table's initial row."
        ),
    )
    replica.add_argument(
        "--config", type=Path, required=True, help="job YAML (its `store:` section)"
    )
    replica.add_argument(
        "--follow", required=True, metavar="HOST:PORT", help="the training shard to follow"
    )
    replica.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    replica.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    replica.add_argument(
        "--advertise-host", metavar="HOST", help="the host name clients reach this replica by"
    )
    replica.add_argument(
        "--data-dir",
        type=Path,
        required=True,
        help="where the snapshot is fetched to (the replica writes nothing else)",
    )
    replica.add_argument(
        "--snapshots",
        metavar="DIR_OR_URL",
        help="the training shard's checkpoints (its --data-dir or --snapshots URL) to start from",
    )
    replica.add_argument(
        "--poll-s",
        type=float,
        default=FOLLOW_POLL_S,
        metavar="S",
        help="seconds between two rounds of asking the training shard what changed "
        f"({FOLLOW_POLL_S:g}): rows are served about this much after training changed them, "
        "and each round costs the training shard a fixed price",
    )
    replica.add_argument(
        "--token-file",
        type=Path,
        help=TOKEN_FILE_HELP,
    )
    replica.add_argument(
        "--no-auth", action="store_true", help="no token either way (tests on loopback)"
    )
    replica.add_argument(
        "--metrics-port", type=int, metavar="N", help="also serve Prometheus metrics on this port"
    )
    replica.set_defaults(func=_store_replica)


def _add_reshard(store_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    resh = store_sub.add_parser(
        "reshard",
        help="lay the job's newest checkpoint out on another number of shards",
        description=(
            "Split the rows of the job's newest checkpoint (trainer.checkpoint.dir) among "
            "the shards named by --to, each written as a full checkpoint where that shard "
            "restores from (its --data-dir, or its --snapshots URL), and write the job "
            "manifest again naming them. Stop the job first; then start it with the new "
            "number of shards: it resumes where it stopped."
        ),
    )
    resh.add_argument("--config", type=Path, required=True, help="the job YAML")
    resh.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        required=True,
        metavar="DIR_OR_URL",
        help="every old shard's checkpoint folder (data dir or snapshot URL), in shard order",
    )
    resh.add_argument(
        "--to",
        dest="targets",
        nargs="+",
        required=True,
        metavar="DIR_OR_URL",
        help="every new shard's folder (data dir or snapshot URL), in the new shard order",
    )
    resh.add_argument(
        "--work-dir", type=Path, default=None, help="scratch space (default: the system's temp)"
    )
    resh.set_defaults(func=_store_reshard)


def _add_health(store_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    health = store_sub.add_parser(
        "health",
        help="exit 0 when a shard answers its Health call (a readiness probe)",
        description=(
            "Ask the shard at --address for its health; exit 0 when it answers SERVING, 1 "
            "with one line saying why otherwise (unreachable, refused token, not serving)."
        ),
    )
    health.add_argument("--address", required=True, metavar="HOST:PORT", help="the shard")
    health.add_argument(
        "--token-file",
        type=Path,
        help=TOKEN_FILE_HELP,
    )
    health.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)"
    )
    health.set_defaults(func=_store_health)
