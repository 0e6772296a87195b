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

The runner figures start a local Kafka 0.9 of their own, unless ``--bootstrap``
names a broker and ``--topic`` an empty topic of 2 partitions on it (the
benchmark writes its events there).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    median_rate,
    print_figures,
    store_shards,
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
    bootstrap: str, topic: str, repeats: int, api_version: str, chunk: int = CHUNK
) -> dict[str, float]:
    """``KafkaSource.read`` alone over the topic's chunks: raw and kafka-python, alternately."""
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
    for _ in range(max(1, repeats)):
        for reader, source in sources.items():
            t0 = time.perf_counter()
            n = sum(len(source.read(c)) for c in chunks)
            rates[reader].append(n / (time.perf_counter() - t0))
    for source in sources.values():
        source.close()
    raw = float(np.median(rates["raw"]))
    slow = float(np.median(rates["kafka-python"]))
    return {
        "kafka_read_events_per_s": raw,
        "kafka_read_kafka_python_events_per_s": slow,
        "kafka_read_raw_vs_kafka_python": raw / slow,
        "kafka_read_events": sum(len(c) for c in chunks),
    }


def bench_runner(
    events: int,
    tmp: Path,
    readers: tuple[str, ...] = ("raw",),
    read_repeats: int = 3,
    *,
    broker: tuple[str, str, str] | None = None,
    chunk: int = CHUNK,
) -> dict[str, float]:
    """Kafka (2 partitions) → 2 Dask workers → 2 store shards, end to end, per reader.

    ``broker`` is (bootstrap, an empty topic of 2 partitions, api_version); by
    default a local Kafka is started for the run.
    """
    from connectors.kafka import produce
    from deploy.local.kafka import LocalKafka
    from pipeline.prepare import StoreAddress

    with contextlib.ExitStack() as stack:
        if broker is None:
            kafka = LocalKafka.start(tmp / "kafka")
            stack.callback(kafka.stop)
            kafka.create_topic("bench-events", partitions=2)
            broker = (kafka.bootstrap, "bench-events", "0.9")
        bootstrap, topic, api_version = broker
        job = write_store_job(tmp / "job.yaml", synthetic_store_section(dim=16))
        token = write_token(tmp / "token")
        address = stack.enter_context(
            store_shards(job, [tmp / f"shard-{i}" for i in range(2)], token)
        )
        data = payloads(events + chunk, seed=7)  # + the first batch, not timed
        half = len(data) // 2
        produce(bootstrap, topic, data[:half], api_version=api_version, partition=0)
        produce(bootstrap, topic, data[half:], api_version=api_version, partition=1)
        del data
        results = bench_kafka_read(bootstrap, topic, read_repeats, api_version, chunk)
        store = StoreAddress(address, token=token.read_text())
        for reader in readers:
            source = _source(bootstrap, topic, f"bench-{reader}", reader, api_version, chunk)
            figures = _run(source, store, events, chunk)
            if reader != "raw":
                prefix = f"runner_{reader.replace('-', '_')}"
                figures = {k.replace("runner", prefix, 1): v for k, v in figures.items()}
            results.update(figures)
        return results


def _run(source: Any, store: Any, events: int, chunk: int = CHUNK) -> dict[str, float]:
    from distributed import Client, LocalCluster

    from pipeline.runner import StreamRunner

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc, direct_to_workers=True) as client,  # as the job's trainer fetches
    ):
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


def hybrid_rate(samples: int, log_every_s: float = 1.0) -> float:
    """The hybrid trainer's samples/s on this machine: benchmarks/e2e.py's hybrid run."""
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
    )
    return run.samples_per_s


def main(argv: list[str] | None = None) -> int:
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
        "--bootstrap", help="a Kafka broker to use (host:port) instead of starting one"
    )
    parser.add_argument("--topic", help="with --bootstrap: an empty topic of 2 partitions")
    parser.add_argument(
        "--api-version", default="0.9", help="with --bootstrap: the clients' api_version"
    )
    args = parser.parse_args(argv)
    if (args.bootstrap is None) != (args.topic is None):
        parser.error("--bootstrap and --topic go together")

    data = payloads(args.events)
    results: dict[str, float | int] = {"events": args.events, "repeats": args.repeats}
    results["decode_hash_events_per_s"] = median_rate(
        lambda _: decode_hash(data), args.events, args.repeats
    )
    results["pandas_baseline_events_per_s"] = median_rate(
        lambda _: pandas_baseline(data), args.events, max(1, args.repeats // 2)
    )
    results["decode_hash_vs_pandas"] = (
        results["decode_hash_events_per_s"] / results["pandas_baseline_events_per_s"]
    )
    if not args.skip_runner:
        with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
            readers = ("raw", "kafka-python") if args.compare_readers else ("raw",)
            broker = (
                None if args.bootstrap is None else (args.bootstrap, args.topic, args.api_version)
            )
            results.update(
                bench_runner(
                    args.runner_events,
                    Path(tmp),
                    readers,
                    args.repeats,
                    broker=broker,
                    chunk=args.chunk_records,
                )
            )
        if args.hybrid_samples:
            hybrid = hybrid_rate(args.hybrid_samples, args.log_every_s)
            results["hybrid_samples_per_s"] = hybrid
            results["runner_vs_hybrid"] = float(results["runner_events_per_s"]) / hybrid

    print_figures(results, lambda v: f"{v:,.2f}" if isinstance(v, float) else f"{v}")
    if args.json:
        write_json(args.json, results, announce=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
