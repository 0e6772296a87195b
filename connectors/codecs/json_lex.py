"""The JSON scanner's lexing kernels: whitespace, strings, escapes, numbers, literals,
and any value passed over whole.

Each kernel takes the buffer, a position and the end of the record, and answers the
position after what it read, or -1 when the bytes there are not what JSON allows.
They are numba kernels that release the GIL; they return early rather than
``break`` out of loops, because numba compiles the early-return form to faster code
(``benchmarks/decode_micro.py`` shows the scanner's rate).
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from connectors.validate import INT64_MAX

# The bytes JSON gives a meaning to.
QUOTE = ord('"')
BACKSLASH = ord("\\")
SLASH = ord("/")
COLON = ord(":")
COMMA = ord(",")
MINUS = ord("-")
PLUS = ord("+")
DOT = ord(".")
ZERO = ord("0")
ONE = ord("1")
NINE = ord("9")
LOWER_E = ord("e")
UPPER_E = ord("E")
OPEN_OBJECT = ord("{")
CLOSE_OBJECT = ord("}")
OPEN_ARRAY = ord("[")
CLOSE_ARRAY = ord("]")
# A container's closing byte is its opening byte plus this ('{' + 2 == '}', '[' + 2 == ']').
CLOSE_AFTER_OPEN = CLOSE_OBJECT - OPEN_OBJECT
SPACE = ord(" ")
TAB = ord("\t")
NEWLINE = ord("\n")
RETURN = ord("\r")
BACKSPACE = ord("\b")
FORM_FEED = ord("\f")
FIRST_PRINTABLE = 0x20  # the bytes below are control characters, not allowed in strings
LOWER_A, LOWER_F, UPPER_A, UPPER_F = ord("a"), ord("f"), ord("A"), ord("F")
# Escapes: \uXXXX, and the one-letter ones (\b \f \n \r \t stand for a control byte).
ESCAPE_U = ord("u")
ESCAPE_B, ESCAPE_F, ESCAPE_N, ESCAPE_R, ESCAPE_T = (ord(c) for c in "bfnrt")
SIMPLE_ESCAPES = (QUOTE, BACKSLASH, SLASH, ESCAPE_B, ESCAPE_F, ESCAPE_N, ESCAPE_R, ESCAPE_T)
# The first bytes of the literals null, true and false.
LITERAL_N, LITERAL_T, LITERAL_F = ord("n"), ord("t"), ord("f")
# UTF-16 surrogates, which a \u escape may name only as a high-then-low pair.
HIGH_SURROGATE_MIN, HIGH_SURROGATE_MAX = 0xD800, 0xDBFF
LOW_SURROGATE_MIN, LOW_SURROGATE_MAX = 0xDC00, 0xDFFF

NOT_JSON = -1  # a kernel's answer where the bytes are not JSON
SKIP_STALLED = -2  # skip_value's answer when its loop did not move on
MAX_DIGITS = 19  # significant digits a uint64 always holds; later ones are dropped
MAX_EXPONENT_READ = 100_000  # exponent digits past this cannot change the result
POW10 = np.array([10.0**k for k in range(23)])  # 10**22: the largest exact power of ten
TWO53 = np.uint64(1 << 53)
I64_MAX = np.uint64(INT64_MAX)
I64_NEG = np.uint64(1 << 63)

NULL = np.frombuffer(b"null", dtype=np.uint8).copy()
TRUE = np.frombuffer(b"true", dtype=np.uint8).copy()
FALSE = np.frombuffer(b"false", dtype=np.uint8).copy()


@nb.njit(nogil=True, cache=True, inline="always")
def is_digit(c: int) -> bool:
    return ZERO <= c <= NINE


@nb.njit(nogil=True, cache=True, inline="always")
def starts_number(c: int) -> bool:
    return c == MINUS or ZERO <= c <= NINE


@nb.njit(nogil=True, cache=True, inline="always")
def skip_ws(buf: Any, p: int, end: int) -> int:
    """The first position from ``p`` that is not JSON whitespace (or ``end``)."""
    while p < end:
        c = buf[p]
        if c != SPACE and c != TAB and c != NEWLINE and c != RETURN:  # noqa: PLR1714 (numba: no sets)
            return p
        p += 1
    return p


@nb.njit(nogil=True, cache=True, inline="always")
def string(buf: Any, p: int, end: int) -> int:
    """``p`` at an opening quote: the position after the closing one.

    -1 for a control byte or an unterminated string; ``-2 - q`` (with ``q``
    the position after the quote) when the string has escapes, which are
    checked later, by ``escapes_ok``, for the few records that have any: a
    check here would slow the common case.
    """
    p += 1
    esc = False
    while p < end:
        c = buf[p]
        if c == QUOTE:
            return -3 - p if esc else p + 1
        if c == BACKSLASH:
            esc = True
            p += 2
            continue
        if c < FIRST_PRINTABLE:
            return NOT_JSON
        p += 1
    return NOT_JSON


@nb.njit(nogil=True, cache=True, inline="always")
def string_end(buf: Any, p: int, end: int, esc: Any) -> int:
    """``string`` that notes escapes in ``esc[0]``: the position after the string, or -1."""
    q = string(buf, p, end)
    if q < NOT_JSON:
        esc[0] = 1
        return -2 - q
    return q


@nb.njit(nogil=True, cache=True, inline="always")
def hex4(buf: Any, p: int) -> int:
    """The value of the four hex digits at ``p``, or -1."""
    v = 0
    for k in range(4):
        c = buf[p + k]
        if ZERO <= c <= NINE:
            d = c - ZERO
        elif LOWER_A <= c <= LOWER_F:
            d = c - LOWER_A + 10
        elif UPPER_A <= c <= UPPER_F:
            d = c - UPPER_A + 10
        else:
            return -1
        v = v * 16 + d
    return v


@nb.njit(nogil=True, cache=True)
def escapes_ok(buf: Any, p: int, end: int) -> bool:
    """Whether every escape in the strings of a scanned record is valid JSON and UTF-8.

    A lone surrogate (``\\ud800``) is not: UTF-8 cannot hold it (json.loads says so).
    """
    inside = False
    while p < end:
        c = buf[p]
        if c == QUOTE:
            inside = not inside
            p += 1
            continue
        if c != BACKSLASH or not inside:
            p += 1
            continue
        e = buf[p + 1]
        if e in SIMPLE_ESCAPES:
            p += 2
            continue
        if e != ESCAPE_U or p + 6 > end:
            return False
        v = hex4(buf, p + 2)
        if v < 0 or LOW_SURROGATE_MIN <= v <= LOW_SURROGATE_MAX:
            return False
        if HIGH_SURROGATE_MIN <= v <= HIGH_SURROGATE_MAX:
            if p + 12 > end or buf[p + 6] != BACKSLASH or buf[p + 7] != ESCAPE_U:
                return False
            w = hex4(buf, p + 8)
            if not LOW_SURROGATE_MIN <= w <= LOW_SURROGATE_MAX:
                return False
            p += 12
        else:
            p += 6
    return True


@nb.njit(nogil=True, cache=True, inline="always")
def number(buf: Any, p: int, end: int) -> tuple[int, bool, bool, np.uint64, int, bool]:
    """A JSON number at ``p``: (end or -1, is an int, negative, digits, exponent, exact).

    The value is ``digits * 10**exponent``; ``exact`` is false when there were
    more than 19 significant digits (the later ones were dropped).
    """
    neg = False
    w = np.uint64(0)
    if p < end and buf[p] == MINUS:
        neg = True
        p += 1
    if p >= end:
        return NOT_JSON, False, neg, w, 0, False
    nd = 0
    e10 = 0
    exact = True
    is_int = True
    c = buf[p]
    if c == ZERO:
        p += 1
        if p < end and is_digit(buf[p]):
            return NOT_JSON, False, neg, w, 0, False  # a leading zero
    elif ONE <= c <= NINE:
        while p < end and is_digit(buf[p]):
            if nd < MAX_DIGITS:
                w = w * np.uint64(10) + np.uint64(buf[p] - ZERO)
                nd += 1
            else:
                e10 += 1
                exact = False
            p += 1
    else:
        return NOT_JSON, False, neg, w, 0, False
    if p < end and buf[p] == DOT:
        is_int = False
        p += 1
        if p >= end or not is_digit(buf[p]):
            return NOT_JSON, False, neg, w, 0, False
        while p < end and is_digit(buf[p]):
            d = buf[p] - ZERO
            if nd < MAX_DIGITS:
                if w > np.uint64(0) or d > 0:
                    nd += 1
                w = w * np.uint64(10) + np.uint64(d)
                e10 -= 1
            elif d != 0:
                exact = False
            p += 1
    if p < end and (buf[p] == LOWER_E or buf[p] == UPPER_E):
        is_int = False
        p += 1
        sign = 1
        if p < end and (buf[p] == PLUS or buf[p] == MINUS):
            if buf[p] == MINUS:
                sign = -1
            p += 1
        if p >= end or not is_digit(buf[p]):
            return NOT_JSON, False, neg, w, 0, False
        ex = 0
        while p < end and is_digit(buf[p]):
            if ex < MAX_EXPONENT_READ:
                ex = ex * 10 + (buf[p] - ZERO)
            p += 1
        e10 += sign * ex
    return p, is_int, neg, w, e10, exact


@nb.njit(nogil=True, cache=True, inline="always")
def exact_float(neg: bool, w: np.uint64, e10: int, exact: bool) -> tuple[bool, float]:
    """``digits * 10**e10`` when one IEEE operation rounds it correctly (Clinger's fast path)."""
    if not exact:
        return False, 0.0
    if w == np.uint64(0):
        return True, -0.0 if neg else 0.0
    if w > TWO53 or e10 > 22 or e10 < -22:
        return False, 0.0
    v = float(w)
    v = v * POW10[e10] if e10 >= 0 else v / POW10[-e10]
    return True, -v if neg else v


@nb.njit(nogil=True, cache=True, inline="always")
def int64(neg: bool, w: np.uint64) -> tuple[bool, Any]:
    """The int64 of sign ``neg`` and magnitude ``w``, and whether it fits."""
    if neg:
        if w > I64_NEG:
            return False, 0
        if w == np.uint64(0):
            return True, 0
        return True, -np.int64(w - np.uint64(1)) - 1
    if w > I64_MAX:
        return False, 0
    return True, np.int64(w)


@nb.njit(nogil=True, cache=True, inline="always")
def literal(buf: Any, p: int, end: int, word: Any) -> int:
    """The position after ``word`` at ``p``, or -1."""
    k: int = word.shape[0]
    if p + k > end:
        return NOT_JSON
    for j in range(k):
        if buf[p + j] != word[j]:
            return NOT_JSON
    return p + k


@nb.njit(nogil=True, cache=True, inline="always")
def object_key(buf: Any, p: int, end: int, esc: Any) -> int:
    """From a key's opening quote at ``p``: the position after its ``:``, or -1."""
    if p >= end or buf[p] != QUOTE:
        return NOT_JSON
    p = string_end(buf, p, end, esc)
    if p < 0:
        return NOT_JSON
    p = skip_ws(buf, p, end)
    if p >= end or buf[p] != COLON:
        return NOT_JSON
    return p + 1


@nb.njit(nogil=True, cache=True)
def skip_value(buf: Any, p: int, end: int, stack: Any, esc: Any) -> int:
    """Check and pass over any JSON value at ``p`` (an unknown key's); -1 if it is not
    JSON, ``SKIP_STALLED`` if a loop did not move on.

    Sets ``esc[0]`` when a string in it has escapes; ``stack`` holds the open containers.
    """
    depth = 0
    last = p - 1
    while True:
        p = skip_ws(buf, p, end)
        if p <= last:
            return SKIP_STALLED
        last = p
        if p >= end:
            return NOT_JSON
        c = buf[p]
        if c == OPEN_OBJECT or c == OPEN_ARRAY:  # noqa: PLR1714, SIM109 (numba: no sets)
            if depth >= stack.shape[0]:
                return NOT_JSON
            stack[depth] = c
            depth += 1
            p = skip_ws(buf, p + 1, end)
            if p < end and buf[p] == c + CLOSE_AFTER_OPEN:
                depth -= 1
                p += 1
            elif c == OPEN_OBJECT:
                p = object_key(buf, p, end, esc)
                if p < 0:
                    return NOT_JSON
                continue
            else:
                continue
        elif c == QUOTE:
            p = string_end(buf, p, end, esc)
        elif starts_number(c):
            p, _, _, _, _, _ = number(buf, p, end)
        elif c == LITERAL_T:
            p = literal(buf, p, end, TRUE)
        elif c == LITERAL_F:
            p = literal(buf, p, end, FALSE)
        elif c == LITERAL_N:
            p = literal(buf, p, end, NULL)
        else:
            return NOT_JSON
        if p < 0:
            return NOT_JSON
        # After a value: close containers, or go on to the next value.
        more = False
        while depth > 0 and not more:
            p = skip_ws(buf, p, end)
            if p >= end:
                return NOT_JSON
            c = buf[p]
            top = stack[depth - 1]
            if c == top + CLOSE_AFTER_OPEN:
                depth -= 1
                p += 1
            elif c == COMMA:
                p += 1
                more = True
                if top == OPEN_OBJECT:
                    p = object_key(buf, skip_ws(buf, p, end), end, esc)
                    if p < 0:
                        return NOT_JSON
            else:
                return NOT_JSON
        if not more:
            return p


@nb.njit(nogil=True, cache=True, inline="always")
def _utf8(v: int, data: Any, o: int) -> int:
    """Write code point ``v`` as UTF-8 at ``data[o:]``; the position after it."""
    if v < 0x80:
        data[o] = v
        return o + 1
    if v < 0x800:
        data[o] = 0xC0 | (v >> 6)
        data[o + 1] = 0x80 | (v & 0x3F)
        return o + 2
    if v < 0x10000:
        data[o] = 0xE0 | (v >> 12)
        data[o + 1] = 0x80 | ((v >> 6) & 0x3F)
        data[o + 2] = 0x80 | (v & 0x3F)
        return o + 3
    data[o] = 0xF0 | (v >> 18)
    data[o + 1] = 0x80 | ((v >> 12) & 0x3F)
    data[o + 2] = 0x80 | ((v >> 6) & 0x3F)
    data[o + 3] = 0x80 | (v & 0x3F)
    return o + 4


@nb.njit(nogil=True, cache=True)
def unescape(buf: Any, s: int, e: int, data: Any, o: int) -> int:
    """Decode the escaped string bytes ``buf[s:e]`` (already checked) into ``data[o:]``;
    returns the position in ``data`` after them."""
    p = s
    while p < e:
        c = buf[p]
        if c != BACKSLASH:
            data[o] = c
            o += 1
            p += 1
            continue
        x = buf[p + 1]
        if x != ESCAPE_U:
            # \b \f \n \r \t, or the character itself (\" \\ \/).
            if x == ESCAPE_B:
                data[o] = BACKSPACE
            elif x == ESCAPE_F:
                data[o] = FORM_FEED
            elif x == ESCAPE_N:
                data[o] = NEWLINE
            elif x == ESCAPE_R:
                data[o] = RETURN
            elif x == ESCAPE_T:
                data[o] = TAB
            else:
                data[o] = x
            o += 1
            p += 2
            continue
        v = hex4(buf, p + 2)
        p += 6
        if HIGH_SURROGATE_MIN <= v <= HIGH_SURROGATE_MAX:
            low = hex4(buf, p + 2) - LOW_SURROGATE_MIN
            v = 0x10000 + ((v - HIGH_SURROGATE_MIN) << 10) + low
            p += 6
        o = _utf8(v, data, o)
    return o


@nb.njit(nogil=True, cache=True)
def unescaped_length(buf: Any, s: int, e: int) -> int:
    """The UTF-8 length of the escaped string bytes ``buf[s:e]`` (already checked)."""
    p = s
    n = 0
    while p < e:
        if buf[p] != BACKSLASH:
            n += 1
            p += 1
        elif buf[p + 1] != ESCAPE_U:
            n += 1
            p += 2
        else:
            v = hex4(buf, p + 2)
            p += 6
            if HIGH_SURROGATE_MIN <= v <= HIGH_SURROGATE_MAX:
                n += 4
                p += 6
            else:
                n += 1 if v < 0x80 else 2 if v < 0x800 else 3
    return n
