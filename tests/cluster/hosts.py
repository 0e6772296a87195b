"""Hosts on one machine: each its own loopback address, working directory and processes.

A :class:`Host` stands for one machine of a cluster. Its processes are
started by the stock commands a user runs there (``streamrec store serve``,
``dask scheduler``, ``dask worker``, ``torchrun ... streamrec run``), bound to
its own address (127.0.0.2, 127.0.0.3, ...), in its own working directory.
Nothing is shared between hosts but the network (and what lives behind it:
Kafka, the S3 server). :meth:`Host.crash` is ``kill -9`` of everything the
host runs; :meth:`Host.replace` gives it a new, empty working directory, as
a replacement machine would have.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.support.processes import STREAMREC
from tests.support.waits import wait_until

BIN = Path(sys.executable).parent


@dataclass
class Host:
    """One "machine": an address, a working directory per life, the processes it runs."""

    name: str
    address: str
    root: Path
    env: dict[str, str]
    life: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    dirs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.replace()

    @property
    def workdir(self) -> Path:
        return self.dirs[-1]

    def replace(self) -> Path:
        """A new, empty working directory (a replacement machine's disk)."""
        self.life += 1
        path = self.root / f"{self.name}-life{self.life}"
        path.mkdir(parents=True)
        self.dirs.append(path)
        return path

    def start(self, role: str, argv: list[str], *, extra_env: dict[str, str] | None = None) -> None:
        """Run ``argv`` in the working directory, logging to ``<role>.log`` there."""
        log = (self.workdir / f"{role}.log").open("ab")
        self.procs[role] = subprocess.Popen(
            argv,
            cwd=self.workdir,
            env={**self.env, **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: crash() kills all of it
        )
        log.close()

    def log(self, role: str) -> str:
        path = self.workdir / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, role: str, pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
        """Wait until ``role``'s log matches ``pattern``; fail with the log if it exits first."""
        return wait_until(
            lambda: re.search(pattern, self.log(role)),
            f"{self.name}/{role}: {pattern!r} in its log",
            timeout_s=timeout_s,
            interval_s=0.1,
            procs=[self.procs[role]],
            details=lambda: self.log(role)[-4000:],
        )

    def crash(self) -> None:
        """``kill -9`` of every process the host runs (no signal handler, no goodbye).

        Descendants too, whatever their process group: torchrun starts its ranks
        in sessions of their own, and a machine that dies takes them all.
        """
        for proc in self.procs.values():
            try:
                family = [*psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                family = []
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for child in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.wait()
            psutil.wait_procs(family, timeout=10)
        self.procs.clear()

    def signal(self, role: str, signum: int) -> None:
        """``signum`` to ``role``'s process group, if it still runs."""
        proc = self.procs[role]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    def stop(self, role: str, timeout_s: float = 120.0) -> int:
        """SIGTERM to ``role``'s process group, as an orchestrator stops it; its exit code."""
        self.signal(role, signal.SIGTERM)
        return self.wait(role, timeout_s)

    def wait(self, role: str, timeout_s: float = 120.0) -> int:
        """``role``'s exit code, once it has ended."""
        proc = self.procs[role]
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            msg = f"{self.name}/{role} did not stop within {timeout_s}s:\n{self.log(role)[-4000:]}"
            raise AssertionError(msg) from None


# --- the commands a user runs on each kind of host --------------------------------------


def store_serve(job: str, host: Host, port: int, snapshots: str) -> list[str]:
    return [
        *STREAMREC,
        "store",
        "serve",
        "--config",
        job,
        "--host",
        host.address,
        "--port",
        str(port),
        "--data-dir",
        "shard",
        "--snapshots",
        snapshots,
    ]


def dask_scheduler(host: Host, port: int) -> list[str]:
    return [
        str(BIN / "dask"),
        "scheduler",
        "--host",
        host.address,
        "--port",
        str(port),
        "--dashboard-address",
        f"{host.address}:0",
    ]


def dask_worker(host: Host, scheduler: str) -> list[str]:
    return [
        str(BIN / "dask"),
        "worker",
        scheduler,
        "--host",
        host.address,
        "--nworkers",
        "1",
        "--nthreads",
        "1",
        "--no-dashboard",
        "--name",
        host.name,
    ]


def rendezvous(host: Host, port: int) -> list[str]:
    """torchrun's c10d rendezvous store on a host of its own (no trainer runs there)."""
    return [*STREAMREC, "rendezvous", "--host", host.address, "--port", str(port)]


def torchrun(job: str, host: Host, *, nnodes: int, endpoint: str, run_id: str) -> list[str]:
    """One trainer host's ``streamrec torchrun``: one rank, the c10d rendezvous at
    ``endpoint`` (``streamrec rendezvous`` on a host of its own), and restarts.

    When a trainer host is lost, the other hosts' ranks fail; their torchrun
    starts them again and waits in the rendezvous until a host takes the lost
    one's place (``--max-restarts``), as it would in a StatefulSet.
    """
    return [
        *STREAMREC,
        "torchrun",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        # Never the store's host: it runs on the rendezvous host.
        "--rdzv-conf=is_host=0,join_timeout=300",
        f"--local-addr={host.address}",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "-m",
        "deploy.cli",
        "run",
        job,
    ]
