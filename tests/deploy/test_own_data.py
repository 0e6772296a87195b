"""The docs' worked example of "Your own data", run as written: its blocks are read from
docs/own-data.md.

A sample file of records (the page's Python block), the job YAML (its YAML
block) and the commands (its last shell block) run in a fresh folder with the
real `streamrec`: a local Kafka, a topic of two partitions, the file produced
into it, a job that ends by itself with every record learned and none
dead-lettered, and a report. Only the Kafka's state folder and port (a free
one, not 9092) differ from what a reader types.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.config import load_config
from deploy.local.kafka import free_port
from tests.support.processes import REPO_ROOT, STREAMREC
from trainer.checkpoint import CheckpointBook

pytestmark = pytest.mark.processes


def docs_section(page: str, title: str) -> str:
    """The part of a docs page under the heading ``## title``, up to the next ``##``."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_the_docs_walkthrough_trains_on_a_file_of_records(tmp_path: Path) -> None:
    section = docs_section("own-data.md", "A worked example, from a file to a trained model")
    make_sample = next(b for b in blocks(section, "sh") if "python3 - <<'PY'" in b)
    job_text = next(b for b in blocks(section, "yaml") if "run_dir: runs/own/run" in b)
    commands = next(b for b in blocks(section, "sh") if "streamrec kafka up" in b)

    # Another port than the documented 9092: a test elsewhere may hold that one now.
    port = str(free_port())
    job_text = job_text.replace("127.0.0.1:9092", f"127.0.0.1:{port}")
    commands = commands.replace("127.0.0.1:9092", f"127.0.0.1:{port}")
    env = {**os.environ, "STREAMREC_STATE_DIR": str(tmp_path / "state")}

    sample = subprocess.run(
        ["bash", "-c", make_sample.replace("python3 -", f"{sys.executable} -")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert sample.returncode == 0, sample.stderr
    lines = (tmp_path / "runs/own/clicks.jsonl").read_text().splitlines()
    assert len(lines) == 6000
    (tmp_path / "runs/own/job.yaml").write_text(job_text)
    job = load_config(tmp_path / "runs/own/job.yaml")  # the documented YAML is a valid job

    ran: list[subprocess.CompletedProcess[str]] = []
    try:
        for line in commands.strip().splitlines():
            argv = line.split("#")[0].split()
            assert argv[0] == "streamrec", line
            if argv[1:3] == ["kafka", "up"]:
                argv += ["--port", port]
            done = subprocess.run(
                [*STREAMREC, *argv[1:]],
                cwd=tmp_path,
                env={**env, "PYTHONPATH": str(REPO_ROOT)},
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            ran.append(done)
    finally:
        subprocess.run(
            [*STREAMREC, "kafka", "down"],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            timeout=120,
            check=False,
        )
    up, topic, produce, run, report = ran
    assert f"bootstrap_servers: 127.0.0.1:{port}" in up.stdout
    assert "2 partitions" in topic.stdout
    assert "sent 6,000 records" in produce.stdout
    assert "trained 6,000 samples" in run.stdout
    assert "stopped by max_events" in run.stdout
    assert "dead-lettered" not in run.stdout
    assert re.search(r"progressive logloss \d\.\d{4}", run.stdout)
    run_dir = tmp_path / job.run_dir
    final = CheckpointBook(run_dir / "checkpoints").latest()
    assert final is not None
    assert final.samples == 6000
    assert sum(final.positions.values()) == 6000
    assert all(p.stat().st_size == 0 for p in run_dir.glob("deadletter*.jsonl"))
    assert (run_dir / "report.html").stat().st_size > 0
    assert report.returncode == 0
    assert yaml.safe_load(job_text)["source"]["topics"] == ["clicks"]


def test_the_demo_hint_for_kafka_works_as_printed(tmp_path: Path) -> None:
    """The demo's "from Kafka" commands used to name port 9092 while the broker got another.

    They run here as printed, against examples/kafka.yaml, with 3,000 events
    instead of 200,000, on a free port instead of 9092.
    """
    from deploy.cli.train import demo_next_steps

    hint = next(
        line for line in demo_next_steps(Path("runs/demo")).splitlines() if "from Kafka" in line
    )
    port = str(free_port())  # not 9092: a test elsewhere may hold that one now
    env = {
        **os.environ,
        "STREAMREC_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(REPO_ROOT),
    }
    (tmp_path / "examples").mkdir()
    example = (REPO_ROOT / "examples" / "kafka.yaml").read_text()
    assert "bootstrap_servers: 127.0.0.1:9092" in example  # the address the hint names
    (tmp_path / "examples" / "kafka.yaml").write_text(example.replace("9092", port))
    outs = []
    try:
        for command in re.findall(r"`(streamrec [^`]+)`", hint):
            argv = command.replace("200000", "3000").replace("9092", port).split()[1:]
            if argv[:2] == ["kafka", "up"]:
                argv += ["--port", port]
            done = subprocess.run(
                [*STREAMREC, *argv],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
                check=False,
            )
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            outs.append(done.stdout)
    finally:
        subprocess.run(
            [*STREAMREC, "kafka", "down"], cwd=tmp_path, env=env, capture_output=True, timeout=120
        )
    assert len(outs) == 3
    assert "trained 3,000 samples" in outs[2]
