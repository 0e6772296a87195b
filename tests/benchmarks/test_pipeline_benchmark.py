"""``benchmarks/pipeline.py`` at its tiniest, on the session's two brokers: every figure
is there.

Decoding and hashing against the pandas baseline on 2,000 events, the Kafka
read path on a fresh topic of 2 partitions of Kafka 0.9 and of Tansu (and of
Tansu with lz4), the runner (2 Dask workers, 2 store shards) on chunks of
1,000 records on each, and the hybrid trainer it is compared with on 16,384
samples. Every runner run uses one pair of shards and one Dask cluster, which
the hybrid job names too: their start-ups took most of the test's time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark
from tests.support.kafka import KafkaForTests

pytestmark = pytest.mark.processes


def test_decode_read_runner_and_hybrid_report_their_rates(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Callable[..., str], tansu: KafkaForTests
) -> None:
    topic = kafka_topic(partitions=2)
    args = ["--events", "2000", "--repeats", "1", "--runner-events", "2000"]
    args += ["--chunk-records", "1000", "--codecs", "lz4", "--batch-kb", "64"]
    args += ["--bootstrap", kafka.bootstrap, "--topic", topic]
    args += ["--api-version", ".".join(map(str, kafka.api_version))]
    args += ["--modern-bootstrap", tansu.bootstrap, "--modern-topic", tansu.new_topic(2)]
    # Reports (the hybrid run's clock ticks) every 0.2 s: a sub-second run is still timed.
    args += ["--hybrid-samples", "16384", "--log-every-s", "0.2", "--share-services"]
    figures = run_benchmark("pipeline.py", tmp_path / "pipeline.json", *args)
    keys = ["decode_hash_events_per_s", "pandas_baseline_events_per_s", "decode_hash_vs_pandas"]
    keys += ["kafka_read_events_per_s", "kafka_read_kafka_python_events_per_s"]
    keys += ["kafka_read_raw_vs_kafka_python", "runner_events_per_s", "runner_first_batch_s"]
    keys += ["hybrid_samples_per_s", "runner_vs_hybrid", "runner_modern_vs_kafka09"]
    for broker in ("kafka09", "modern"):
        keys += [f"runner_events_per_s_{broker}", f"kafka_read_events_per_s_{broker}"]
        keys += [f"runner_vs_hybrid_{broker}"]
    keys += [
        "kafka_read_events_per_s_modern_lz4",
        "kafka_read_kafka_python_events_per_s_modern_lz4",
        "kafka_read_events_per_s_modern_b64",
        "runner_events_per_s_modern_b64",
        "runner_modern_b64_vs_kafka09",
        # confluent-kafka (the peers extra) read the same chunks of the modern broker.
        "kafka_read_confluent_kafka_events_per_s_modern",
        "kafka_read_confluent_kafka_events_per_s_modern_b64",
    ]
    assert_positive(figures, keys)
    assert figures["kafka_read_events_modern"] == figures["kafka_read_events_modern_lz4"] == 3000
    # Both partitions were read whole: the 2,000 timed events and the untimed first batch.
    assert figures["kafka_read_events"] == 2000 + 1000
    assert figures["runner_events"] >= 2000
