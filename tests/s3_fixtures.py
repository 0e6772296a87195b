"""An S3-compatible object store for tests: one SeaweedFS ``weed mini`` for the session.

The session's server holds one bucket; each test takes its own prefix
(:func:`s3_prefix`), so tests never see each other's objects. Its access key is
put in this process's environment for the session (the AWS SDK inside
``pyarrow.fs`` reads it there), and :meth:`S3ForTests.env` gives it to
subprocesses.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from deploy.local.objectstore import LocalS3


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """The session's S3 server (started on first use, stopped at the end)."""
    server = LocalS3.start(tmp_path_factory.mktemp("s3"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        yield server
    server.stop()


@pytest.fixture
def s3_prefix(s3: LocalS3) -> str:
    """A fresh prefix in the session's bucket, e.g. ``t-1a2b3c4d``."""
    return f"t-{uuid.uuid4().hex[:8]}"


def subprocess_env(server: LocalS3, **extra: str) -> dict[str, str]:
    """This process's environment plus the server's key and ``extra``, for a child."""
    return {**os.environ, **server.env(), **extra}
