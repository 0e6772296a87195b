"""An S3-compatible object store for tests: one SeaweedFS ``weed mini`` for the session.

The session's server (the ``s3`` fixture of ``tests/conftest.py``, started by
:func:`session_s3`) holds one bucket; each test takes its own prefix (the
``s3_prefix`` fixture), so tests never see each other's objects. Its access
key is put in this process's environment for the session (the AWS SDK inside
``pyarrow.fs`` reads it there); ``LocalS3.env()`` gives it to subprocesses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deploy.local.objectstore import LocalS3


@contextmanager
def session_s3(state: Path) -> Iterator[LocalS3]:
    """A new S3 server keeping its files under ``state``, its key in ``os.environ``
    until the end, when both go."""
    server = LocalS3.start(state)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        yield server
    server.stop()
