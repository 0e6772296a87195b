"""Payloads joined as they arrive: the UTF-8 check is Python's, the sequence the payloads."""

from __future__ import annotations

import random

import numpy as np

from connectors.codecs.joined import JoinedPayloads, utf8_valid
from connectors.codecs.steps import join

# Sequences at every edge of UTF-8: overlong forms, surrogates, past U+10FFFF, cut short.
PIECES = [
    b"a", b"\x7f", b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc2\x80", b"\xdf\xbf",
    b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xe0\xa0\x80", b"\xed\x9f\xbf", b"\xed\xa0\x80",
    b"\xef\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf0\x90\x80\x80",
    b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xe2\x82",
    b"\xf0\x9f\x98", b"\n",
]  # fmt: skip


def test_utf8_valid_is_pythons_decoder() -> None:
    rng = random.Random(5)
    for _ in range(20_000):
        if rng.random() < 0.7:
            data = b"".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))
        else:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 8)))
        try:
            data.decode("utf-8")
            want = True
        except UnicodeDecodeError:
            want = False
        assert bool(utf8_valid(np.frombuffer(data, np.uint8))) is want, data
        # Spans of a buffer: each checked alone, ASCII ones by their bytes' OR.
        joined = JoinedPayloads.of([b"{}", data, b"\xc3\xa9"])
        assert joined.utf8 is want, data


def test_joined_payloads_are_the_payloads_where_join_puts_them() -> None:
    payloads = [b'{"a": 1}', b"", "é".encode(), b"x" * 300]
    joined = JoinedPayloads.of(payloads)
    want, starts, lens = join(payloads, {})
    assert bytes(joined.buffer) == want
    np.testing.assert_array_equal(joined.starts, starts[:-1])
    np.testing.assert_array_equal(joined.ends, starts[1:] - 1)
    np.testing.assert_array_equal(joined.lens, lens)
    assert list(joined) == payloads
    assert [joined[i] for i in range(-4, 4)] == payloads + payloads
    assert joined[1:3] == payloads[1:3]
    assert len(JoinedPayloads.of([])) == 0
