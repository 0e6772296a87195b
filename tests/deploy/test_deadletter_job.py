"""`deadletter: kafka` with a bad record too large for the dead-letter topic, as users run it.

The 900 KB record's envelope (1.8 MB as JSON) is more than a Kafka 0.9 broker
takes (run on Tansu, the modern protocol, as well). The job used to end with
DeadLetterError and a traceback after having committed the record's offset:
neither learned nor dead-lettered. Now the topic gets the envelope cut to fit,
the run directory's spill file the whole record, and the job goes on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest

from connectors.deadletter import read_dead_letters
from connectors.kafka import KafkaSource, KafkaSourceConfig
from connectors.kafka_produce import produce
from connectors.synthetic import SyntheticConfig, iter_json_lines, synthetic_store_section
from tests.support.jobs import write_synthetic_job
from tests.support.kafka import KafkaForTests
from tests.support.processes import streamrec
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges

pytestmark = pytest.mark.processes


def test_an_oversize_bad_record_is_dead_lettered_cut_and_kept_whole(
    tmp_path: Path, broker: KafkaForTests
) -> None:
    kafka = broker
    topic = broker.new_topic(partitions=1)
    kafka.create_topic(f"{topic}.deadletter")
    good = list(iter_json_lines(SyntheticConfig(seed=12), 600))
    big = b"{" + bytes(range(128, 256)) * 7200  # 921,601 bytes: not JSON
    produce(kafka.bootstrap, topic, [*good[:300], big, *good[300:]], api_version=kafka.api_version)
    source = {
        "kind": "kafka",
        "bootstrap_servers": kafka.bootstrap,
        "topics": [topic],
        "group_id": f"{topic}-trainer",
        "api_version": ".".join(map(str, kafka.api_version)),
        "deadletter": "kafka",
    }
    job = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4),
        source=source,
        trainer={
            "batch_size": 200,
            "model": {"kind": "ffnn", "hidden": [16]},
            "torch_threads": 1,
            "checkpoint": {"every_steps": 2, "every_s": None},
        },
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )
    # --max-events ends the run once all 601 are learned; --max-time bounds it regardless.
    out = streamrec("run", str(job), "--max-events", "601", "--max-time", "150", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "trained 600 samples" in out.stdout

    run_dir = tmp_path / "run"
    [whole] = read_dead_letters(run_dir / "deadletter-rank0.jsonl")
    assert (whole.position, whole.raw) == (300, big)
    # Every offset learned once (the bad record's chunk included): nothing skipped or repeated.
    [spans] = learned_ranges(run_dir / "learned-rank0.log").values()
    assert spans[0][0] == 0
    assert spans[-1][1] == 601
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    assert final.positions == {f"{topic}/0": 601}
    assert final.samples == 600

    fields = set(KafkaSourceConfig.model_fields)
    reader = KafkaSource(KafkaSourceConfig(**{k: v for k, v in source.items() if k in fields}))
    try:
        end = reader.end_position(f"{topic}/0")
        assert reader.committed(f"{topic}/0") == end == 601  # past the bad record: it is durable
        letters = reader.read(reader.plan(f"{topic}.deadletter/0", 0, 10))  # type: ignore[arg-type]
    finally:
        reader.close()
    [envelope] = [json.loads(p) for p in letters.payloads or []]
    assert envelope["truncated"] is True
    assert envelope["raw_bytes"] == len(big)
    assert envelope["raw_sha256"] == hashlib.sha256(big).hexdigest()
    assert envelope["whole_record_in"] == str(run_dir / "deadletter-rank0.jsonl")
    assert big.startswith(envelope["raw"].encode("latin-1"))
    assert envelope["position"] == 300
