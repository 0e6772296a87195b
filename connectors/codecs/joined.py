"""Payloads that arrive already in one buffer, kept there.

A codec's decode joins its payloads into one buffer, newline-separated, and
scans that (see :func:`connectors.codecs.steps.join`). Payloads that come
from one message (a prediction request's records, sent as the binary tensor
data extension's length-prefixed elements) can be laid out that way once, by
one kernel pass over the message, instead of becoming a ``bytes`` object
each and being joined again. :class:`JoinedPayloads` is that buffer: a
``Sequence[bytes]`` for whoever wants the payloads one by one, and the
joined form, with each payload's start and whether the whole is valid UTF-8,
for the scanners.

>>> joined = JoinedPayloads.of([b'{"a": 1}', b"", "é".encode()])
>>> len(joined), joined[0], joined[1], list(joined)[2].decode()
(3, b'{"a": 1}', b'', 'é')
>>> bytes(joined.joined), joined.starts.tolist(), joined.utf8
(b'{"a": 1}\\n\\n\\xc3\\xa9', [0, 9, 10, 13], True)
>>> JoinedPayloads.of([b"\\xff"]).utf8
False
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import overload

import numba as nb
import numpy as np
import numpy.typing as npt

__all__ = ["JoinedPayloads", "utf8_valid"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class JoinedPayloads(Sequence[bytes]):
    """``n`` payloads joined by newlines in ``joined``; payload ``i`` is
    ``joined[starts[i] : starts[i + 1] - 1]`` (``starts`` has ``n + 1`` entries, as
    ``steps.join`` gives them); ``utf8``: whether ``joined`` is valid UTF-8."""

    __slots__ = ("joined", "starts", "utf8")

    def __init__(self, joined: U8, starts: I64, utf8: bool) -> None:
        self.joined = joined
        self.starts = starts
        self.utf8 = utf8

    @classmethod
    def of(cls, payloads: Sequence[bytes]) -> JoinedPayloads:
        """``payloads`` joined (a test's or a caller's list)."""
        joined = np.frombuffer(b"\n".join(payloads), dtype=np.uint8)
        lens = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        starts = np.zeros(len(payloads) + 1, dtype=np.int64)
        np.cumsum(lens + 1, out=starts[1:])
        return cls(joined, starts, bool(utf8_valid(joined)))

    @property
    def lens(self) -> I64:
        """Each payload's length in bytes."""
        lens: I64 = np.diff(self.starts) - 1
        return lens

    def __len__(self) -> int:
        return int(self.starts.shape[0]) - 1

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            msg = f"payload {i} of {n}"
            raise IndexError(msg)
        i %= n
        return self.joined[self.starts[i] : self.starts[i + 1] - 1].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        joined = self.joined
        for a, b in itertools.pairwise(self.starts.tolist()):
            yield joined[a : b - 1].tobytes()


@nb.njit(nogil=True, cache=True)
def utf8_valid(b: U8) -> bool:
    """Whether ``b`` (uint8) is valid UTF-8: no overlong forms, surrogates or code points
    past U+10FFFF, as Python's decoder has it. A numba function: kernels call it too.

    >>> utf8_valid(np.frombuffer("naïve €".encode(), np.uint8))
    True
    >>> utf8_valid(np.frombuffer(b"\\xed\\xa0\\x80", np.uint8))  # a surrogate
    False
    """
    end = b.shape[0]
    i = 0
    while i < end:
        c = b[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2:  # a continuation byte, or the lead of an overlong two-byte form
            return False
        lo, hi = 0x80, 0xBF
        if c < 0xE0:
            need = 1
        elif c < 0xF0:
            need = 2
            if c == 0xE0:
                lo = 0xA0  # overlong
            elif c == 0xED:
                hi = 0x9F  # surrogates
        elif c < 0xF5:
            need = 3
            if c == 0xF0:
                lo = 0x90  # overlong
            elif c == 0xF4:
                hi = 0x8F  # past U+10FFFF
        else:
            return False
        if i + need >= end or not lo <= b[i + 1] <= hi:
            return False
        for k in range(2, need + 1):
            if not 0x80 <= b[i + k] <= 0xBF:
                return False
        i += need + 1
    return True
