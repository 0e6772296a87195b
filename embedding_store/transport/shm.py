"""The shared-memory area through which a gRPC transport passes frames to a shard on
its own host; only the small call messages then go over the socket
(``benchmarks/store.py``: ``grpc_*`` against ``grpc_network_*``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

from embedding_store.wire import SharedCall

SHM_DIR = "/dev/shm"
# The smallest shared area made (it grows, by powers of two, to what a call needs).
MIN_AREA = 4 << 20


def align64(n: int) -> int:
    return (n + 63) & ~63


class SharedArea:
    """A file in ``/dev/shm`` mapped by this client and, once attached, by a shard.

    Its pages are reserved when it is made (``posix_fallocate``): a full
    ``/dev/shm`` fails here, with an OSError, and not later with a SIGBUS in the
    shard. One call uses it at a time (``lock``); a call that finds it busy goes
    over the network.
    """

    def __init__(self, directory: str, size: int) -> None:
        self.session = os.urandom(16)
        self.nonce = os.urandom(16)
        self.size = size
        self.lock = threading.Lock()
        self.path = os.path.join(directory, SharedCall(self.session).name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.map[:16] = self.nonce

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
            self.map.close()
