"""Children that end with their parent, started by a process with gRPC calls in flight."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import pytest

from deploy.local.parent_death import LAUNCHER, with_parent_death

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def calls_in_flight() -> Iterator[list[int]]:
    """A gRPC server of this process and two threads calling it without a pause."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"E": echo})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/t.T/E")
    stop = threading.Event()
    done = [0]

    def pound() -> None:
        while not stop.is_set():
            call(b"x" * 100)
            done[0] += 1

    threads = [threading.Thread(target=pound) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        yield done
    finally:
        stop.set()
        for t in threads:
            t.join()
        channel.close()
        server.stop(None)


def test_children_started_beside_grpc_calls_in_flight_all_run(calls_in_flight: list[int]) -> None:
    """Asked for in a preexec_fn, the parent-death signal made Python fork with gRPC's
    fork handlers, and about 1 child in 100 aborted before exec (SIGABRT, ``epoll_wait
    error: Bad file descriptor``): a benchmark's training job among them."""
    true = shutil.which("true")
    assert true is not None
    codes: dict[int, int] = {}
    for _ in range(400):
        proc = subprocess.Popen(
            with_parent_death([true], signal.SIGTERM),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = proc.communicate()
        codes[proc.returncode] = codes.get(proc.returncode, 0) + 1
        assert proc.returncode == 0, err.decode(errors="replace")[-500:]
    assert codes == {0: 400}
    assert calls_in_flight[0] > 0  # the calls were in flight meanwhile


def test_a_child_gets_the_signal_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, subprocess, sys, time\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from deploy.local.parent_death import with_parent_death\n"
            "child = subprocess.Popen(with_parent_death(['sleep', '60'], signal.SIGTERM))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    # The launcher has exec'd the command: the child is `sleep` itself, our parent's.
    deadline = time.monotonic() + 10
    while child.name() != "sleep" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.name() == "sleep"
    assert child.ppid() == parent.pid
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its parent's SIGKILL"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE  # a zombie waits for init to reap it
    except psutil.NoSuchProcess:
        return False


def test_a_child_whose_parent_ended_first_does_not_run_its_command(tmp_path: Path) -> None:
    """The launcher compares its parent with the one that started it: a child whose
    parent ended before it asked for the signal would never get it, so it ends at once."""
    marker = tmp_path / "ran"
    not_our_pid = str(os.getpid() + 1_000_000)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", LAUNCHER, not_our_pid, str(int(signal.SIGTERM)),
         "touch", str(marker)],
        check=False,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGTERM
    assert not marker.exists()
    # With its own parent's pid the command runs.
    ok = subprocess.run(with_parent_death(["touch", str(marker)], signal.SIGTERM), check=False)
    assert ok.returncode == 0
    assert marker.exists()
