"""Start and stop store shard processes on loopback.

Each shard is ``streamrec store serve`` in its own process, with its log in
``<data_dir>.log``; the port is chosen by the OS and read back from the log,
so any number of shards start without port races. With a metrics port the
shard also serves Prometheus ``/metrics``; its URL is read back from the log too.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.local.parent_death import with_parent_death

log = logging.getLogger(__name__)

_SERVING = re.compile(r"serving .* on (?P<host>[\w.:-]+):(?P<port>\d+) ")
_METRICS = re.compile(r"metrics on http://\S+:(?P<port>\d+)/metrics")


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, then wait up to ``timeout_s`` (then SIGKILL); returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


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
    metrics_port: int | None = None  # the port /metrics is served on; None: no metrics
    die_with_parent: bool = False
    allow_dirs: tuple[Path, ...] = ()
    snapshots: str | None = None  # the object-store URL its checkpoints are copied to
    follow: str | None = None  # a serving replica's training shard (``store replica``)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:PORT/metrics`` (Prometheus text), or None when started without one."""
        if self.metrics_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.metrics_port}/metrics"

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
        metrics_port: int | None = None,
        allow_dirs: tuple[Path, ...] = (),
        snapshots: str | None = None,
        env: dict[str, str] | None = None,
        follow: str | None = None,
    ) -> ShardProcess:
        """Start a shard and wait until it serves (it may first restore from ``data_dir``):
        :meth:`spawn`, then ``wait`` on what it returns.

        ``die_with_parent``: the shard gets SIGTERM (so it checkpoints and exits)
        when this process dies, even by ``kill -9``; a restarted job then never
        finds an orphan shard still writing to the same data dir.
        ``metrics_port``: also serve Prometheus ``/metrics`` on ``host`` at this
        port (0: any free one, read back from the log); None: no metrics.
        ``snapshots``: ``--snapshots URL`` (checkpoints copied to an object store).
        ``env``: the process's environment (default: this one's).
        ``follow``: start a serving replica of the shard at this address instead
        (``streamrec store replica``; ``snapshots`` is then where it starts from).
        """
        return cls.spawn(
            config,
            data_dir,
            token_file=token_file,
            port=port,
            host=host,
            die_with_parent=die_with_parent,
            metrics_port=metrics_port,
            allow_dirs=allow_dirs,
            snapshots=snapshots,
            env=env,
            follow=follow,
        ).wait(timeout_s)

    @classmethod
    def spawn(
        cls,
        config: Path,
        data_dir: Path,
        *,
        token_file: Path | None,
        port: int = 0,
        host: str = "127.0.0.1",
        die_with_parent: bool = False,
        metrics_port: int | None = None,
        allow_dirs: tuple[Path, ...] = (),
        snapshots: str | None = None,
        env: dict[str, str] | None = None,
        follow: str | None = None,
    ) -> StartingShard:
        """Start a shard's process and return at once (the arguments are :meth:`start`'s):
        several shards then start side by side, each waited for with ``wait``.

        Call it from a thread that outlives the shard when ``die_with_parent``: the
        shard's SIGTERM comes when the thread that started it ends.
        """
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = data_dir.with_name(data_dir.name + ".log")
        argv = [
            sys.executable,
            "-m",
            "deploy.cli",
            "store",
            "serve" if follow is None else "replica",
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
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        for d in allow_dirs:
            argv += ["--allow-dir", str(d)]
        if follow is not None:
            argv += ["--follow", follow]
        if snapshots is not None:
            argv += ["--snapshots", snapshots]
        if die_with_parent:  # SIGTERM: the shard checkpoints and exits
            argv = with_parent_death(argv, signal.SIGTERM)
        with log_path.open("ab") as log:
            offset = log.tell()
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # A shard the job owns is stopped by the job, after the job's last
                # checkpoint: not by the terminal's Ctrl-C, nor by a signal to the job's
                # process group, which would stop it in the middle of that checkpoint.
                start_new_session=die_with_parent,
            )
        return StartingShard(
            proc,
            log_path,
            offset,
            data_dir,
            config,
            token_file,
            metrics=metrics_port is not None,
            die_with_parent=die_with_parent,
            allow_dirs=allow_dirs,
            snapshots=snapshots,
            follow=follow,
        )

    def restart(self, timeout_s: float = 120.0) -> ShardProcess:
        """Start a fresh process on the same data dir and ports (after a stop or a kill)."""
        return ShardProcess.start(
            self.config,
            self.data_dir,
            token_file=self.token_file,
            port=self.port,
            host=self.host,
            timeout_s=timeout_s,
            metrics_port=self.metrics_port,
            die_with_parent=self.die_with_parent,
            allow_dirs=self.allow_dirs,
            snapshots=self.snapshots,
            follow=self.follow,
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the shard checkpoints into its data dir), then wait; returns the exit code."""
        return terminate(self.proc, timeout_s)

    def kill(self) -> None:
        """``kill -9``: no checkpoint, no goodbye."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class StartingShard:
    """A shard process started by :meth:`ShardProcess.spawn`, not yet known to serve."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    offset: int  # where this start's output begins in the log
    data_dir: Path
    config: Path
    token_file: Path | None
    metrics: bool
    die_with_parent: bool
    allow_dirs: tuple[Path, ...]
    snapshots: str | None
    follow: str | None

    def wait(self, timeout_s: float = 120.0) -> ShardProcess:
        """Until the shard serves (it may first restore from its data dir); killed and an
        error if it exits or does not serve within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
            m = _SERVING.search(text)
            if m:
                bound_metrics = None
                if self.metrics:
                    # The shard prints the metrics line before the serving one.
                    mm = _METRICS.search(text)
                    if mm is None:
                        self.proc.kill()
                        msg = f"store shard serves but printed no metrics URL; log: {self.log_path}"
                        raise RuntimeError(msg)
                    bound_metrics = int(mm.group("port"))
                return ShardProcess(
                    self.proc,
                    m.group("host"),
                    int(m.group("port")),
                    self.data_dir,
                    self.log_path,
                    self.config,
                    self.token_file,
                    metrics_port=bound_metrics,
                    die_with_parent=self.die_with_parent,
                    allow_dirs=self.allow_dirs,
                    snapshots=self.snapshots,
                    follow=self.follow,
                )
            if self.proc.poll() is not None:
                msg = f"store shard exited with code {self.proc.returncode}:\n{text[-4000:]}"
                raise RuntimeError(msg)
            time.sleep(0.05)
        self.proc.kill()
        msg = f"store shard did not start within {timeout_s}s; log: {self.log_path}"
        raise TimeoutError(msg)


class ShardSupervisor:
    """Restarts local shard processes that die, and counts how often that happened.

    A thread polls the processes; a shard that exited without being asked to
    (``kill -9``, a crash) is started again on the same address and data dir,
    where it restores its own newest checkpoint. Its rows since then are gone,
    and so may be rows the job had pushed: :attr:`restarts` tells the job, which
    then rolls every shard back to its newest job checkpoint.
    """

    def __init__(self, shards: list[ShardProcess], *, poll_s: float = 0.2) -> None:
        self.shards = shards
        self.poll_s = poll_s
        self.restarts = 0
        self.events: list[str] = []  # one line per restart, for the job's log
        self.failed: str | None = None  # a shard that could not be started again
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shard-supervisor", daemon=True)
        self._thread.start()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            for i, shard in enumerate(self.shards):
                code = shard.proc.poll()
                if code is None or self._stopped.is_set():
                    continue
                what = f"signal {-code}" if code < 0 else f"exit code {code}"
                if code == 0:
                    # A clean stop (SIGTERM, Ctrl-C) is someone's decision, not a crash:
                    # starting the shard again would fight them. The job hears of it.
                    with self._lock:
                        self.failed = (
                            f"store shard {i} ({shard.address}) was stopped ({what}) while the "
                            "job ran; its checkpoint holds what it had, start the job again"
                        )
                    log.error("%s", self.failed)
                    return
                log.warning("store shard %d (%s) died (%s); restarting it", i, shard.address, what)
                t0 = time.monotonic()
                try:
                    fresh = shard.restart()
                except (RuntimeError, TimeoutError) as exc:
                    with self._lock:
                        self.failed = f"store shard {i} ({shard.address}) died ({what}) and "
                        self.failed += f"could not be restarted: {exc}"
                    log.error("%s", self.failed)
                    return
                with self._lock:
                    self.shards[i] = fresh
                    self.restarts += 1
                    self.events.append(
                        f"store shard {i} ({shard.address}) died ({what}); restarted in "
                        f"{time.monotonic() - t0:.1f}s"
                    )
                log.warning("%s", self.events[-1])

    def stop_watching(self) -> None:
        """Stop restarting shards (before they are stopped on purpose)."""
        self._stopped.set()
        self._thread.join(timeout=130)

    def stop(self) -> None:
        """Stop watching, then stop every shard (SIGTERM: each checkpoints and exits).

        Every shard is signalled before any is waited for: they checkpoint and exit
        side by side, and a job's end takes its slowest shard's time, not their sum.
        """
        self.stop_watching()
        for shard in self.shards:
            if shard.proc.poll() is None:
                shard.proc.send_signal(signal.SIGTERM)
        for shard in self.shards:
            shard.stop()
