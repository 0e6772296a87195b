"""Loopback ports for tests: one free now, or one held so that nothing else can take it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A TCP port free now on every address (for a server the test starts next).

    Bound on all addresses, not only 127.0.0.1: some servers bind them all
    (torchrun's rendezvous store does), and the cluster tests' "hosts" each
    have a loopback address of their own, so a port free on one could be
    another's. Another process may still take it before the server binds it.
    """
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@contextmanager
def held_port(*, listen: bool = True) -> Iterator[int]:
    """A 127.0.0.1 port bound by this process until the block ends.

    ``listen=True``: a server seems to be there (a start on it must fail and say
    so). ``listen=False``: connections are refused, yet no other process can take
    the port meanwhile and be dialled by mistake.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        if listen:
            held.listen()
        yield int(held.getsockname()[1])
