"""Pipeline throughput, measured side by side in one run.

    python benchmarks/pipeline.py --json bench-results/pipeline.json

- ``decode_hash_events_per_s``: one core, JSON lines of the synthetic
  Criteo-like stream (1 label, 13 dense, 26 sparse fields) → decoded, validated,
  hashed and deduplicated batch (``JsonLinesCodec.decode`` + ``build_batch``);
- ``pandas_baseline_events_per_s``: the same decode and hashing written the
  obvious way with pandas (``read_json(lines=True)``, a Python hash per value,
  ``factorize``), on the same payloads;
- ``kafka_read_events_per_s``: the read path alone: every chunk
  (``--chunk-records``, 20,000) of the runner's topic read by
  ``KafkaSource.read`` in one thread, no decoding, with the default raw reader;
  ``kafka_read_kafka_python_events_per_s`` the same with ``reader:
  kafka-python``, measured alternately in the same run;
- ``runner_events_per_s``: a Kafka topic (2 partitions) → ``StreamRunner`` with
  2 Dask worker processes → ``PreparedBatch`` with rows looked up in 2 store
  shard processes, end to end (wall time from the first batch to the last);
  with ``--compare-readers`` also ``runner_kafka_python_events_per_s``, the same
  runner reading with kafka-python;
- ``hybrid_samples_per_s``: the hybrid trainer of ``benchmarks/e2e.py`` (its
  default model, ``--hybrid-samples`` samples) run after the runner, and
  ``runner_vs_hybrid`` the ratio (the target: 3, so that the pipeline never
  limits a trainer).

Figures are medians over ``--repeats`` runs (the runner figures are one run each).

The read and runner figures are measured on each of ``--brokers``: Apache
Kafka 0.9.0.1 (``kafka09``) and Tansu, a broker of the modern protocol
(``modern``: record batches, Kafka 3.9's API versions). Each figure carries
its broker as a suffix (``runner_events_per_s_kafka09``,
``runner_events_per_s_modern``, ``kafka_read_events_per_s_modern``, ...);
the unsuffixed keys are the first broker's, ``runner_modern_vs_kafka09`` the
ratio, ``runner_vs_hybrid_<broker>`` each against the trainer. On the modern
broker the read path is also measured on topics compressed with each of
``--codecs`` (``kafka_read_events_per_s_modern_lz4``, ...). Each broker is
started for the run, unless ``--bootstrap``/``--topic`` (Kafka 0.9) or
``--modern-bootstrap``/``--modern-topic`` name one and an empty topic of 2
partitions on it (the benchmark writes its events there).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    median_rate,
    print_figures,
    shared_dask,
    store_shards,
    wait_all,
    write_json,
    write_store_job,
    write_token,
)

from connectors.codecs import make_codec
from connectors.synthetic import (
    SyntheticConfig,
    iter_json_lines,
    synthetic_feature_spec,
    synthetic_store_section,
)
from connectors.types import Chunk, RawChunk
from pipeline.batch import build_batch

SPEC = synthetic_feature_spec()
CHUNK = 20_000  # records a chunk (the runner's max_records)
BROKERS = ("kafka09", "modern")


def payloads(events: int, seed: int = 1) -> list[bytes]:
    return list(iter_json_lines(SyntheticConfig(seed=seed), events))


def decode_hash(data: list[bytes]) -> int:
    codec = make_codec("json")
    raw = RawChunk(
        chunk=Chunk("bench", "bench/0", 0, len(data)),
        positions=np.arange(len(data), dtype=np.int64),
        payloads=data,
    )
    table, bad = codec.decode(raw, SPEC)
    batch = build_batch(table, SPEC)
    return len(batch) + len(bad)


def pandas_baseline(data: list[bytes]) -> int:
    """What one would write first: pandas for parsing, a Python hash per value."""
    import io

    import pandas as pd

    df = pd.read_json(io.BytesIO(b"\n".join(data)), lines=True)
    labels = df[SPEC.labels].to_numpy(dtype=np.float32)
    dense = np.log1p(df[[d.name for d in SPEC.dense]].fillna(0).clip(lower=0)).to_numpy(np.float32)

    def h(field: str, value: Any) -> int:
        digest = hashlib.blake2b(f"{field}\x00{value}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    tables = {}
    for s in SPEC.sparse:
        ids = df[s.name].map(lambda v, f=s.name: h(f, v)).to_numpy(dtype=np.uint64)
        inverse, unique = pd.factorize(ids)
        tables[s.table] = (unique, inverse)
    return int(labels.shape[0] + dense.shape[0] * 0 + len(tables) * 0)


def _source(
    bootstrap: str, topic: str, group: str, reader: str, api_version: str, chunk: int
) -> Any:
    from connectors.kafka import KafkaSource, KafkaSourceConfig

    return KafkaSource(
        KafkaSourceConfig(
            bootstrap_servers=bootstrap,
            topics=[topic],
            # A broker shared with others may hold this benchmark's groups of another topic.
            group_id=f"{group}-{topic}",
            auto_offset_reset="earliest",
            api_version=api_version,
            max_records=chunk,
            reader=reader,  # type: ignore[arg-type]
        )
    )


def bench_kafka_read(
    bootstrap: str,
    topic: str,
    repeats: int,
    api_version: str,
    chunk: int = CHUNK,
    *,
    confluent: bool = False,
) -> dict[str, float]:
    """``KafkaSource.read`` alone over the topic's chunks: raw and kafka-python, alternately;
    and confluent-kafka's consumer (librdkafka) over the same chunks where it is installed
    (the ``peers`` extra) and ``confluent`` is set (a modern broker: librdkafka does not
    speak to 0.9 by default), a maintained client the job could use instead."""
    sources = {
        r: _source(bootstrap, topic, f"read-{r}", r, api_version, chunk)
        for r in ("raw", "kafka-python")
    }
    planner = sources["raw"]
    chunks = []
    for p in planner.partitions():
        position = 0
        while (planned := planner.plan(p, position, chunk)) is not None:
            chunks.append(planned)
            position = planned.end
    rates: dict[str, list[float]] = {r: [] for r in sources}
    confluent = confluent and importlib.util.find_spec("confluent_kafka") is not None
    if confluent:
        rates["confluent-kafka"] = []
    for _ in range(max(1, repeats)):
        for reader, source in sources.items():
            t0 = time.perf_counter()
            n = sum(len(source.read(c)) for c in chunks)
            rates[reader].append(n / (time.perf_counter() - t0))
        if confluent:
            t0 = time.perf_counter()
            n = _confluent_read(bootstrap, chunks)
            rates["confluent-kafka"].append(n / (time.perf_counter() - t0))
    for source in sources.values():
        source.close()
    raw = float(np.median(rates["raw"]))
    slow = float(np.median(rates["kafka-python"]))
    figures = {
        "kafka_read_events_per_s": raw,
        "kafka_read_kafka_python_events_per_s": slow,
        "kafka_read_raw_vs_kafka_python": raw / slow,
        "kafka_read_events": sum(len(c) for c in chunks),
    }
    if confluent:
        other = float(np.median(rates["confluent-kafka"]))
        figures["kafka_read_confluent_kafka_events_per_s"] = other
        figures["kafka_read_raw_vs_confluent_kafka"] = raw / other
    return figures


def _confluent_read(bootstrap: str, chunks: list[Any]) -> int:
    """confluent-kafka's consumer reading ``chunks`` as a worker reads them: assigned at a
    chunk's start, values kept as bytes until its end (librdkafka prefetches meanwhile)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench-confluent",
            "enable.auto.commit": False,
            "fetch.max.bytes": 16 << 20,
            "max.partition.fetch.bytes": 16 << 20,
        }
    )
    n = 0
    try:
        for chunk in chunks:
            topic, _, number = chunk.partition.rpartition("/")
            consumer.assign([TopicPartition(topic, int(number), chunk.start)])
            values: list[bytes] = []
            position = chunk.start
            deadline = time.monotonic() + 60
            while position < chunk.end:
                if time.monotonic() > deadline:
                    msg = f"confluent-kafka read nothing of {chunk.name} past {position} in 60 s"
                    raise RuntimeError(msg)
                # No more than the chunk still lacks: consume() returns once it has that
                # many or at the timeout, and asked for more than a partition's last chunk
                # holds it waited out the whole second, which the rate then counted.
                wanted = min(10_000, chunk.end - position)
                for message in consumer.consume(num_messages=wanted, timeout=1.0):
                    if message.error() is not None or message.offset() >= chunk.end:
                        continue
                    values.append(message.value() or b"")
                    position = message.offset() + 1
            n += len(values)
    finally:
        consumer.close()
    return n


Broker = tuple[str, str, str]  # bootstrap, an empty topic of 2 partitions, api_version


def _start_broker(kind: str, tmp: Path, stack: contextlib.ExitStack) -> Broker:
    """A local broker of ``kind`` for the run: Kafka 0.9 (``kafka09``) or Tansu (``modern``)."""
    if kind == "kafka09":
        from deploy.local.kafka import LocalKafka

        kafka = LocalKafka.start(tmp / "kafka")
        stack.callback(kafka.stop)
        kafka.create_topic("bench-events", partitions=2)
        return (kafka.bootstrap, "bench-events", "0.9")
    from deploy.local.tansu import API_VERSION, LocalTansu

    tansu = LocalTansu.start(tmp / "tansu")
    stack.callback(tansu.stop)
    version = ".".join(map(str, API_VERSION))
    return (tansu.bootstrap, _new_topic(tansu.bootstrap, "bench-events", version), version)


def _new_topic(bootstrap: str, name: str, api_version: str) -> str:
    """A topic of 2 partitions, ready (``streamrec kafka topic create``'s way)."""
    from deploy.local.kafka import make_topic

    version = tuple(int(v) for v in api_version.split("."))
    make_topic(bootstrap, name, 2, api_version=version)
    return name


def _fill(
    bootstrap: str,
    topic: str,
    data: list[bytes],
    api_version: str,
    compression: str | None,
    batch_kb: int | None = None,
) -> None:
    """Half of ``data`` into each of the topic's 2 partitions; ``batch_kb``: the
    producer's ``batch_size`` (kafka-python's default is 16 KB, as Kafka's is)."""
    from connectors.kafka_produce import produce

    options: dict[str, Any] = {"compression_type": compression} if compression else {}
    if batch_kb is not None:
        options.update(batch_size=batch_kb << 10, linger_ms=20, max_request_size=4 << 20)
    half = len(data) // 2
    for partition, part in enumerate((data[:half], data[half:])):
        produce(
            bootstrap,
            topic,
            part,
            api_version=api_version,
            partition=partition,
            client_options=options or None,
        )


@dataclass(frozen=True)
class Shared:
    """Store shards and a Dask cluster that every runner run (and the hybrid run) uses."""

    store: str  # grpc://... of the shards
    token: str
    scheduler: str


@contextlib.contextmanager
def store_of_two(tmp: Path) -> Iterator[tuple[str, str]]:
    """Two store shard processes of the synthetic tables: their address and token."""
    job = write_store_job(tmp / "job.yaml", synthetic_store_section(dim=16))
    token = write_token(tmp / "token")
    with store_shards(job, [tmp / f"shard-{i}" for i in range(2)], token) as address:
        yield address, token.read_text()


@contextlib.contextmanager
def shared_services(tmp: Path) -> Iterator[Shared]:
    """One store and one Dask cluster for every run, started side by side."""
    from deploy.local.shards import ShardProcess

    job = write_store_job(tmp / "job.yaml", synthetic_store_section(dim=16))
    token = write_token(tmp / "token")
    starting = [ShardProcess.spawn(job, tmp / f"shard-{i}", token_file=token) for i in range(2)]
    with contextlib.ExitStack() as stack:
        try:
            scheduler = stack.enter_context(shared_dask(tmp / "dask.log"))
        except BaseException:
            for one in starting:
                one.proc.kill()
                one.proc.wait()
            raise
        shards = wait_all(starting)
        for shard in shards:
            stack.callback(shard.kill)
        address = "grpc://" + ",".join(shard.address for shard in shards)
        yield Shared(address, token.read_text(), scheduler)


def bench_runner(
    events: int,
    tmp: Path,
    readers: tuple[str, ...] = ("raw",),
    read_repeats: int = 3,
    *,
    broker: Broker | None = None,
    kind: str = "kafka09",
    chunk: int = CHUNK,
    codecs: tuple[str, ...] = (),
    batch_kbs: tuple[int, ...] = (),
    shared: Shared | None = None,
) -> dict[str, float]:
    """Kafka (2 partitions) → 2 Dask workers → 2 store shards, end to end, per reader.

    ``broker`` is (bootstrap, an empty topic of 2 partitions, api_version); by
    default a local broker of ``kind`` is started for the run. ``codecs``: the
    read path alone also on a topic of the same events compressed with each.
    ``batch_kbs``: the read path and the raw runner also on a topic of the same
    events produced in record batches of that many KB (keys suffixed ``_b<KB>``).
    ``shared``: running shards and Dask cluster to use instead of starting them.
    """
    from pipeline.prepare import StoreAddress

    with contextlib.ExitStack() as stack:
        if broker is None:
            broker = _start_broker(kind, tmp, stack)
        bootstrap, topic, api_version = broker
        modern = kind == "modern"
        if shared is None:
            address, token = stack.enter_context(store_of_two(tmp))
        else:
            address, token = shared.store, shared.token
        scheduler = shared.scheduler if shared is not None else None
        data = payloads(events + chunk, seed=7)  # + the first batch, not timed
        _fill(bootstrap, topic, data, api_version, None)
        results = bench_kafka_read(
            bootstrap, topic, read_repeats, api_version, chunk, confluent=modern
        )
        for codec in codecs:
            packed = _new_topic(bootstrap, f"{topic}-{codec}", api_version)
            _fill(bootstrap, packed, data, api_version, codec)
            figures = bench_kafka_read(
                bootstrap, packed, read_repeats, api_version, chunk, confluent=modern
            )
            results.update({f"{k}_{codec}": v for k, v in figures.items()})
        batched = {}
        for kb in batch_kbs:
            batched[kb] = _new_topic(bootstrap, f"{topic}-b{kb}", api_version)
            _fill(bootstrap, batched[kb], data, api_version, None, kb)
            figures = bench_kafka_read(
                bootstrap, batched[kb], read_repeats, api_version, chunk, confluent=modern
            )
            results.update({f"{k}_b{kb}": v for k, v in figures.items()})
        del data
        store = StoreAddress(address, token=token)
        for reader in readers:
            source = _source(bootstrap, topic, f"bench-{reader}", reader, api_version, chunk)
            figures = _run(source, store, events, chunk, scheduler)
            if reader != "raw":
                prefix = f"runner_{reader.replace('-', '_')}"
                figures = {k.replace("runner", prefix, 1): v for k, v in figures.items()}
            results.update(figures)
        for kb, name in batched.items():
            source = _source(bootstrap, name, f"bench-b{kb}", "raw", api_version, chunk)
            figures = _run(source, store, events, chunk, scheduler)
            results.update({f"{k}_b{kb}": v for k, v in figures.items()})
        return results


def _run(
    source: Any, store: Any, events: int, chunk: int = CHUNK, scheduler: str | None = None
) -> dict[str, float]:
    """The runner over ``source``, on a local cluster of its own or ``scheduler``'s."""
    from distributed import Client, LocalCluster

    from pipeline.runner import StreamRunner

    with contextlib.ExitStack() as stack:
        cluster: Any = scheduler
        if cluster is None:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
                )
            )
        # As the job's trainer fetches: from the worker that made each batch.
        client = stack.enter_context(Client(cluster, direct_to_workers=True))
        runner = StreamRunner(
            client,
            source,
            SPEC,
            store,
            staleness=4,
            codec=make_codec("json"),
            max_records=chunk,
        )
        # Steady state: the clock starts when the first batch arrives, so worker
        # start-up (imports, loading cached numba kernels) is reported apart.
        t_start = time.perf_counter()
        seen = 0
        first_s = 0.0
        t0 = t_start
        for batch in runner:
            if not first_s:
                first_s = time.perf_counter() - t_start
                t0 = time.perf_counter()
                continue
            seen += len(batch) + batch.bad_records
            if seen >= events:
                break
        elapsed = time.perf_counter() - t0
        runner.close()
    source.close()
    return {
        "runner_events_per_s": seen / elapsed,
        "runner_events": seen,
        "runner_first_batch_s": first_s,
    }


def hybrid_rate(samples: int, log_every_s: float = 1.0, scheduler: str | None = None) -> float:
    """The hybrid trainer's samples/s on this machine: benchmarks/e2e.py's hybrid run
    (naming ``scheduler``'s Dask cluster instead of starting its own, where given)."""
    from e2e import HIDDEN, run_streamrec

    run = run_streamrec(
        "hybrid",
        samples,
        seed=0,
        window=100_000,
        latency_ms=0.0,
        ranks=1,
        torch_threads=None,
        hidden=HIDDEN,
        keep_dir=None,
        log_every_s=log_every_s,
        log=False,
        scheduler=scheduler,
    )
    return run.samples_per_s


def _with_broker(key: str, broker: str, codecs: list[str]) -> str:
    """``key`` named for ``broker``, before a codec's suffix.

    >>> _with_broker("kafka_read_events_per_s_lz4", "modern", ["lz4"])
    'kafka_read_events_per_s_modern_lz4'
    >>> _with_broker("runner_events_per_s", "kafka09", ["lz4"])
    'runner_events_per_s_kafka09'
    """
    for codec in codecs:
        if key.endswith(f"_{codec}"):
            return f"{key.removesuffix(f'_{codec}')}_{broker}_{codec}"
    return f"{key}_{broker}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--events", type=int, default=100_000, help="events per decode run")
    parser.add_argument("--runner-events", type=int, default=400_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--chunk-records",
        type=int,
        default=CHUNK,
        help=f"records a chunk of the Kafka read and the runner (default {CHUNK:,})",
    )
    parser.add_argument("--skip-runner", action="store_true")
    parser.add_argument(
        "--compare-readers",
        action="store_true",
        help="run the runner a second time with reader: kafka-python",
    )
    parser.add_argument(
        "--hybrid-samples",
        type=int,
        default=400_000,
        help="samples of the hybrid training run the runner is compared with (0: skip it)",
    )
    parser.add_argument(
        "--log-every-s",
        type=float,
        default=1.0,
        help="the hybrid run's report interval, its clock's ticks (default 1)",
    )
    parser.add_argument(
        "--brokers",
        nargs="+",
        choices=BROKERS,
        default=list(BROKERS),
        help="the brokers the read path and the runner are measured on: Apache Kafka "
        "0.9.0.1 (kafka09) and Tansu, a modern-protocol broker (modern); default both",
    )
    parser.add_argument(
        "--codecs",
        nargs="*",
        default=["lz4", "zstd"],
        help="on the modern broker, the read path also on topics compressed with these "
        "(default lz4 zstd)",
    )
    parser.add_argument(
        "--batch-kb",
        nargs="*",
        type=int,
        default=[256],
        help="on the modern broker, the read path and the runner also on topics produced in "
        "record batches of these sizes (the producer's batch_size; kafka-python's and "
        "Kafka's default is 16 KB; default 256)",
    )
    parser.add_argument(
        "--share-services",
        action="store_true",
        help="one pair of store shards and one Dask cluster for every runner run on every "
        "broker, the hybrid run naming the cluster too: the smoke test's (their start-ups "
        "take longer than its short runs); the rates are not the full run's, where each "
        "run starts its own and finds no rows made",
    )
    parser.add_argument(
        "--bootstrap", help="a Kafka 0.9 broker to use (host:port) instead of starting one"
    )
    parser.add_argument("--topic", help="with --bootstrap: an empty topic of 2 partitions")
    parser.add_argument(
        "--api-version", default="0.9", help="with --bootstrap: the clients' api_version"
    )
    parser.add_argument(
        "--modern-bootstrap", help="a modern-protocol broker to use instead of starting Tansu"
    )
    parser.add_argument(
        "--modern-topic", help="with --modern-bootstrap: an empty topic of 2 partitions"
    )
    parser.add_argument(
        "--modern-api-version", default="3.9", help="with --modern-bootstrap: its api_version"
    )
    args = parser.parse_args(argv)
    if (args.bootstrap is None) != (args.topic is None):
        parser.error("--bootstrap and --topic go together")
    if (args.modern_bootstrap is None) != (args.modern_topic is None):
        parser.error("--modern-bootstrap and --modern-topic go together")
    return args


def decode_phase(args: argparse.Namespace, results: dict[str, float | int]) -> None:
    """Decoding and hashing against the pandas baseline, on the same payloads."""
    data = payloads(args.events)
    results["decode_hash_events_per_s"] = median_rate(
        lambda _: decode_hash(data), args.events, args.repeats
    )
    results["pandas_baseline_events_per_s"] = median_rate(
        lambda _: pandas_baseline(data), args.events, max(1, args.repeats // 2)
    )
    results["decode_hash_vs_pandas"] = (
        results["decode_hash_events_per_s"] / results["pandas_baseline_events_per_s"]
    )


def runner_phase(args: argparse.Namespace, results: dict[str, float | int]) -> None:
    """The read path and the runner on every broker (the given ones, else started), then
    the hybrid run; with ``--share-services`` on one store and one Dask cluster."""
    readers = ("raw", "kafka-python") if args.compare_readers else ("raw",)
    given = {
        "kafka09": (args.bootstrap, args.topic, args.api_version) if args.bootstrap else None,
        "modern": (args.modern_bootstrap, args.modern_topic, args.modern_api_version)
        if args.modern_bootstrap
        else None,
    }
    with contextlib.ExitStack() as stack:
        shared = None
        if args.share_services:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-"))
            shared = stack.enter_context(shared_services(Path(tmp)))
        run_brokers(args, readers, given, results, shared)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, float | int] = {"events": args.events, "repeats": args.repeats}
    results["shared_services"] = args.share_services
    decode_phase(args, results)
    if not args.skip_runner:
        runner_phase(args, results)
    print_figures(results, lambda v: f"{v:,.2f}" if isinstance(v, float) else f"{v}")
    if args.json:
        write_json(args.json, results, announce=True)
    return 0


def run_brokers(
    args: argparse.Namespace,
    readers: tuple[str, ...],
    given: dict[str, Broker | None],
    results: dict[str, float | int],
    shared: Shared | None,
) -> None:
    """The read path and the runner on each broker, then the hybrid run; into ``results``."""
    for kind in args.brokers:
        with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
            figures = bench_runner(
                args.runner_events,
                Path(tmp),
                readers,
                args.repeats,
                broker=given[kind],
                kind=kind,
                chunk=args.chunk_records,
                codecs=tuple(args.codecs) if kind == "modern" else (),
                batch_kbs=tuple(args.batch_kb) if kind == "modern" else (),
                shared=shared,
            )
        suffixes = [*args.codecs, *(f"b{kb}" for kb in args.batch_kb)]
        results.update({_with_broker(k, kind, suffixes): v for k, v in figures.items()})
        if kind == args.brokers[0]:
            results.update(figures)  # the unsuffixed keys: the first broker's
    if "kafka09" in args.brokers and "modern" in args.brokers:
        on_09 = float(results["runner_events_per_s_kafka09"])
        results["runner_modern_vs_kafka09"] = float(results["runner_events_per_s_modern"]) / on_09
        for kb in args.batch_kb:
            results[f"runner_modern_b{kb}_vs_kafka09"] = (
                float(results[f"runner_events_per_s_modern_b{kb}"]) / on_09
            )
    if args.hybrid_samples:
        scheduler = shared.scheduler if shared is not None else None
        hybrid = hybrid_rate(args.hybrid_samples, args.log_every_s, scheduler)
        results["hybrid_samples_per_s"] = hybrid
        for kind in args.brokers:
            rate = float(results[f"runner_events_per_s_{kind}"])
            results[f"runner_vs_hybrid_{kind}"] = rate / hybrid
        results["runner_vs_hybrid"] = float(results["runner_events_per_s"]) / hybrid


if __name__ == "__main__":
    sys.exit(main())
