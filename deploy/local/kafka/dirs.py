"""Where the local Kafka's files live, read from the environment when asked, never at import.

The distribution is fetched to :func:`default_cache_dir`; ``streamrec kafka up``
keeps its data, logs and pids in :func:`default_state_dir`, recorded in
``STATE_FILE`` there.

>>> (REPO_ROOT / "pyproject.toml").is_file()
True
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_FILE = "kafka.json"  # what `up` recorded: addresses, pids, the work dir
LOCK_FILE = "kafka.lock"  # held by one `up` or `down` of a state dir at a time

# The checkout (the tests keep their Kafka in its .cache).
REPO_ROOT = Path(__file__).resolve().parents[3]

CACHE_ENV = "STREAMREC_CACHE_DIR"  # streamrec's cache root: the Kafka goes to <it>/kafka
STATE_ENV = "STREAMREC_STATE_DIR"  # streamrec's state root: `kafka up` keeps <it>/kafka


def _xdg_dir(variable: str, fallback: str) -> Path:
    """``$<variable>`` when it is an absolute path (the XDG rule), else ``~/<fallback>``."""
    value = os.environ.get(variable, "")
    if value and Path(value).is_absolute():
        return Path(value)
    return Path.home() / fallback


def default_cache_dir() -> Path:
    """Where the Kafka distribution is fetched to, read from the environment now.

    ``$STREAMREC_CACHE_DIR/kafka``, else ``$XDG_CACHE_HOME/streamrec/kafka``,
    else ``~/.cache/streamrec/kafka``.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"STREAMREC_CACHE_DIR": "/tmp/c"}):
    ...     default_cache_dir()
    PosixPath('/tmp/c/kafka')
    """
    root = os.environ.get(CACHE_ENV, "")
    if root:
        return Path(root).expanduser() / "kafka"
    return _xdg_dir("XDG_CACHE_HOME", ".cache") / "streamrec" / "kafka"


def default_state_dir() -> Path:
    """Where ``streamrec kafka up`` keeps its data, logs and pids, read from the environment now.

    ``$STREAMREC_STATE_DIR/kafka``, else ``$XDG_STATE_HOME/streamrec/kafka``,
    else ``~/.local/state/streamrec/kafka``.
    """
    root = os.environ.get(STATE_ENV, "")
    if root:
        return Path(root).expanduser() / "kafka"
    return _xdg_dir("XDG_STATE_HOME", ".local/state") / "streamrec" / "kafka"
