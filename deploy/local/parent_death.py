"""Child processes that end with the thread that started them, started without
``preexec_fn``.

Linux's ``prctl(PR_SET_PDEATHSIG)`` has the kernel signal a child when the thread
that started it ends, so that a job killed with SIGKILL leaves no scheduler or
shard behind. Asked for in a ``preexec_fn``, it makes Python fork and run Python
in the child before ``exec``: in a process with gRPC calls in flight (a job with
its store clients, a benchmark with its own) gRPC's fork handlers restart its
poller in the child, which aborts (``epoll_wait error: Bad file descriptor``,
grpc/grpc#43055) before ``exec``: 2 or 3 children in 300 here, and once a
benchmark's training job. Without ``preexec_fn`` Python starts the child with
``vfork`` and no fork handler runs; the child asks for the signal itself, first
thing: :func:`with_parent_death` puts a launcher before the command that does
so, checks that its parent is still the process that started it (else that
parent ended before it asked, and it sends itself the signal), and then
``exec``\\s the command (the signal stays set across ``exec``).

>>> import signal
>>> argv = with_parent_death(["sleep", "1"], signal.SIGTERM, platform="linux")
>>> argv[-2:], argv[-3] == str(int(signal.SIGTERM))
(['sleep', '1'], True)
>>> with_parent_death(["sleep", "1"], signal.SIGTERM, platform="darwin")
['sleep', '1']
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["LAUNCHER", "with_parent_death"]

# Isolated and without site (-I -S): it starts quickly, and imports nothing of the job's.
LAUNCHER = """\
import ctypes, os, sys
parent, sig = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent ended before the signal was asked for
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
os.execvp(sys.argv[3], sys.argv[3:])
"""


def with_parent_death(argv: Sequence[str], sig: int, *, platform: str = sys.platform) -> list[str]:
    """``argv`` run so that it gets ``sig`` when the thread that starts it ends (Linux;
    elsewhere ``argv`` as it is: the child may outlive its parent). Start it from a
    thread that outlives the child, without ``preexec_fn``."""
    if platform != "linux":
        return list(argv)
    prefix = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(os.getpid()), str(int(sig))]
    return [*prefix, *argv]
