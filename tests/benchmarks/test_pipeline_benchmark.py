"""``benchmarks/pipeline.py`` at its tiniest, on the session's Kafka: every figure is there.

Decoding and hashing against the pandas baseline on 2,000 events, the Kafka
read path on a fresh topic of 2 partitions, the runner (2 Dask workers, 2
store shards) on chunks of 2,000 records, and the hybrid trainer it is
compared with on 16,384 samples.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.benchmarks.smoke import assert_positive, run_benchmark
from tests.kafka_fixtures import KafkaForTests


def test_decode_read_runner_and_hybrid_report_their_rates(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(partitions=2)
    args = ["--events", "2000", "--repeats", "1", "--runner-events", "4000"]
    args += ["--chunk-records", "2000"]
    args += ["--bootstrap", kafka.bootstrap, "--topic", topic]
    args += ["--api-version", ".".join(map(str, kafka.api_version))]
    # Reports (the hybrid run's clock ticks) every 0.2 s: a sub-second run is still timed.
    args += ["--hybrid-samples", "16384", "--log-every-s", "0.2"]
    figures = run_benchmark("pipeline.py", tmp_path / "pipeline.json", *args)
    keys = ["decode_hash_events_per_s", "pandas_baseline_events_per_s", "decode_hash_vs_pandas"]
    keys += ["kafka_read_events_per_s", "kafka_read_kafka_python_events_per_s"]
    keys += ["kafka_read_raw_vs_kafka_python", "runner_events_per_s", "runner_first_batch_s"]
    keys += ["hybrid_samples_per_s", "runner_vs_hybrid"]
    assert_positive(figures, keys)
    # Both partitions were read whole: the 4,000 timed events and the untimed first batch.
    assert figures["kafka_read_events"] == 4000 + 2000
    assert figures["runner_events"] >= 4000
