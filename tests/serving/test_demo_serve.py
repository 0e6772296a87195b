"""`streamrec demo --serve`: the URL and the curl line it prints work as printed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes


def _run_curl_line(line: str) -> bytes:
    """Run the printed curl line: with curl where it is installed, else replayed as is."""
    argv = shlex.split(line)
    if shutil.which("curl") is not None:
        return subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout
    url = next(a for a in argv if a.startswith("http"))
    body = argv[argv.index("-d") + 1].encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return bytes(reply.read())


def test_demo_serves_while_and_after_it_trains(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "deploy.cli", "demo", "--events", "60000", "--serve",
            "--serve-port", "0", "--run-dir", str(tmp_path / "demo")]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "curl -s" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        text = log.read_text()
        [curl] = [line.strip() for line in text.splitlines() if line.strip().startswith("curl ")]
        [dashboard] = re.findall(r"Dask dashboard: (http://\S+)/status", text)

        def servers() -> dict[str, Any]:
            with urllib.request.urlopen(f"{dashboard}/streamrec/data.json", timeout=10) as r:
                found: dict[str, Any] = json.loads(r.read()).get("servers", {})
                return found

        # While it trains, the dashboard's streamrec page shows the server's requests.
        while not any(s.get("requests_total", 0) for s in servers().values()):
            assert "Ctrl-C stops it" not in log.read_text(), "trained before any report"
            _run_curl_line(curl)  # a 503 until the first weights are published
            time.sleep(0.5)
        while "Ctrl-C stops it" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "predictions: http://127.0.0.1:" in log.read_text()
        reply = json.loads(_run_curl_line(curl))
        [output] = reply["outputs"]
        assert output["name"] == "click"
        assert 0.0 < output["data"][0] < 1.0
        assert reply["parameters"]["samples_learned"] == 60000
        time.sleep(2.5)  # the reporter's interval, twice: it would have failed by now
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
        # The server outlived the job's cluster without reporting to it.
        assert "could not report server" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
