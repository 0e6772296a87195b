"""``streamrec produce``: a file's records, or synthetic events, into a Kafka topic."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from deploy.cli.usage import UsageError
from deploy.status_line import StatusLine, progress_bar


def _parse_kafka_url(url: str) -> tuple[str, str]:
    """``kafka://HOST:PORT[,HOST:PORT]/TOPIC`` → (bootstrap servers, topic).

    >>> _parse_kafka_url("kafka://127.0.0.1:9092/events")
    ('127.0.0.1:9092', 'events')
    """
    import re

    from connectors.kafka_client import bootstrap_hosts

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

    from connectors.kafka_client import KafkaUnavailable, resolve_api_version
    from connectors.kafka_produce import FileRecords, ProduceError, produce
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

    if (args.from_file is None) == (args.events is None):
        msg = "give either --from FILE (records of a file) or --events N (synthetic)"
        raise UsageError(msg)
    if args.partition is not None and args.key_field is not None:
        msg = "--partition and --key-field exclude each other"
        raise UsageError(msg)
    if args.events is None and args.seed is not None:
        msg = "--seed is for the synthetic stream (--events), not --from"
        raise UsageError(msg)
    if args.from_file is None and (args.key_field is not None or args.format != "auto"):
        msg = "--key-field and --format are for --from FILE"
        raise UsageError(msg)
    if args.partition is not None and args.partition < 0:
        msg = f"--partition {args.partition}: expected 0 or more"
        raise UsageError(msg)
    if args.rate < 0:
        msg = f"--rate {args.rate}: expected 0 (as fast as possible) or more"
        raise UsageError(msg)
    servers, topic = _parse_kafka_url(args.to)
    if args.from_file is not None:
        return _produce_file(args, servers, topic)

    from connectors.kafka_client import resolve_api_version
    from connectors.kafka_produce import produce
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


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``produce`` to the ``streamrec`` parser."""
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
