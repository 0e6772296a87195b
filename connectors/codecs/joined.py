"""Payloads that arrive in one buffer, read where they lie.

A codec's decode joins its payloads into one buffer, newline-separated, and
scans that (see :func:`connectors.codecs.steps.join`). Payloads that come in
one message (a prediction request's records, sent as the binary tensor data
extension's length-prefixed elements) are already in one buffer: one kernel
pass over the message finds where each starts and ends and whether they are
valid UTF-8, and the scanner reads them there, instead of each becoming a
``bytes`` object to be joined again. :class:`JoinedPayloads` is that view: a
``Sequence[bytes]`` for whoever wants the payloads one by one, and the buffer
with each payload's span for the scanner.

>>> joined = JoinedPayloads.of([b'{"a": 1}', b"", "é".encode()])
>>> len(joined), joined[0], joined[1], list(joined)[2].decode()
(3, b'{"a": 1}', b'', 'é')
>>> joined.starts.tolist(), joined.ends.tolist(), joined.utf8
([0, 9, 10], [8, 9, 12], True)
>>> JoinedPayloads.of([b"\\xff"]).utf8
False
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.codecs.steps import join

__all__ = ["JoinedPayloads", "spans_utf8", "utf8_valid"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class JoinedPayloads(Sequence[bytes]):
    """``n`` payloads in one buffer: payload ``i`` is ``buffer[starts[i]:ends[i]]``;
    ``utf8``: whether every payload is valid UTF-8."""

    __slots__ = ("buffer", "ends", "starts", "utf8")

    def __init__(self, buffer: U8, starts: I64, ends: I64, utf8: bool) -> None:
        self.buffer = buffer
        self.starts = starts
        self.ends = ends
        self.utf8 = utf8

    @classmethod
    def of(cls, payloads: Sequence[bytes]) -> JoinedPayloads:
        """``payloads`` joined by newlines (a test's or a caller's list)."""
        joined, starts, _ = join(payloads, {})
        buffer = np.frombuffer(joined, dtype=np.uint8)
        ends = starts[1:] - 1
        return cls(buffer, starts[:-1], ends, bool(spans_utf8(buffer, starts[:-1], ends)))

    @property
    def lens(self) -> I64:
        """Each payload's length in bytes."""
        lens: I64 = self.ends - self.starts
        return lens

    def __len__(self) -> int:
        return int(self.starts.shape[0])

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
        return self.buffer[self.starts[i] : self.ends[i]].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        buffer = self.buffer
        for a, b in zip(self.starts.tolist(), self.ends.tolist(), strict=True):
            yield buffer[a:b].tobytes()


@nb.njit(nogil=True, cache=True)
def spans_utf8(b: U8, starts: I64, ends: I64) -> bool:
    """Whether every ``b[starts[i]:ends[i]]`` is valid UTF-8; ASCII spans (most JSON)
    are told by one OR over their bytes."""
    for i in range(starts.shape[0]):
        acc = np.uint8(0)
        for k in range(starts[i], ends[i]):
            acc |= b[k]
        if acc >= 0x80 and not utf8_valid(b[starts[i] : ends[i]]):
            return False
    return True


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
