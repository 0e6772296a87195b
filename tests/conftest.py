"""Fixtures that run the real thing: Kafka and S3 for the session, store shard processes.

The helpers behind them, and those tests share, are in :mod:`tests.support`.
Also the fast tier's check: in a run that leaves out the ``processes`` marker
(``make test-fast``), an unmarked test that starts a process fails and says so.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest

from deploy.local.kafka import LocalKafka
from deploy.local.objectstore import LocalS3
from deploy.local.shards import ShardProcess
from tests.support.jobs import write_store_job
from tests.support.kafka import (
    KafkaForTests,
    local_kafka,
    session_kafka,
    session_tansu,
)
from tests.support.kafka import (
    kafka_cache_in_checkout as checkout_cache,
)
from tests.support.processes import forbid_processes

# --- the fast tier: `processes` marks every test that starts a process ----------------


def _processes_left_out(config: pytest.Config) -> bool:
    """Whether this run's ``-m`` leaves out tests marked ``processes``."""
    return re.search(r"\bnot\s+processes\b", config.option.markexpr or "") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    # Setup too: a session fixture (a broker) starts in the setup of its first user.
    with _guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _guard(item):
        return (yield)


def _guard(item: pytest.Item) -> AbstractContextManager[None]:
    if item.get_closest_marker("processes") or not _processes_left_out(item.config):
        return nullcontext()
    return forbid_processes(item.nodeid)


# --- Kafka (tests.support.kafka) -------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def kafka_cache_in_checkout() -> Iterator[Path]:
    """``$STREAMREC_CACHE_DIR`` (default ``<repo>/.cache``) for the session; the Kafka cache."""
    with checkout_cache() as path:
        yield path


@pytest.fixture(scope="session")
def kafka(kafka_cache_in_checkout: Path) -> Iterator[KafkaForTests]:
    """One Kafka for the session: a LocalKafka, or ``$STREAMREC_KAFKA_BOOTSTRAP``."""
    with session_kafka() as found:
        yield found


@pytest.fixture
def kafka_topic(kafka: KafkaForTests) -> Callable[..., str]:
    """``kafka_topic(partitions=1)`` creates a fresh uuid-named topic and returns its name.

    Topics are not deleted: names never repeat, and a local broker's data goes
    with its temporary folder at the end of the session.
    """

    return kafka.new_topic


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaForTests]:
    """A Tansu broker for the session (log in memory): Kafka's modern protocol."""
    with session_tansu(tmp_path_factory.mktemp("tansu")) as found:
        yield found


@pytest.fixture(params=["kafka-0.9", "tansu"])
def broker(request: pytest.FixtureRequest) -> KafkaForTests:
    """The test runs twice: on the session's Kafka 0.9 and on the session's Tansu."""
    found: KafkaForTests = request.getfixturevalue(
        "kafka" if request.param == "kafka-0.9" else "tansu"
    )
    return found


@pytest.fixture(scope="module")
def restartable(kafka_cache_in_checkout: Path) -> Iterator[LocalKafka]:
    """A broker of its own: restarting the session's broker would disturb other tests."""
    with local_kafka() as local:
        yield local


# --- S3 (tests.support.s3) -------------------------------------------------------------


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """The session's S3 server (started on first use, stopped at the end)."""
    from tests.support.s3 import session_s3

    with session_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3_prefix(s3: LocalS3) -> str:
    """A fresh prefix in the session's bucket, e.g. ``t-1a2b3c4d``."""
    return f"t-{uuid.uuid4().hex[:8]}"


# --- store shards ----------------------------------------------------------------------


@pytest.fixture
def write_job(tmp_path: Path) -> Callable[..., Path]:
    """``write_job(name="job.yaml", **store)``: a store-only job YAML in ``tmp_path``
    (:func:`tests.support.jobs.write_store_job`); returns its path."""

    def write(name: str = "job.yaml", **store: Any) -> Path:
        return write_store_job(tmp_path / name, **store)

    return write


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(secrets.token_hex(16) + "\n")
    return path


@pytest.fixture
def start_shards(tmp_path: Path) -> Iterator[Callable[..., list[ShardProcess]]]:
    """Start N ``streamrec store serve`` processes; all are killed at teardown."""
    started: list[ShardProcess] = []

    def start(
        n: int,
        config: Path,
        token_file: Path | None,
        prefix: str = "shard",
        allow_dirs: tuple[Path, ...] = (),
    ) -> list[ShardProcess]:
        procs = [
            ShardProcess.start(
                config, tmp_path / f"{prefix}-{i}", token_file=token_file, allow_dirs=allow_dirs
            )
            for i in range(n)
        ]
        started.extend(procs)
        return procs

    start.track = started.append  # type: ignore[attr-defined]  # for restarted shards
    yield start
    for p in started:
        p.kill()
