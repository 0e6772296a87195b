"""A ``streamrec serve`` process for the serving tests, and the address it serves on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.processes import REPO_ROOT
from tests.support.waits import wait_until

# The line ``streamrec serve`` prints once it listens: its HTTP address.
_URL = re.compile(r"on http://(?P<host>[\d.]+):(?P<port>\d+) ")


class Server:
    """A running ``streamrec serve`` and its log."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        """Start ``argv`` (logging to ``log``) and wait until it says where it listens."""
        self.argv = argv
        self.log_path = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        m = wait_until(
            lambda: _URL.search(self.log()), "its URL", procs=[self.proc], details=self.log
        )
        self.address = f"{m.group('host')}:{m.group('port')}"

    def log(self) -> str:
        """Everything the server has written so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then its exit code."""
        self.proc.terminate()
        return self.proc.wait(30)
