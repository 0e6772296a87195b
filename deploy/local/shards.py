"""Start and stop store shard processes on loopback.

Each shard is ``streamrec store serve`` in its own process, with its log in
``<data_dir>.log``; the port is chosen by the OS and read back from the log,
so any number of shards start without port races.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_SERVING = re.compile(r"serving .* on (?P<host>[\w.:-]+):(?P<port>\d+) ")


def _term_with_parent() -> None:
    # Linux prctl(PR_SET_PDEATHSIG, SIGTERM); elsewhere the shard outlives us.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class ShardProcess:
    """A running ``streamrec store serve`` process."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    data_dir: Path
    log_path: Path
    config: Path
    token_file: Path | None
    argv: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def start(
        cls,
        config: Path,
        data_dir: Path,
        *,
        token_file: Path | None,
        port: int = 0,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        die_with_parent: bool = False,
    ) -> ShardProcess:
        """Start a shard and wait until it serves (it may first restore from ``data_dir``).

        ``die_with_parent``: the shard gets SIGTERM (so it checkpoints and exits)
        when this process dies, even by ``kill -9``; a restarted job then never
        finds an orphan shard still writing to the same data dir.
        """
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = data_dir.with_name(data_dir.name + ".log")
        argv = [
            sys.executable,
            "-m",
            "deploy.cli",
            "store",
            "serve",
            "--config",
            str(config),
            "--data-dir",
            str(data_dir),
            "--host",
            host,
            "--port",
            str(port),
        ]
        argv += ["--token-file", str(token_file)] if token_file else ["--no-auth"]
        with log_path.open("ab") as log:
            offset = log.tell()
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_term_with_parent if die_with_parent else None,  # noqa: PLW1509
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with log_path.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            m = _SERVING.search(text)
            if m:
                return cls(
                    proc,
                    m.group("host"),
                    int(m.group("port")),
                    data_dir,
                    log_path,
                    config,
                    token_file,
                    argv,
                )
            if proc.poll() is not None:
                msg = f"store shard exited with code {proc.returncode}:\n{text[-4000:]}"
                raise RuntimeError(msg)
            time.sleep(0.05)
        proc.kill()
        msg = f"store shard did not start within {timeout_s}s; log: {log_path}"
        raise TimeoutError(msg)

    def restart(self, timeout_s: float = 120.0) -> ShardProcess:
        """Start a fresh process on the same data dir and port (after a stop or a kill)."""
        return ShardProcess.start(
            self.config,
            self.data_dir,
            token_file=self.token_file,
            port=self.port,
            host=self.host,
            timeout_s=timeout_s,
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the shard checkpoints into its data dir), then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        """``kill -9``: no checkpoint, no goodbye."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
