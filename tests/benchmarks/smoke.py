"""Running a benchmark script at its tiniest sizes and checking the JSON it writes.

The benchmarks' full runs take minutes to hours and no test runs them; these
short runs make sure each script still runs end to end and reports every
figure, so that a change elsewhere cannot break one unnoticed. No figure is
compared with a speed: a loaded 2-core machine would make that flaky.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tests.support.processes import REPO_ROOT

MACHINE_KEYS = {"cpu_model", "cores", "cpu_flags", "torch", "numba", "numpy", "python"}


def run_benchmark(script: str, out: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``benchmarks/<script>`` with ``args`` and ``--json out``; the figures it wrote."""
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args, "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures: dict[str, Any] = json.loads(out.read_text())
    check_machine(figures)
    return figures


def check_machine(figures: Mapping[str, Any]) -> None:
    """The ``machine`` key ``write_json`` adds: the figures name the CPU they came from."""
    machine = figures["machine"]
    assert set(machine) >= MACHINE_KEYS, sorted(machine)
    assert isinstance(machine["cpu_model"], str)
    assert machine["cores"] >= 1


def assert_positive(figures: Mapping[str, Any], keys: Iterable[str]) -> None:
    """Each of ``keys`` is a finite number above zero (or a list of them)."""
    for key in keys:
        assert key in figures, (key, sorted(figures))
        values = figures[key] if isinstance(figures[key], list) else [figures[key]]
        assert values, key
        for v in values:
            assert isinstance(v, int | float), (key, v)
            assert not isinstance(v, bool), (key, v)
            assert math.isfinite(v), (key, v)
            assert v > 0, (key, v)
