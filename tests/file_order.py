"""Longest files first, so that two test processes finish together.

``make test`` runs the suite in two processes that each take whole files
(``--dist loadfile``). pytest-xdist hands files out in collection order (with
``--no-loadscope-reorder``; its own order puts the files with the most tests
first, which left the single-test benchmark smokes, a minute or more each, for
the end, run side by side while the other process had nothing left). Ordering
the files by the seconds they took in a recorded run, longest first, is the
classic longest-processing-time rule: what is left at the end is short.

``tests/file_seconds.json`` holds those seconds; a file it does not name counts
as the median. ``pytest --record-file-seconds tests/file_seconds.json`` writes
it anew from the run it ends (setup, call and teardown of every test, by file).

``c.py``, not recorded, counts as the median of 9 and 1 seconds:

>>> ids = ["a.py::x", "b.py::y", "a.py::z", "c.py::w"]
>>> [ids[i] for i in file_order(ids, {"b.py": 9.0, "a.py": 1.0})]
['b.py::y', 'c.py::w', 'a.py::x', 'a.py::z']
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    """The file part of a pytest node id."""
    return nodeid.split("::", 1)[0]


def file_order(nodeids: Sequence[str], seconds: Mapping[str, float]) -> list[int]:
    """The positions of ``nodeids`` in the order to run them: their files longest first.

    A file's tests stay together and in their order; files of equal seconds keep
    their collection order. A file ``seconds`` does not name counts as its median.
    """
    default = statistics.median(seconds.values()) if seconds else 0.0
    first: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first.setdefault(file_of(nodeid), i)

    def key(i: int) -> tuple[float, int]:
        f = file_of(nodeids[i])
        return (-seconds.get(f, default), first[f])

    return sorted(range(len(nodeids)), key=key)


def read_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The recorded seconds by file; empty when there is no record."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-seconds",
        metavar="PATH",
        default=None,
        help="write every test file's seconds in this run (longest first) to PATH as JSON",
    )
    parser.addoption(
        "--file-seconds",
        metavar="PATH",
        default=str(SECONDS_FILE),
        help="run the test files longest first by the seconds recorded in PATH",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-file-seconds")
    # Under xdist the controller sees every worker's reports: it alone records.
    if path is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileSecondsRecorder(Path(path)), "file-seconds-recorder")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = read_seconds(Path(config.getoption("--file-seconds")))
    order = file_order([item.nodeid for item in items], seconds)
    items[:] = [items[i] for i in order]


class FileSecondsRecorder:
    """Adds up every test report's seconds by file; writes them when the session ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        text = json.dumps({f: round(s, 2) for f, s in ranked}, indent=1)
        self.path.write_text(text + "\n")
