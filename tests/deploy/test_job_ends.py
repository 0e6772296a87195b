"""A job ends when it says it will: `--max-events`, `--max-time` and Ctrl-C in every state.

Each test runs the real `streamrec run` (store shard processes, a Dask
LocalCluster, a real Kafka broker or none at all) and checks how it ended:
the exit code, the stop reason in the summary and in the metrics file, and
what was learned.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.synthetic import synthetic_store_section
from tests.support.jobs import wait_for_checkpoint, write_kafka_job, write_synthetic_job
from tests.support.kafka import KafkaForTests, produce_in_blocks
from tests.support.ports import held_port
from tests.support.processes import REPO_ROOT, STREAMREC, start_job, streamrec
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges

pytestmark = pytest.mark.processes


def job_api_version(broker: KafkaForTests) -> str:
    """The job's ``api_version`` for ``broker``: "auto", except on Kafka 0.9, which "auto"
    takes for what it is only after 5 s of silence, once per source object of the job
    (about 5 to 10 s of each run). The version is known here; "auto" on 0.9 is covered
    by the examples' jobs (tests/deploy/test_own_data.py) and the source's own tests."""
    if broker.api_version >= (0, 11):
        return "auto"
    return ".".join(map(str, broker.api_version))


def last_report(run_dir: Path) -> dict[str, Any]:
    lines = (run_dir / "metrics-rank0.jsonl").read_text().splitlines()
    return dict(json.loads(lines[-1]))


@pytest.mark.parametrize(
    ("mode", "broker"),
    # Each mode and each broker once: the ending is the source's, on either broker.
    [("sync", "kafka-0.9"), ("hybrid", "tansu")],
    indirect=["broker"],
)
def test_max_events_equal_to_the_topic_ends_by_itself(
    tmp_path: Path, broker: KafkaForTests, mode: str
) -> None:
    """The whole topic is N records and `--max-events N`: N learned, exit 0, no Ctrl-C.

    It used to learn all N and then wait for more forever (the stream is continuous);
    on Tansu, to stop short of the last batch's records and wait for them.
    """
    topic = broker.new_topic(partitions=2)
    produce_in_blocks(broker, topic, 2050, 100)  # 1050 / 1000: the last chunk is short
    job = write_kafka_job(
        tmp_path, broker.bootstrap, topic, api_version=job_api_version(broker), mode=mode
    )
    out = streamrec("run", str(job), "--max-events", "2050", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trained 2,050 samples" in out.stdout
    assert "stopped by max_events" in out.stdout
    run_dir = tmp_path / "run"
    assert last_report(run_dir)["stopped_by"] == "max_events"
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    assert final.samples == 2050
    assert final.positions == {f"{topic}/0": 1050, f"{topic}/1": 1000}


def test_max_events_cuts_a_chunk_at_the_budget_and_the_next_run_goes_on(
    tmp_path: Path, kafka: KafkaForTests
) -> None:
    """`--max-events 777` on a longer topic learns exactly 777; the next run resumes there.

    On Kafka 0.9 only: the tail of a Tansu topic is the test above's, and CI's time is
    better spent there.
    """
    topic = kafka.new_topic(partitions=2)
    produce_in_blocks(kafka, topic, 1600, 100)
    job = write_kafka_job(tmp_path, kafka.bootstrap, topic, api_version=job_api_version(kafka))
    first = streamrec("run", str(job), "--max-events", "777", timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "trained 777 samples" in first.stdout
    assert "stopped by max_events" in first.stdout
    second = streamrec("run", str(job), "--max-events", "823", timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "trained 823 samples" in second.stdout
    run_dir = tmp_path / "run"
    ranges = learned_ranges(run_dir / "learned-rank0.log")
    for partition in (f"{topic}/0", f"{topic}/1"):
        spans = ranges[partition]
        assert spans[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans
        assert spans[-1][1] == 800  # every offset once, no gap, no overlap


@pytest.fixture
def no_broker_port() -> Iterator[int]:
    """A port nothing listens on, held for the test: a socket bound to it but not
    listening refuses connections, and no other process (the job's own Dask scheduler
    or a worker, under a loaded suite) can take it meanwhile and be dialled as Kafka."""
    with held_port(listen=False) as port:
        yield port


def no_broker_job(tmp: Path, port: int) -> Path:
    # "auto" must detect the version, so it dials at once.
    return write_kafka_job(tmp, f"127.0.0.1:{port}", "events")


def test_max_time_ends_a_job_whose_broker_is_not_there(tmp_path: Path, no_broker_port: int) -> None:
    """Ends soon after the deadline with one line naming the address, non-zero, no traceback.

    It used to retry for 300 s (retry_timeout_s) and then end in a traceback.
    """
    job = no_broker_job(tmp_path, no_broker_port)
    # 10 s: the deadline passes while the job waits for the broker. 0.1 s: it passes
    # while the job starts (as 10 s did on a loaded machine), before any batch was
    # asked for; the source is still asked once, and says the broker is not there.
    for max_time in ("10", "0.1"):
        out = streamrec("run", str(job), "--max-time", max_time, timeout=120)
        assert out.returncode == 1, max_time + out.stdout + out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("streamrec: "), out.stderr
        assert "accepts connections" in last
        assert "127.0.0.1:" in last


def test_ctrl_c_ends_a_job_waiting_for_a_broker(tmp_path: Path, no_broker_port: int) -> None:
    job = no_broker_job(tmp_path, no_broker_port)
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(job)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Until the job is waiting for the broker (it says so on stderr); it used to
        # ignore Ctrl-C for minutes then (the communicate timeout below).
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "accepts connections" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen) + err
    assert proc.returncode == 1, text
    assert "Traceback" not in text, text
    assert "because the job is stopping" in err, text


def test_ctrl_c_in_a_terminal_stops_the_shards_after_the_last_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C reaches the job's whole process group, as a terminal sends it.

    The job's shards used to get it too: each stopped on its own (in the middle
    of the job's last checkpoint), the supervisor took that for a crash and
    started it again, and the extra checkpoints let the shard's garbage
    collection delete the one the job's manifest names, so the next run could
    not restore. Now the job stops its shards itself, after its last checkpoint.
    """
    job = write_synthetic_job(
        tmp_path,
        store={**synthetic_store_section(dim=4), "keep_full_checkpoints": 1},
        source={"kind": "synthetic", "seed": 3, "partitions": 2, "events": 1_000_000},
        trainer={
            "batch_size": 200,
            "model": {"kind": "ffnn", "hidden": [16]},
            "torch_threads": 1,
            "checkpoint": {"every_steps": 5, "every_s": None},
        },
        cluster={"workers": 1, "store_shards": 2, "dashboard_address": ":0"},
    )
    run_dir = tmp_path / "run"
    proc = start_job(job)  # its own process group, as a shell gives a command
    try:
        wait_for_checkpoint(run_dir, 5, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "stopped by signal" in out
    # The Dask workers got it too; they used to die of it, each with a traceback.
    assert "Traceback" not in out, out[-4000:]
    for log in sorted((run_dir / "store").glob("shard-*.log")):
        assert log.read_text().count("serving") == 1, f"{log.name} was started again"
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    again = streamrec("run", str(job), "--max-events", "400", timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "trained 400 samples" in again.stdout
