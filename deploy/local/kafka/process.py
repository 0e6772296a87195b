"""Server processes and ports of this machine: :class:`JavaProcess` (started, found again by
pid, stopped by process group), pid checks, and which ports are free or whose."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not; another user's does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child that exited but was not waited for is a zombie: dead for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _pid_runs(pid: int, main_class: str) -> bool:
    """True when ``pid`` is alive and (where /proc tells) still runs ``main_class``.

    Guards ``down`` against killing an unrelated process that reused a recorded pid.
    """
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc here: trust the pid
    return main_class.encode() in cmdline


@dataclass
class JavaProcess:
    """One server JVM: its pid (a process-group leader) and, when we started it, its Popen."""

    pid: int
    main_class: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def spawn(cls, argv: list[str], log_path: Path, main_class: str) -> JavaProcess:
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: killed as one, immune to ^C
                cwd=log_path.parent,
            )
        return cls(proc.pid, main_class, log_path, proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _pid_runs(self.pid, self.main_class)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)  # in case the group is gone but the leader is not

    def _wait(self, timeout_s: float) -> bool:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(self.pid):
                return True
            time.sleep(0.05)
        return not pid_alive(self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (the broker flushes and closes its logs cleanly), then SIGKILL."""
        if not self.alive():
            self._wait(0)
            return
        self._signal(signal.SIGTERM)
        if not self._wait(timeout_s):
            log.warning("%s (pid %d) ignored SIGTERM; killing it", self.main_class, self.pid)
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole process group: no flush, no goodbye to ZooKeeper."""
        self._signal(signal.SIGKILL)
        self._wait(10.0)

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (as Java does: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str:
    """Who holds local TCP ``port``, in words: ``pid 123 (python3 -m http.server; listening)``.

    Read from ``/proc/net/tcp{,6}`` and ``/proc/<pid>/fd``; a process of another
    user is named by its socket only.
    """
    inodes: dict[str, str] = {}  # socket inode -> "listening" / "connected"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[9] == "0":  # inode 0: TIME_WAIT, nobody's
                continue
            if int(fields[1].rpartition(":")[2], 16) == port:
                inodes[fields[9]] = "listening" if fields[3] == "0A" else "connected"
    if not inodes:
        return "a process this system does not name"
    found: list[str] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for inode, how in inodes.items():
            if f"socket:[{inode}]" in links:
                found.append(f"pid {proc.name} ({cmdline.strip()[:160]}; {how})")
                break
    return "; ".join(found) or "a process of another user"
