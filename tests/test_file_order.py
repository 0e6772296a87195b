"""The suite's file order: recorded seconds by file, then the longest files first.

Real pytest runs in subprocesses, two xdist workers for the record (the
controller adds up the workers' reports), on two files of a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

SHORT = "".join(f"def test_{n}():\n    pass\n\n\n" for n in ("one", "two", "three"))
LONG = "import time\n\n\ndef test_slow():\n    time.sleep(0.6)\n"


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.file_order", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, "--rootdir", str(folder), "-c", os.devnull, *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_recorded_run_puts_the_longest_file_first(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(SHORT)
    (tmp_path / "test_b.py").write_text(LONG)
    record = tmp_path / "seconds.json"
    run = pytest_in(tmp_path, "-n", "2", "--dist", "loadfile", "--record-file-seconds", str(record))
    assert run.returncode == 0, run.stdout + run.stderr
    seconds = json.loads(record.read_text())
    assert list(seconds) == ["test_b.py", "test_a.py"]
    assert seconds["test_b.py"] >= 0.6

    # Collection order follows the record: the one slow test, then the three quick ones.
    listed = pytest_in(tmp_path, "--collect-only", "-q", "--file-seconds", str(record))
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    quick = ["test_a.py::test_one", "test_a.py::test_two", "test_a.py::test_three"]
    assert ids == ["test_b.py::test_slow", *quick]
    # Without a record, collection order stands.
    plain = pytest_in(tmp_path, "--collect-only", "-q", "--file-seconds", str(tmp_path / "none"))
    ids = [line for line in plain.stdout.splitlines() if "::" in line]
    assert ids == [*quick, "test_b.py::test_slow"]
