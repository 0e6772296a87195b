"""Waiting for a condition, with a deadline and a message that says what did not happen."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

Procs = Iterable["subprocess.Popen[Any]"] | Callable[[], Iterable["subprocess.Popen[Any]"]]


def wait_until(
    check: Callable[[], T | None],
    what: str,
    *,
    timeout_s: float = 60.0,
    interval_s: float = 0.05,
    procs: Procs = (),
    details: Callable[[], str] | None = None,
) -> T:
    """Poll ``check()`` until it gives a true value, and return that value.

    Fails the test with ``"<what>: not within <timeout_s> s"`` once the time is
    up, or at once when one of ``procs`` (processes, or a function giving the
    current ones) has ended: it cannot happen then, and waiting on would only
    hide why. ``details()``, when given, is added to either message (a log).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        watched = procs() if callable(procs) else procs
        ended = [p for p in watched if p.poll() is not None]
        if ended:
            codes = ", ".join(f"{_name(p)} ({p.returncode})" for p in ended)
            _fail(f"{what}: {codes} ended first", details)
        if time.monotonic() > deadline:
            _fail(f"{what}: not within {timeout_s} s", details)
        time.sleep(interval_s)


def _name(proc: subprocess.Popen[Any]) -> str:
    args = proc.args
    words = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    return " ".join(words)[:120]


def _fail(message: str, details: Callable[[], str] | None) -> None:
    if details is not None:
        message = f"{message}:\n{details()}"
    pytest.fail(message)
