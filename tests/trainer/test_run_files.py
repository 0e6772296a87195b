"""A rank's metrics lines and ledger rotated by size: bounded, and read whole."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from trainer.ledger import Ledger, learned_ranges
from trainer.run_files import RotatingLines, parts_of, read_lines


def test_keep_bounds_a_ledger_and_the_newest_lines_stay(tmp_path: Path) -> None:
    path = tmp_path / "learned-rank0.log"
    with Ledger(path, max_bytes=100, keep=2) as ledger:
        for step in range(1, 51):
            ledger.learned(step, "t/0", (step - 1) * 10, step * 10)
    assert [p.name for p in parts_of(path)] == [f"{path.name}.2", f"{path.name}.1", path.name]
    assert all(p.stat().st_size <= 100 for p in parts_of(path))
    spans = learned_ranges(path)["t/0"]
    assert spans[-1] == (490, 500)
    assert all(b[0] == a[1] for a, b in itertools.pairwise(spans)), "a kept line was lost"


def test_a_rollback_in_a_newer_part_voids_chunks_in_older_ones(tmp_path: Path) -> None:
    path = tmp_path / "learned-rank0.log"
    with Ledger(path, max_bytes=60, keep=10) as ledger:
        for step in range(1, 6):
            ledger.learned(step, "t/0", (step - 1) * 10, step * 10)
        ledger.rollback(2)
        for step in range(3, 6):
            ledger.learned(step, "t/0", (step - 1) * 10, step * 10)
    assert len(parts_of(path)) > 2
    assert learned_ranges(path) == {"t/0": [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]}


def test_a_reopened_file_counts_what_it_holds(tmp_path: Path) -> None:
    """A restarted rank appends to its last part and rotates it when that part is full."""
    path = tmp_path / "metrics-rank0.jsonl"
    with RotatingLines(path, max_bytes=10, keep=1) as out:
        out.write("12345678\n")
    with RotatingLines(path, max_bytes=10, keep=1) as out:
        out.write("abcdefgh\n")
    assert read_lines(path) == ["12345678", "abcdefgh"]
    assert [p.name for p in parts_of(path)] == [f"{path.name}.1", path.name]


def test_keep_zero_keeps_only_the_current_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with RotatingLines(path, max_bytes=5, keep=0) as out:
        for line in ("aaaa\n", "bbbb\n", "cccc\n"):
            out.write(line)
    assert parts_of(path) == [path]
    assert read_lines(path) == ["cccc"]


def test_no_max_bytes_never_rotates(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with RotatingLines(path, max_bytes=None, keep=1) as out:
        for _ in range(100):
            out.write("x" * 50 + "\n")
    assert parts_of(path) == [path]


@pytest.mark.parametrize(("max_bytes", "keep", "field"), [(0, 1, "max_bytes"), (10, -1, "keep")])
def test_bad_limits_are_refused_by_name(
    tmp_path: Path, max_bytes: int, keep: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        RotatingLines(tmp_path / "m", max_bytes=max_bytes, keep=keep)
