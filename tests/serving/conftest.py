"""A job trained once for the serving tests (its checkpoint, published weights and shard)."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.synthetic import SyntheticConfig, write_parquet
from tests.support.jobs import write_small_job
from tests.support.processes import streamrec


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job that learned 3,000 events of the synthetic stream (its checkpoint stays)."""
    tmp = tmp_path_factory.mktemp("scored")
    data = write_parquet(tmp / "history.parquet", SyntheticConfig(seed=2), 3000, 500)
    job = write_small_job(tmp, {"kind": "parquet", "paths": [str(data)]})
    out = streamrec("backfill", str(job))
    assert out.returncode == 0, out.stdout + out.stderr
    return job
