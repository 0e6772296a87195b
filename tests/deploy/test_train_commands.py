"""`streamrec run` from a real Kafka broker, `backfill` and `demo`, as users run them."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from connectors.kafka import KafkaSource, KafkaSourceConfig
from connectors.kafka_produce import produce
from connectors.synthetic import (
    SyntheticConfig,
    iter_json_lines,
    synthetic_store_section,
    write_parquet,
)
from deploy.cli.train import ProgressLine, demo_job
from embedding_store.location import Location
from tests.support.jobs import SMALL_TRAINER, write_small_job, write_synthetic_job
from tests.support.kafka import KafkaForTests
from tests.support.processes import REPO_ROOT, STREAMREC, streamrec
from tests.support.waits import wait_until
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges, ledger_entries
from trainer.publish import published


def two_rank_job(tmp: Path, source: dict[str, Any], batch_size: int) -> Path:
    """The synthetic job on 2 trainer ranks at ``batch_size``, reading ``source``."""
    return write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4),
        source=source,
        trainer={**SMALL_TRAINER, "ranks": 2, "batch_size": batch_size},
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )


def assert_learned_once(run_dir: Path, ends: dict[str, int]) -> None:
    """Both ranks' ledgers cover each partition's ``[0, end)`` exactly once."""
    covered = {p: np.zeros(n, dtype=np.int64) for p, n in ends.items()}
    for rank in (0, 1):
        for _, partition, lo, hi in ledger(run_dir, rank):
            covered[partition][lo:hi] += 1
    for partition, counts in covered.items():
        assert counts.size == 0 or counts.min() == counts.max() == 1, partition


def kafka_job_source(kafka: KafkaForTests, topic: str) -> dict[str, Any]:
    return {
        "kind": "kafka",
        "bootstrap_servers": kafka.bootstrap,
        "topics": [topic],
        "group_id": f"{topic}-trainer",
        "api_version": ".".join(map(str, kafka.api_version)),
        "deadletter": "file",
    }


def committed_offsets(source: dict[str, Any], partitions: Any) -> dict[str, int | None]:
    """What the job's consumer group has committed, asked of the broker."""
    fields = KafkaSourceConfig.model_fields
    src = KafkaSource(KafkaSourceConfig(**{k: v for k, v in source.items() if k in fields}))
    try:
        return {p: src.committed(p) for p in partitions}
    finally:
        src.close()


@pytest.mark.processes
def test_run_from_kafka_commits_what_it_learned_and_resumes_there(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Any
) -> None:
    topic = kafka_topic(partitions=2)
    lines = list(iter_json_lines(SyntheticConfig(seed=5), 4000))
    bad = [b"{not json", b'{"click": "yes"}', b""]
    produce(kafka.bootstrap, topic, lines[:2000] + bad, api_version=kafka.api_version, partition=0)
    produce(kafka.bootstrap, topic, lines[2000:], api_version=kafka.api_version, partition=1)
    source = kafka_job_source(kafka, topic)
    job = write_small_job(tmp_path, source)

    first = streamrec("run", str(job), "--max-events", "1500")
    assert first.returncode == 0, first.stdout + first.stderr
    book = CheckpointBook(tmp_path / "run" / "checkpoints")
    m1 = book.latest()
    assert m1 is not None
    assert 0 < m1.samples <= 1500
    assert sum(m1.positions.values()) == 1500  # records, the bad ones included
    # Offsets are committed to the group exactly as far as the checkpoint learned.
    assert committed_offsets(source, m1.positions) == m1.positions
    # Rank 0 published its dense weights for prediction servers as it trained.
    serving = Location.parse(tmp_path / "run" / "checkpoints" / "serving")
    first_published = published(serving)
    assert first_published, "no dense weights published"

    # A continuous job on a topic that stops growing: exactly what is left, 4003 - 1500.
    second = streamrec("run", str(job), "--max-events", "2503")
    assert second.returncode == 0, second.stdout + second.stderr
    m2 = book.latest()
    assert m2 is not None
    assert m2.positions == {f"{topic}/0": 2003, f"{topic}/1": 2000}
    assert m2.samples == 4000  # every good event learned once, across the two runs
    # Versions count on across the job's runs: a server never goes back.
    newest = published(serving)[-1]
    assert newest.version > first_published[-1].version
    assert newest.samples <= 4000
    dead = [
        json.loads(line)
        for f in (tmp_path / "run").glob("deadletter-rank*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(dead) == 3
    assert "trained" in second.stdout
    assert "resuming" not in first.stdout
    offsets = f"{topic}/0={m1.positions[f'{topic}/0']:,}, {topic}/1={m1.positions[f'{topic}/1']:,}"
    assert f"resuming from checkpoint step {m1.step} " in second.stdout, second.stdout
    assert f"offsets {offsets}" in second.stdout, second.stdout
    # The summary shows logloss and calibration next to the AUC.
    assert re.search(r"progressive logloss \d\.\d{4}, calibration \d+\.\d{3}", second.stdout)


@pytest.mark.processes
def test_two_ranks_train_their_own_partitions_and_resume_exactly_once(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Any
) -> None:
    """`trainer.ranks: 2` through `streamrec run`: uneven partitions, a stop, a resume."""
    topic = kafka_topic(partitions=3)
    lines = list(iter_json_lines(SyntheticConfig(seed=6), 3000))
    sizes = {0: 1500, 1: 700, 2: 800}  # rank 0 gets partitions 0 and 2, rank 1 gets 1
    start = 0
    for partition, n in sizes.items():
        extra = [b"{not json"] if partition == 0 else []
        produce(
            kafka.bootstrap,
            topic,
            lines[start : start + n] + extra,
            api_version=kafka.api_version,
            partition=partition,
        )
        start += n
    ends = {f"{topic}/{p}": n + (1 if p == 0 else 0) for p, n in sizes.items()}
    source = kafka_job_source(kafka, topic)
    job = two_rank_job(tmp_path, source, 250)
    run_dir = tmp_path / "run"
    book = CheckpointBook(run_dir / "checkpoints")

    first = streamrec("run", str(job), "--max-events", "1000")
    assert first.returncode == 0, first.stdout + first.stderr
    m1 = book.latest()
    assert m1 is not None
    assert 0 < m1.samples <= 1000
    # The summary counts both ranks' samples (it once counted rank 0's only).
    assert f"trained {m1.samples:,} samples in " in first.stdout, first.stdout
    ledger_lines = {r: len(ledger(run_dir, r)) for r in (0, 1)}
    assert all(ledger_lines.values()), "both ranks learned in the first run"

    # Uneven partitions (rank 0 holds 2,301 events, rank 1 700): --max-events of
    # what is left ends the job by itself, each rank's share moved to where the
    # records are.
    left = sum(ends.values()) - sum(hi - lo for r in (0, 1) for _, _, lo, hi in ledger(run_dir, r))
    second = streamrec("run", str(job), "--max-events", str(left), timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "stopped by max_events" in out, out
    m2 = book.latest()
    assert m2 is not None
    assert m2.positions == ends
    assert m2.samples == 3000
    assert committed_offsets(source, ends) == ends

    # Each rank read only its own partitions, and every offset was learned once
    # over the two runs (both ended with a checkpoint, so every ledger line counts).
    owned = {0: {f"{topic}/0", f"{topic}/2"}, 1: {f"{topic}/1"}}
    covered = {p: np.zeros(n, dtype=np.int64) for p, n in ends.items()}
    for rank in (0, 1):
        for _, partition, lo, hi in ledger(run_dir, rank):
            assert partition in owned[rank]
            covered[partition][lo:hi] += 1
    for partition, counts in covered.items():
        assert counts.min() == counts.max() == 1, partition

    # The dense allreduce keeps both ranks' copies of the model equal.
    views = book.load_dense(m2)["ranks"]
    assert len(views) == 2
    for name, weight in views[0]["model"].items():
        assert torch.equal(weight, views[1]["model"][name]), name
    assert (run_dir / "metrics-rank1.jsonl").stat().st_size > 0


@pytest.mark.processes
@pytest.mark.parametrize(
    ("sizes", "batch"),
    [({0: 1000, 1: 966}, 64), ({0: 1966, 1: 0}, 100)],
    ids=["unequal partitions, partial batches", "a rank with an empty partition"],
)
def test_two_ranks_with_max_events_learn_every_event_once_and_end(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Any, sizes: dict[int, int], batch: int
) -> None:
    """--max-events over 2 ranks whose partitions hold unequal counts (or none): the
    job ends by itself with every event learned once, whatever the batch size."""
    topic = kafka_topic(partitions=2)
    lines = list(iter_json_lines(SyntheticConfig(seed=9), sum(sizes.values())))
    start = 0
    for partition, n in sizes.items():
        if n:
            produce(kafka.bootstrap, topic, lines[start : start + n],
                    api_version=kafka.api_version, partition=partition)  # fmt: skip
        start += n
    ends = {f"{topic}/{p}": n for p, n in sizes.items()}
    source = kafka_job_source(kafka, topic)
    job = two_rank_job(tmp_path, source, batch)
    run_dir = tmp_path / "run"
    total = sum(sizes.values())
    # Before shares moved, this run waited for ever on the rank short of its share.
    result = streamrec("run", str(job), "--max-events", str(total), timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "stopped by max_events" in out, out
    assert f"trained {total:,} samples in " in out, out
    manifest = CheckpointBook(run_dir / "checkpoints").latest()
    assert manifest is not None
    assert manifest.samples == total
    assert {p: n for p, n in manifest.positions.items() if n} == {
        p: n for p, n in ends.items() if n
    }
    assert committed_offsets(source, {p: n for p, n in ends.items() if n}) == {
        p: n for p, n in ends.items() if n
    }
    assert_learned_once(run_dir, ends)
    # Each rank's last report counts every rank's samples beside its own.
    for rank in (0, 1):
        *_, last = (run_dir / f"metrics-rank{rank}.jsonl").read_text().splitlines()
        report = json.loads(last)
        assert (report["ranks"], report["job_samples"]) == (2, total), report
        assert report["samples"] == sum(hi - lo for _, _, lo, hi in ledger(run_dir, rank))
        # The progressive figures over every rank's predictions, beside the rank's own.
        everyone = report["job_metrics"]
        assert (everyone["samples"], everyone["window_samples"]) == (total, total), everyone
        assert 0 < everyone["auc"] < 1
    assert "progressive AUC " in out
    assert "(every rank's predictions" in out, out


@pytest.mark.processes
def test_a_quiet_partition_holds_no_rank_up_and_max_time_ends_two_ranks(
    tmp_path: Path, kafka: KafkaForTests, kafka_topic: Any
) -> None:
    """2 ranks, batch 64. Partition 1 stays quiet while partition 0's 1,000 events are
    all learned (a quiet rank takes part in each step without a batch), then gets 966
    (partial last batches on both): --max-events 1966 ends the job with each learned
    once. A second run with --max-time, while both partitions flow, ends at its time
    with what it learned checkpointed and committed, each event once."""
    topic = kafka_topic(partitions=2)
    lines = list(iter_json_lines(SyntheticConfig(seed=5), 2566))
    produce(kafka.bootstrap, topic, lines[:1000], api_version=kafka.api_version, partition=0)
    ends = {f"{topic}/0": 1000, f"{topic}/1": 966}
    source = kafka_job_source(kafka, topic)
    job = two_rank_job(tmp_path, source, 64)
    run_dir = tmp_path / "run"
    ledgers = [run_dir / f"learned-rank{r}.log" for r in (0, 1)]

    def learned(partition: str) -> int:
        ranges = learned_ranges(*(p for p in ledgers if p.exists())).get(partition, [])
        return sum(hi - lo for lo, hi in ranges)

    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*STREAMREC, "run", str(job), "--max-events", "1966"],
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: learned(f"{topic}/0") == 1000, f"{topic}/0 learned", timeout_s=240,
                   interval_s=0.1, procs=[proc], details=log.read_text)  # fmt: skip
        assert learned(f"{topic}/1") == 0
        produce(kafka.bootstrap, topic, lines[1000:1966], api_version=kafka.api_version,
                partition=1)  # fmt: skip
        assert proc.wait(240) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped by max_events" in text, text
    book = CheckpointBook(run_dir / "checkpoints")
    manifest = book.latest()
    assert manifest is not None
    assert (manifest.samples, manifest.positions) == (1966, ends), manifest
    assert committed_offsets(source, ends) == ends
    assert_learned_once(run_dir, ends)

    # --max-time while both partitions flow: whatever it learned, each event once.
    produce(kafka.bootstrap, topic, lines[1966:2266], api_version=kafka.api_version,
            partition=0)  # fmt: skip
    produce(kafka.bootstrap, topic, lines[2266:], api_version=kafka.api_version, partition=1)
    second = streamrec("run", str(job), "--max-time", "10", timeout=240)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "stopped by max_time" in second.stdout + second.stderr
    after = book.latest()
    assert after is not None
    assert all(ends[p] <= n <= ends[p] + 300 for p, n in after.positions.items()), after
    assert committed_offsets(source, after.positions) == after.positions
    assert_learned_once(run_dir, after.positions)
    assert after.samples == sum(after.positions.values())


@pytest.mark.processes
@pytest.mark.parametrize(
    ("sizes", "batch"),
    [((1000, 966), 64), ((1966,), 100)],
    ids=["unequal files, partial batches", "one file: a rank with nothing"],
)
def test_a_two_rank_backfill_ends_with_every_row_learned_once(
    tmp_path: Path, sizes: tuple[int, ...], batch: int
) -> None:
    """The end of a Parquet backfill over 2 ranks whose files hold unequal counts (or
    one rank none): the job ends by itself, every row learned once."""
    files = [
        write_parquet(tmp_path / f"part-{i}.parquet", SyntheticConfig(seed=4 + i), n, 250)
        for i, n in enumerate(sizes)
    ]
    job = two_rank_job(tmp_path, {"kind": "parquet", "paths": [str(f) for f in files]}, batch)
    run_dir = tmp_path / "run"
    total = sum(sizes)
    result = streamrec("backfill", str(job), timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"trained {total:,} samples in " in out, out
    manifest = CheckpointBook(run_dir / "checkpoints").latest()
    assert manifest is not None
    assert manifest.samples == total
    assert manifest.positions == {f.name: n for f, n in zip(files, sizes, strict=True)}
    assert_learned_once(run_dir, {f.name: n for f, n in zip(files, sizes, strict=True)})


def ledger(run_dir: Path, rank: int) -> list[tuple[int, str, int, int]]:
    path = run_dir / f"learned-rank{rank}.log"
    return ledger_entries(path) if path.exists() else []


@pytest.mark.processes
def test_backfill_shows_a_progress_bar_and_resumes(tmp_path: Path) -> None:
    data = write_parquet(tmp_path / "history.parquet", SyntheticConfig(seed=2), 3000, 500)
    job = write_small_job(tmp_path, {"kind": "parquet", "paths": ["unused.parquet"]})
    out = streamrec("backfill", str(job), "--from", str(data), "--max-events", "1000")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "%  step" in out.stdout  # the progress bar
    m1 = CheckpointBook(tmp_path / "run" / "checkpoints").latest()
    assert m1 is not None
    assert m1.samples == 1000
    out = streamrec("backfill", str(job), "--from", str(data))
    assert out.returncode == 0, out.stdout + out.stderr
    m2 = CheckpointBook(tmp_path / "run" / "checkpoints").latest()
    assert m2 is not None
    assert m2.samples == 3000
    assert "100%" in out.stdout


@pytest.mark.processes
def test_backfill_names_a_missing_file(tmp_path: Path) -> None:
    job = write_small_job(tmp_path, {"kind": "parquet", "paths": ["x.parquet"]})
    out = streamrec("backfill", str(job), "--from", str(tmp_path / "nope.parquet"))
    assert out.returncode == 2
    assert "nope.parquet" in out.stderr


@pytest.mark.processes
def test_run_rejects_a_misspelled_key_naming_it(tmp_path: Path) -> None:
    job = write_small_job(tmp_path, {"kind": "synthetic", "events": 10})
    raw = yaml.safe_load(job.read_text())
    raw["trainer"]["stalenes"] = 3
    job.write_text(yaml.safe_dump(raw))
    out = streamrec("run", str(job))
    assert out.returncode == 2
    assert "trainer.stalenes: unknown key (did you mean `staleness`?)" in out.stderr


@pytest.mark.processes
def test_a_misspelled_section_is_named_not_printed(tmp_path: Path) -> None:
    """A misspelled top-level section used to print the whole section as a Python dict."""
    job = write_small_job(tmp_path, {"kind": "synthetic", "events": 10})
    raw = yaml.safe_load(job.read_text())
    raw["featurs"] = raw.pop("features")
    job.write_text(yaml.safe_dump(raw))
    out = streamrec("run", str(job))
    assert out.returncode != 0
    assert "featurs: unknown key (did you mean `features`?)" in out.stderr
    assert "'labels'" not in out.stderr, out.stderr  # the section's content is not dumped


@pytest.mark.processes
def test_demo_trains_and_says_what_to_run_next(tmp_path: Path) -> None:
    out = streamrec("demo", "--events", "20000", "--run-dir", str(tmp_path / "demo"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Dask dashboard: http://" in out.stdout
    assert "trained 20,000 samples" in out.stdout
    assert "best achievable" in out.stdout
    assert "next:" in out.stdout


def test_progress_line_shows_the_bar_auc_and_best() -> None:
    from trainer.metrics import MetricsSnapshot

    class P:
        step, samples, samples_per_s, loss, staleness, pushes_queued = 5, 500, 100.0, 0.5, 4, 1
        samples_total = 500
        metrics = MetricsSnapshot(
            samples=500, window_samples=500, auc=0.7, logloss=0.5, calibration=1.0, task_auc=[0.7]
        )

    text = ProgressLine(sys.stdout, best_auc=0.8, total=1000).text(P())
    assert "[##########          ]  50%" in text
    assert "AUC 0.7000" in text
    assert "(best 0.8000)" in text

    class TwoRanks(P):  # rank 0's report of a job of 2 ranks: the line counts both
        ranks, job_samples, job_samples_per_s, job_samples_total = 2, 900, 180.0, 900

    text = ProgressLine(sys.stdout, total=1000).text(TwoRanks())
    assert "[##################  ]  90%" in text
    assert "       900 samples (2 ranks)       180/s" in text


@pytest.mark.parametrize("events", [1000, 1001])
def test_demo_job_splits_events_over_partitions(events: int) -> None:
    job = demo_job(Path("x"), events=events, partitions=2)
    assert job.source is not None
    assert job.source.kind == "synthetic"
    assert job.source.events * 2 >= events  # type: ignore[union-attr]


@pytest.mark.processes
def test_backfill_trains_at_the_batch_size_and_resumes_inside_a_row_group(
    tmp_path: Path,
) -> None:
    """Row groups of 1000 rows, `batch_size: 300`: steps of at most 300 samples.

    A backfill used to make one step of each whole row group, and could resume
    only at a row-group boundary.
    """
    data = write_parquet(tmp_path / "history.parquet", SyntheticConfig(seed=8), 2500, 1000)
    job = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4),
        source={"kind": "parquet", "paths": [str(data)]},
        trainer={**SMALL_TRAINER, "batch_size": 300},
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )
    first = streamrec("backfill", str(job), "--max-events", "1100")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "trained 1,100 samples" in first.stdout
    book = CheckpointBook(tmp_path / "run" / "checkpoints")
    m1 = book.latest()
    assert m1 is not None
    assert m1.positions == {"history.parquet": 1100}  # inside the second row group
    second = streamrec("backfill", str(job))
    assert second.returncode == 0, second.stdout + second.stderr
    chunks = ledger(tmp_path / "run", 0)
    spans = sorted((lo, hi) for _, _, lo, hi in chunks)
    assert all(hi - lo <= 300 for lo, hi in spans), spans
    assert spans[0][0] == 0
    assert spans[-1][1] == 2500
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans  # each row once
    assert len(spans) == 9  # 4 steps to 1100 (the last one cut at the budget), 5 after
    m2 = book.latest()
    assert m2 is not None
    assert m2.samples == 2500
