"""The job runner's one error type."""

from __future__ import annotations


class JobError(RuntimeError):
    """A job that cannot start as configured (the message says what to change)."""
