"""The packages' comments and docstrings keep decisions and reasons, not lab notes.

A figure from one machine ("on the 2-core EPYC VM, 288 against 483 us") goes stale
the day the code or the machine changes, and history ("it used to answer 404") is
the commit log's: a comment says what the code does and why, and may point to the
benchmark that shows it (``see benchmarks/serve.py``). Scanned: every comment and
string literal of the packages' ``.py`` files (not tests, not benchmarks, not the
generated protobuf modules).
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

PACKAGES = (
    "pipeline",
    "embedding_store",
    "trainer",
    "connectors",
    "deploy",
    "monitoring",
    "serving",
)
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")

# What a lab note looks like, each under the reason it is one.
LAB_NOTES: dict[str, re.Pattern[str]] = {
    "a CPU model (a figure from one machine)": re.compile(
        r"\b(EPYC|Xeon|Ryzen|Threadripper|Graviton|Core i[3579]|Apple M[1-4])\b"
    ),
    "one machine as the setting of a figure": re.compile(
        r"\bon (a|an|the|one|this|my) (\w+ )?\d+[- ](core|cpu|vcpu)s?\b|(?-i:\b(VM|vCPU)s?\b)",
        re.IGNORECASE,
    ),
    "this machine": re.compile(
        r"\bon (this|my|our) (machine|laptop|workstation|desktop|vm)\b", re.IGNORECASE
    ),
    "history": re.compile(
        # "used to" as in "it used to answer 404", not "a key used to sign" or
        # "is used to ..."
        r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bbeen )(?<!\bwere )"
        r"\bused to\b(?! (?:be )?(?:[a-z]+ )?(?:by|for|in)\b)"
        r"|\b(before|after|since) (this|the) (change|commit|fix|patch)\b"
        r"|\b(was|were) once\b|\bonce was\b",
        re.IGNORECASE,
    ),
    "figure against figure": re.compile(
        # "288 against 483 us", "3.0 ms at the median instead of 2.0"
        r"\d[\d,]*(\.\d+)?( ?[a-zµ/%]+)?( [\w-]+){0,3},? (against|instead of|versus|vs\.?) ~?\d",
        re.IGNORECASE,
    ),
    "a speed-up or slow-down from one machine": re.compile(
        r"\b\d+(\.\d+)? ?(x|times) (faster|slower|quicker|as fast|as slow)\b", re.IGNORECASE
    ),
    "a measurement as a diary entry": re.compile(
        r"\bmeasured\)|\bmeasured (on|at|about|around|here|as) |\bmeasured ~?\d"
        r"|\bin (an|a|one) (\w+'s )?soak\b|\bran at \d",
        re.IGNORECASE,
    ),
}


# Comments and string literals (f-strings are split into parts from Python 3.12 on).
TEXT_TOKENS = {
    tokenize.COMMENT,
    tokenize.STRING,
    *(t for t in (getattr(tokenize, "FSTRING_MIDDLE", None),) if t is not None),
}


def _sources() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if not GENERATED.search(path.name):
                yield path


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and string literal, a line at a time."""
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in TEXT_TOKENS:
            continue
        for offset, line in enumerate(tok.string.splitlines()):
            yield tok.start[0] + offset, line


def _clean(text: str) -> str:
    """A line of text without its comment mark and indentation."""
    return text.strip().removeprefix("#").strip()


def notes_in(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str, str]]:
    """(line, why, text) of every lab note; a note split over two lines of text that
    follow each other is found, at its first line."""
    for i, (line, text) in enumerate(lines):
        after = lines[i + 1][1] if i + 1 < len(lines) and lines[i + 1][0] == line + 1 else ""
        joined = f"{_clean(text)} {_clean(after)}"
        for why, pattern in LAB_NOTES.items():
            if pattern.search(_clean(text)) or (
                pattern.search(joined) and not pattern.search(_clean(after))
            ):
                yield line, why, text.strip()


def lab_notes(path: Path) -> Iterator[str]:
    """``file:line: why: text`` for every lab note in ``path``."""
    where = path.relative_to(REPO_ROOT)
    for line, why, text in notes_in(list(_texts(path))):
        yield f"{where}:{line}: {why}: {text}"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("# on the 2-core AMD EPYC VM: 288 against 483 us", True),
        ("# measured 40 ms on a 2-core runner", True),
        ("# it used to answer 404 here", True),
        ("# 1.2 ms against 3 ms", True),
        ("# before this change the loop spun", True),
        ("a lone request took 3.0 ms at the median instead of 2.0", True),
        ("eight clients got 960 requests/s instead of 1,270", True),
        ("that ran the hybrid trainer about 3x slower than one thread did", True),
        ("# (Criteo-like records, measured)", True),
        ("In an hour's soak the scheduler's RSS rose by about 0.7 MB a minute", True),
        ("# the key is used to sign each request", False),
        ("# the port used to listen for metrics", False),
        ("# see benchmarks/serve.py for the figures", False),
        ("# a 2-core test machine pauses threads for seconds: a generous timeout", False),
        ("the rows of a shard on this host pass through shared memory", False),
        (">>> auto_torch_threads(2, local_shards=2)  # the demo on 2 cores", False),
        ("# a nanny's timeout (4 s of the cluster's 5) and a SIGKILL", False),
        ("# a window of 100k costs 0.5 MB", False),
    ],
)
def test_the_patterns_tell_a_note_from_a_reason(text: str, found: bool) -> None:
    assert any(p.search(text) for p in LAB_NOTES.values()) is found, text


def test_a_note_split_over_two_lines_is_found_at_its_first() -> None:
    lines = [(17, "# paced requests cost 0.435"), (18, "# against 0.540 ms of CPU each")]
    assert [(line, why) for line, why, _ in notes_in(lines)] == [(17, "figure against figure")]
    apart = [(17, "# paced requests cost 0.435"), (30, "# against 0.540 ms of CPU each")]
    assert list(notes_in(apart)) == []


def test_the_packages_hold_no_lab_notes() -> None:
    sources = list(_sources())
    assert len(sources) > 50  # the packages are there
    notes = [note for path in sources for note in lab_notes(path)]
    assert not notes, "lab notes in comments or docstrings:\n" + "\n".join(notes)
