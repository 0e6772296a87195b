"""The JSON scanner: numba kernels that read a chunk of JSON lines into Arrow columns.

:func:`scan_json` is the default engine of :class:`~connectors.codecs.JsonLinesCodec`.
In one pass over the joined payloads it reads every record that is a JSON object
whose spec fields hold values of the right type, and leaves any other record
(status 1) to ``json.loads``, which names the problem. Its kernels release the
GIL, and they return early rather than ``break`` out of loops: numba compiles
the early-return form several times faster.

Why a hand-written JSON scanner rather than a library: measured against
well-kept libraries, each put in the scanner's place with the rest
of ``JsonLinesCodec.decode`` unchanged, and each checked to give the scanner's
good table and bad records on the timed records and on awkward ones. Events
per second on 100,000 Criteo-like records (590 bytes each) in one chunk; "1%
bad" has one record in 100 bad (a string label, or a truncated payload)::

    reader                              clean   vs scanner    1% bad   vs scanner
    scanner (numba, the default)      411-438k     1.00      386-394k     1.00
    pyarrow.json, engine="arrow"      240-251k     0.57-0.58  82-91k      0.21-0.24
    pyarrow.json, whole chunk [1]     235-242k     0.55-0.57  29-30k      0.07-0.08
    orjson 3.13 per record [2]        100-105k     0.24       84-96k      0.21-0.25
    pysimdjson 7.0 per record [2]      73-74k      0.17-0.18  70-71k      0.18
    json.loads loop, fewer checks      75-104k     0.18-0.24

    [1] a chunk that fails goes record by record to json.loads
    [2] spec fields by itemgetter, columns by pyarrow.array; neither library
        reports a spec key given twice (duplicate_field), as the scanner does

2-core machine shared with other work, one core, best of 7 round-robin runs,
two runs (the ranges): ``python benchmarks/decode_micro.py --repeats 7``
(``pip install -e ".[bench]"`` for orjson and pysimdjson). No library comes
within 10% of the scanner, so it stays; per-record libraries pay Python's
per-record and per-value costs, which the scanner's single pass does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from connectors.spec import FeatureSpec, SparseField
from connectors.validate import INT64_MAX

_K_FLOAT, _K_STRING, _K_INT, _K_LIST_STRING, _K_LIST_INT = 0, 1, 2, 3, 4
_KINDS = {
    "string": _K_STRING,
    "int": _K_INT,
    "list_string": _K_LIST_STRING,
    "list_int": _K_LIST_INT,
}
_QUOTE, _BACKSLASH = 34, 92
_SIMPLE_ESCAPES = (34, 92, 47, 98, 102, 110, 114, 116)  # \" \\ \/ \b \f \n \r \t
_MAX_DEPTH = 64  # nesting of skipped values; deeper records go to json.loads
_POW10 = np.array([10.0**k for k in range(23)])
_TWO53 = np.uint64(1 << 53)
_I64_MAX = np.uint64(INT64_MAX)
_I64_NEG = np.uint64(1 << 63)
_FNV_OFFSET, _FNV_PRIME = 14695981039346656037, 1099511628211
# What ``_scan_record`` answers besides a record's status (0 read, 1 left to json.loads):
# out of room for list elements (it is read again with more), or stalled.
_OUT_OF_ROOM = 2
# A loop over a record's bytes that did not move on: the scan ends there and names the
# record (``ScanStalled``). Every such loop checks that its position advanced, so a
# fault in the scanner surfaces as this refusal rather than as a core spinning forever.
STALLED = 3
_SKIP_STALLED = -2  # _skip_value's form of it (-1: not JSON)


@nb.njit(nogil=True, cache=True, inline="always")
def _ws(buf: Any, p: int, end: int) -> int:
    while p < end:
        c = buf[p]
        if c != 32 and c != 9 and c != 10 and c != 13:  # noqa: PLR1714 (numba: no sets)
            return p
        p += 1
    return p


@nb.njit(nogil=True, cache=True, inline="always")
def _string(buf: Any, p: int, end: int) -> int:
    """``p`` at an opening quote: the position after the closing one.

    -1 for a control byte or an unterminated string; ``-2 - q`` (with ``q``
    the position after the quote) when the string has escapes, which are
    checked later, by ``_escapes_ok``, for the few records that have any: a
    check here would slow the common case.
    """
    p += 1
    esc = False
    while p < end:
        c = buf[p]
        if c == _QUOTE:
            return -3 - p if esc else p + 1
        if c == _BACKSLASH:
            esc = True
            p += 2
            continue
        if c < 32:
            return -1
        p += 1
    return -1


@nb.njit(nogil=True, cache=True, inline="always")
def _string_end(buf: Any, p: int, end: int, esc: Any) -> int:
    """``_string`` that notes escapes in ``esc[0]``: the position after the string, or -1."""
    q = _string(buf, p, end)
    if q < -1:
        esc[0] = 1
        return -2 - q
    return q


@nb.njit(nogil=True, cache=True, inline="always")
def _hex4(buf: Any, p: int) -> int:
    v = 0
    for k in range(4):
        c = buf[p + k]
        if 48 <= c <= 57:
            d = c - 48
        elif 97 <= c <= 102:
            d = c - 87
        elif 65 <= c <= 70:
            d = c - 55
        else:
            return -1
        v = v * 16 + d
    return v


@nb.njit(nogil=True, cache=True)
def _escapes_ok(buf: Any, p: int, end: int) -> bool:
    """Whether every escape in the strings of a scanned record is valid JSON and UTF-8.

    A lone surrogate (``\\ud800``) is not: UTF-8 cannot hold it (json.loads says so).
    """
    inside = False
    while p < end:
        c = buf[p]
        if c == _QUOTE:
            inside = not inside
            p += 1
            continue
        if c != _BACKSLASH or not inside:
            p += 1
            continue
        e = buf[p + 1]
        if e in _SIMPLE_ESCAPES:
            p += 2
            continue
        if e != 117 or p + 6 > end:  # not \uXXXX
            return False
        v = _hex4(buf, p + 2)
        if v < 0 or 0xDC00 <= v <= 0xDFFF:
            return False
        if 0xD800 <= v <= 0xDBFF:
            if p + 12 > end or buf[p + 6] != _BACKSLASH or buf[p + 7] != 117:
                return False
            w = _hex4(buf, p + 8)
            if not 0xDC00 <= w <= 0xDFFF:
                return False
            p += 12
        else:
            p += 6
    return True


@nb.njit(nogil=True, cache=True, inline="always")
def _number(buf: Any, p: int, end: int) -> tuple[int, bool, bool, np.uint64, int, bool]:
    """A JSON number at ``p``: (end or -1, is an int, negative, digits, exponent, exact).

    The value is ``digits * 10**exponent``; ``exact`` is false when there were
    more than 19 significant digits (the later ones were dropped).
    """
    neg = False
    w = np.uint64(0)
    if p < end and buf[p] == 45:
        neg = True
        p += 1
    if p >= end:
        return -1, False, neg, w, 0, False
    nd = 0
    e10 = 0
    exact = True
    is_int = True
    c = buf[p]
    if c == 48:
        p += 1
        if p < end and 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False  # a leading zero
    elif 49 <= c <= 57:
        while p < end and 48 <= buf[p] <= 57:
            if nd < 19:
                w = w * np.uint64(10) + np.uint64(buf[p] - 48)
                nd += 1
            else:
                e10 += 1
                exact = False
            p += 1
    else:
        return -1, False, neg, w, 0, False
    if p < end and buf[p] == 46:
        is_int = False
        p += 1
        if p >= end or not 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False
        while p < end and 48 <= buf[p] <= 57:
            d = buf[p] - 48
            if nd < 19:
                if w > np.uint64(0) or d > 0:
                    nd += 1
                w = w * np.uint64(10) + np.uint64(d)
                e10 -= 1
            elif d != 0:
                exact = False
            p += 1
    if p < end and (buf[p] == 101 or buf[p] == 69):
        is_int = False
        p += 1
        sign = 1
        if p < end and (buf[p] == 43 or buf[p] == 45):
            if buf[p] == 45:
                sign = -1
            p += 1
        if p >= end or not 48 <= buf[p] <= 57:
            return -1, False, neg, w, 0, False
        ex = 0
        while p < end and 48 <= buf[p] <= 57:
            if ex < 100000:
                ex = ex * 10 + (buf[p] - 48)
            p += 1
        e10 += sign * ex
    return p, is_int, neg, w, e10, exact


@nb.njit(nogil=True, cache=True, inline="always")
def _exact_float(neg: bool, w: np.uint64, e10: int, exact: bool) -> tuple[bool, float]:
    """``digits * 10**e10`` when one IEEE operation rounds it correctly (Clinger's fast path)."""
    if not exact:
        return False, 0.0
    if w == np.uint64(0):
        return True, -0.0 if neg else 0.0
    if w > _TWO53 or e10 > 22 or e10 < -22:
        return False, 0.0
    v = float(w)
    v = v * _POW10[e10] if e10 >= 0 else v / _POW10[-e10]
    return True, -v if neg else v


@nb.njit(nogil=True, cache=True, inline="always")
def _int64(neg: bool, w: np.uint64) -> tuple[bool, Any]:
    if neg:
        if w > _I64_NEG:
            return False, 0
        if w == np.uint64(0):
            return True, 0
        return True, -np.int64(w - np.uint64(1)) - 1
    if w > _I64_MAX:
        return False, 0
    return True, np.int64(w)


@nb.njit(nogil=True, cache=True, inline="always")
def _literal(buf: Any, p: int, end: int, word: Any) -> int:
    """The position after ``word`` at ``p``, or -1."""
    k: int = word.shape[0]
    if p + k > end:
        return -1
    for j in range(k):
        if buf[p + j] != word[j]:
            return -1
    return p + k


_NULL = np.frombuffer(b"null", dtype=np.uint8).copy()
_TRUE = np.frombuffer(b"true", dtype=np.uint8).copy()
_FALSE = np.frombuffer(b"false", dtype=np.uint8).copy()


@nb.njit(nogil=True, cache=True, inline="always")
def _object_key(buf: Any, p: int, end: int, esc: Any) -> int:
    """From a key's opening quote at ``p``: the position after its ``:``, or -1."""
    if p >= end or buf[p] != _QUOTE:
        return -1
    p = _string_end(buf, p, end, esc)
    if p < 0:
        return -1
    p = _ws(buf, p, end)
    if p >= end or buf[p] != 58:  # ':'
        return -1
    return p + 1


@nb.njit(nogil=True, cache=True)
def _skip_value(buf: Any, p: int, end: int, stack: Any, esc: Any) -> int:
    """Check and pass over any JSON value at ``p`` (an unknown key's); -1 if it is not JSON.

    Sets ``esc[0]`` when a string in it has escapes.
    """
    depth = 0
    last = p - 1
    while True:
        p = _ws(buf, p, end)
        if p <= last:
            return _SKIP_STALLED
        last = p
        if p >= end:
            return -1
        c = buf[p]
        if c == 123 or c == 91:  # noqa: PLR1714 ({ or [)
            if depth >= stack.shape[0]:
                return -1
            stack[depth] = c
            depth += 1
            p = _ws(buf, p + 1, end)
            if p < end and buf[p] == c + 2:  # } or ]
                depth -= 1
                p += 1
            elif c == 123:
                p = _object_key(buf, p, end, esc)
                if p < 0:
                    return -1
                continue
            else:
                continue
        elif c == _QUOTE:
            p = _string_end(buf, p, end, esc)
        elif c == 45 or 48 <= c <= 57:
            p, _, _, _, _, _ = _number(buf, p, end)
        elif c == 116:
            p = _literal(buf, p, end, _TRUE)
        elif c == 102:
            p = _literal(buf, p, end, _FALSE)
        elif c == 110:
            p = _literal(buf, p, end, _NULL)
        else:
            return -1
        if p < 0:
            return -1
        # After a value: close containers, or go on to the next value.
        more = False
        while depth > 0 and not more:
            p = _ws(buf, p, end)
            if p >= end:
                return -1
            c = buf[p]
            top = stack[depth - 1]
            if c == top + 2:  # the matching } or ]
                depth -= 1
                p += 1
            elif c == 44:
                p += 1
                more = True
                if top == 123:
                    p = _object_key(buf, _ws(buf, p, end), end, esc)
                    if p < 0:
                        return -1
            else:
                return -1
        if not more:
            return p


@nb.njit(nogil=True, cache=True, inline="always")
def _field_of(buf: Any, s: int, e: int, keys: Any, key_off: Any, table: Any, mask: int) -> int:
    """The spec field named by the key bytes ``buf[s:e]``, or -1 (FNV-1a, linear probing)."""
    h = np.uint64(_FNV_OFFSET)
    for k in range(s, e):
        h = (h ^ np.uint64(buf[k])) * np.uint64(_FNV_PRIME)
    slot = np.int64(h & np.uint64(mask))
    for _ in range(mask + 1):  # the table always has empty slots; bounded all the same
        f: int = table[slot]
        if f < 0:
            return -1
        if _same(buf, s, e, keys, key_off[f], key_off[f + 1]):
            return f
        slot = (slot + 1) & mask
    return -1


@nb.njit(nogil=True, cache=True, inline="always")
def _same(buf: Any, s: int, e: int, keys: Any, ks: int, ke: int) -> bool:
    if ke - ks != e - s:
        return False
    for k in range(e - s):  # noqa: SIM110 (numba compiles loops, not generators)
        if keys[ks + k] != buf[s + k]:
            return False
    return True


@nb.njit(nogil=True, cache=True)
def _scan_record(
    buf: Any, p: int, end: int, i: int, kind: Any, slot: Any, keys: Any, key_off: Any,
    table: Any, mask: int, seen: Any, stack: Any, fval: Any, fstate: Any, fspan: Any,
    ival: Any, istate: Any, sspan: Any, sstate: Any, lfirst: Any, lcount: Any, lstate: Any,
    lints: Any, lstrs: Any, used: Any, esc: Any,
) -> int:  # fmt: skip
    """Read record ``i`` (bytes ``p..end``): 0 when read, 1 to leave it, ``_OUT_OF_ROOM``
    when out of list room, ``STALLED`` when a loop did not move on.

    Sets ``esc[0]`` when a string in the record has escapes (unchecked so far).
    """
    p = _ws(buf, p, end)
    if p >= end or buf[p] != 123:
        return 1
    p = _ws(buf, p + 1, end)
    if p < end and buf[p] == 125:
        return 0 if _ws(buf, p + 1, end) == end else 1
    while True:
        if p >= end or buf[p] != _QUOTE:
            return 1
        q = _string(buf, p, end)
        if q < 0:
            return 1  # keys with escapes are left to json.loads
        f = _field_of(buf, p + 1, q - 1, keys, key_off, table, mask)
        if q <= p:
            return STALLED
        p = _ws(buf, q, end)
        if p >= end or buf[p] != 58:
            return 1
        p = _ws(buf, p + 1, end)
        if p >= end:
            return 1
        if f < 0:
            p = _skip_value(buf, p, end, stack, esc)
            if p < 0:
                return STALLED if p == _SKIP_STALLED else 1
        else:
            if seen[f] == i:
                return 1  # a spec key twice
            seen[f] = i
            k = kind[f]
            j = slot[f]
            c = buf[p]
            if c == 110:
                p = _literal(buf, p, end, _NULL)
                if p < 0:
                    return 1
            elif k == _K_FLOAT:
                if c != 45 and not 48 <= c <= 57:
                    return 1
                q, _, neg, w, e10, exact = _number(buf, p, end)
                if q < 0:
                    return 1
                good, v = _exact_float(neg, w, e10, exact)
                if good:
                    fval[i, j] = v
                    fstate[i, j] = 1
                else:
                    fspan[i, j, 0] = p
                    fspan[i, j, 1] = q
                    fstate[i, j] = 2
                p = q
            elif k == _K_STRING:
                if c != _QUOTE:
                    return 1
                q = _string(buf, p, end)
                if q == -1:
                    return 1
                if q < -1:
                    q = -2 - q
                    esc[0] = 1
                    sstate[i, j] = 2
                else:
                    sstate[i, j] = 1
                sspan[i, j, 0] = p + 1
                sspan[i, j, 1] = q - 1
                p = q
            elif k == _K_INT:
                if c != 45 and not 48 <= c <= 57:
                    return 1
                q, is_int, neg, w, _, exact = _number(buf, p, end)
                if q < 0 or not is_int or not exact:
                    return 1
                fits, v = _int64(neg, w)
                if not fits:
                    return 1
                ival[i, j] = v
                istate[i, j] = 1
                p = q
            else:
                if c != 91:
                    return 1
                p = _ws(buf, p + 1, end)
                first = used[0] if k == _K_LIST_INT else used[1]
                count = 0
                if p < end and buf[p] == 93:
                    p += 1
                else:
                    while True:
                        if p >= end:
                            return 1
                        c = buf[p]
                        if k == _K_LIST_INT:
                            if c != 45 and not 48 <= c <= 57:
                                return 1
                            q, is_int, neg, w, _, exact = _number(buf, p, end)
                            if q < 0 or not is_int or not exact:
                                return 1
                            fits, v = _int64(neg, w)
                            if not fits:
                                return 1
                            if used[0] >= lints.shape[0]:
                                return _OUT_OF_ROOM
                            lints[used[0]] = v
                            used[0] += 1
                        else:
                            if c != _QUOTE:
                                return 1
                            q = _string(buf, p, end)
                            if q == -1:
                                return 1
                            if used[1] >= lstrs.shape[0]:
                                return _OUT_OF_ROOM
                            lstrs[used[1], 2] = 0
                            if q < -1:
                                q = -2 - q
                                esc[0] = 1
                                lstrs[used[1], 2] = 1
                            lstrs[used[1], 0] = p + 1
                            lstrs[used[1], 1] = q - 1
                            used[1] += 1
                        count += 1
                        if q <= p:
                            return STALLED
                        p = _ws(buf, q, end)
                        if p < end and buf[p] == 44:
                            p = _ws(buf, p + 1, end)
                        elif p < end and buf[p] == 93:
                            p += 1
                            break
                        else:
                            return 1
                lfirst[i, j] = first
                lcount[i, j] = count
                lstate[i, j] = 1
        p = _ws(buf, p, end)
        if p < end and buf[p] == 44:
            p = _ws(buf, p + 1, end)
        elif p < end and buf[p] == 125:
            return 0 if _ws(buf, p + 1, end) == end else 1
        else:
            return 1


@nb.njit(nogil=True, cache=True)
def _scan_records(
    buf: Any, starts: Any, ends: Any, skip: Any, kind: Any, slot: Any, keys: Any, key_off: Any,
    table: Any, mask: int, status: Any, fval: Any, fstate: Any, fspan: Any, ival: Any,
    istate: Any, sspan: Any, sstate: Any, lfirst: Any, lcount: Any, lstate: Any,
    lints: Any, lstrs: Any,
) -> tuple[Any, Any, int]:  # fmt: skip
    """Scan every record not skipped (record ``i`` is ``buf[starts[i]:ends[i]]``);
    returns the list element stores and the first record the scan stalled on (-1:
    none; the scan ends there, that record's status ``STALLED``)."""
    n = ends.shape[0]
    seen = np.full(kind.shape[0], -1, np.int64)
    stack = np.empty(_MAX_DEPTH, np.int64)  # open containers of a skipped value
    used = np.zeros(2, np.int64)
    esc = np.zeros(1, np.int64)
    for i in range(n):
        if skip[i]:
            status[i] = 2
            continue
        # A record holds at most one list element per two of its bytes ("1,"): a store
        # with that much room past its use cannot run out, so each read of the record
        # again follows a store's growth past its capacity, and at most
        # log2(record bytes) of them are needed.
        need = (ends[i] - starts[i]) // 2 + 1
        while True:
            before0, before1 = used[0], used[1]
            esc[0] = 0
            r = _scan_record(
                buf, starts[i], ends[i], i, kind, slot, keys, key_off, table, mask,
                seen, stack, fval, fstate, fspan, ival, istate, sspan, sstate, lfirst, lcount,
                lstate, lints, lstrs, used, esc,
            )  # fmt: skip
            if r == 0 and esc[0] and not _escapes_ok(buf, starts[i], ends[i]):
                r = 1
            if r != _OUT_OF_ROOM:
                break
            full_ints, full_strs = used[0] >= lints.shape[0], used[1] >= lstrs.shape[0]
            used[0], used[1] = before0, before1
            seen[:] = -1
            roomy = lints.shape[0] - before0 >= need and lstrs.shape[0] - before1 >= need
            if roomy or not (full_ints or full_strs):
                status[i] = STALLED
                return lints, lstrs, i
            # Out of room for list elements: double the store that filled, read the record again.
            if full_ints:
                lints = np.concatenate((lints, np.empty(max(lints.shape[0], 1024), np.int64)))
            if full_strs:
                grown = np.empty((max(lstrs.shape[0], 1024), 3), np.int64)
                lstrs = np.concatenate((lstrs, grown))
        if r == STALLED:
            status[i] = STALLED
            return lints, lstrs, i
        status[i] = r
    return lints, lstrs, -1


@nb.njit(nogil=True, cache=True)
def _unescape(buf: Any, s: int, e: int, data: Any, o: int) -> int:
    """Decode the escaped string bytes ``buf[s:e]`` (already checked) into ``data[o:]``."""
    p = s
    while p < e:
        c = buf[p]
        if c != _BACKSLASH:
            data[o] = c
            o += 1
            p += 1
            continue
        x = buf[p + 1]
        if x != 117:
            # \b \f \n \r \t, or the character itself (\" \\ \/).
            if x == 98:
                data[o] = 8
            elif x == 102:
                data[o] = 12
            elif x == 110:
                data[o] = 10
            elif x == 114:
                data[o] = 13
            elif x == 116:
                data[o] = 9
            else:
                data[o] = x
            o += 1
            p += 2
            continue
        v = _hex4(buf, p + 2)
        p += 6
        if 0xD800 <= v <= 0xDBFF:
            v = 0x10000 + ((v - 0xD800) << 10) + (_hex4(buf, p + 2) - 0xDC00)
            p += 6
        if v < 0x80:
            data[o] = v
            o += 1
        elif v < 0x800:
            data[o] = 0xC0 | (v >> 6)
            data[o + 1] = 0x80 | (v & 0x3F)
            o += 2
        elif v < 0x10000:
            data[o] = 0xE0 | (v >> 12)
            data[o + 1] = 0x80 | ((v >> 6) & 0x3F)
            data[o + 2] = 0x80 | (v & 0x3F)
            o += 3
        else:
            data[o] = 0xF0 | (v >> 18)
            data[o + 1] = 0x80 | ((v >> 12) & 0x3F)
            data[o + 2] = 0x80 | ((v >> 6) & 0x3F)
            data[o + 3] = 0x80 | (v & 0x3F)
            o += 4
    return o


@nb.njit(nogil=True, cache=True)
def _unescaped_length(buf: Any, s: int, e: int) -> int:
    """The UTF-8 length of the escaped string bytes ``buf[s:e]`` (already checked)."""
    p = s
    n = 0
    while p < e:
        if buf[p] != _BACKSLASH:
            n += 1
            p += 1
        elif buf[p + 1] != 117:
            n += 1
            p += 2
        else:
            v = _hex4(buf, p + 2)
            p += 6
            if 0xD800 <= v <= 0xDBFF:
                n += 4
                p += 6
            else:
                n += 1 if v < 0x80 else 2 if v < 0x800 else 3
    return n


@nb.njit(nogil=True, cache=True)
def _string_offsets(span: Any, state: Any, rows: Any, buf: Any) -> tuple[Any, Any, Any]:
    """Where each string goes: per-column offsets, each column's base in one buffer, and
    ``dest[k, j]``, the position of row ``rows[k]``'s string of column ``j`` in that buffer.

    Lengths are decoded ones (escapes shrink a string).
    """
    m = rows.shape[0]
    ns = state.shape[1]
    totals = np.zeros(ns, np.int64)
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            st = state[r, j]
            if st == 1:
                totals[j] += span[r, j, 1] - span[r, j, 0]
            elif st == 2:
                totals[j] += _unescaped_length(buf, span[r, j, 0], span[r, j, 1])
    base = np.zeros(ns + 1, np.int64)
    for j in range(ns):
        base[j + 1] = base[j] + totals[j]
    if ns and totals.max() >= 1 << 31:
        # Beyond Arrow's int32 string offsets: the caller raises.
        return np.zeros((0, 0), np.int32), base, np.zeros((0, 0), np.int64)
    offsets = np.zeros((ns, m + 1), np.int32)
    dest = np.empty((m, ns), np.int64)
    cur = base[:ns].copy()
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            dest[k, j] = cur[j]
            st = state[r, j]
            if st == 1:
                cur[j] += span[r, j, 1] - span[r, j, 0]
            elif st == 2:
                cur[j] += _unescaped_length(buf, span[r, j, 0], span[r, j, 1])
            offsets[j, k + 1] = cur[j] - base[j]
    return offsets, base, dest


@nb.njit(nogil=True, cache=True)
def _copy_strings(buf: Any, span: Any, state: Any, rows: Any, dest: Any, data: Any) -> None:
    """Copy (decoding escapes) ``span[r, j]`` to ``data[dest[k, j]:]``, row by row.

    Walking the records in order, all columns at once, reads the source buffer once.
    """
    m = rows.shape[0]
    ns = state.shape[1]
    for k in range(m):
        r = rows[k]
        for j in range(ns):
            st = state[r, j]
            if st == 1:
                s = span[r, j, 0]
                o = dest[k, j]
                for q in range(span[r, j, 1] - s):
                    data[o + q] = buf[s + q]
            elif st == 2:
                _unescape(buf, span[r, j, 0], span[r, j, 1], data, dest[k, j])


def _gather(
    buf: npt.NDArray[np.uint8],
    span: npt.NDArray[np.int64],
    state: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.int64],
) -> list[pa.Array]:
    """String columns from spans: column ``j`` holds ``span[r, j]`` for each row ``r`` of ``rows``.

    ``state[r, j]`` is 0 for null, 1 for plain bytes, 2 for a JSON string with escapes.
    """
    offsets, base, dest = _string_offsets(span, state, rows, buf)
    ns = state.shape[1]
    if offsets.shape[0] != ns:
        msg = "a string column of this chunk holds 2 GiB or more: read smaller chunks"
        raise ValueError(msg)
    data = np.empty(int(base[-1]), dtype=np.uint8)
    _copy_strings(buf, span, state, rows, dest, data)
    valid = state[rows] > 0
    return [_string_array(offsets[j], data[base[j] : base[j + 1]], valid[:, j]) for j in range(ns)]


def _key_table(
    names: Sequence[str],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
    """The spec's keys for ``_field_of``: bytes, offsets, an open-addressing table and its mask."""
    encoded = [name.encode() for name in names]
    keys = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    key_off = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in encoded], out=key_off[1:])
    size = 1 << max(4, (4 * len(names)).bit_length())
    table = np.full(size, -1, dtype=np.int64)
    for f, key in enumerate(encoded):
        h = _FNV_OFFSET
        for byte in key:
            h = ((h ^ byte) * _FNV_PRIME) & 0xFFFF_FFFF_FFFF_FFFF
        slot = h & (size - 1)
        while table[slot] >= 0:
            slot = (slot + 1) & (size - 1)
        table[slot] = f
    return keys, key_off, table, size - 1


def _string_array(
    offsets: npt.NDArray[np.int32], data: npt.NDArray[np.uint8], valid: npt.NDArray[np.bool_]
) -> pa.Array:
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.string(), valid.shape[0], buffers)


class ScanStalled(RuntimeError):
    """The scan of a chunk ended because a kernel's loop did not move on in one record.

    A defect of the scanner, never of the input: it is raised rather than spinning
    forever, with the record's index in the chunk and its bytes.

    >>> print(ScanStalled(3, b'{"a": 1}'))  # doctest: +ELLIPSIS
    the JSON scanner made no progress in record 3 of the chunk (8 bytes: b'{"a": 1}'); ...
    """

    def __init__(self, record: int, payload: bytes) -> None:
        self.record = record
        self.payload = payload
        shown = payload if len(payload) <= 200 else payload[:200] + b"..."
        super().__init__(
            f"the JSON scanner made no progress in record {record} of the chunk "
            f"({len(payload)} bytes: {shown!r}); this is a defect of streamrec's scanner, "
            "not of the record: please report it with the record"
        )


@dataclass(frozen=True)
class ScanPlan:
    """What the kernels need to know of a spec: its keys, and each field's kind and its
    column among the arrays of its kind (``floats``: the labels, then the dense fields)."""

    floats: tuple[str, ...]
    by_kind: dict[int, tuple[SparseField, ...]]
    kind: npt.NDArray[np.int64]
    slot: npt.NDArray[np.int64]
    keys: npt.NDArray[np.uint8]
    key_off: npt.NDArray[np.int64]
    table: npt.NDArray[np.int64]
    mask: int

    @classmethod
    def of(cls, spec: FeatureSpec) -> ScanPlan:
        floats = (*spec.labels, *(d.name for d in spec.dense))
        by_kind: dict[int, list[SparseField]] = {k: [] for k in _KINDS.values()}
        for s in spec.sparse:
            by_kind[_KINDS[s.type]].append(s)
        names = [*floats, *(s.name for k in _KINDS.values() for s in by_kind[k])]
        kind = np.array(
            [_K_FLOAT] * len(floats) + [k for k in _KINDS.values() for _ in by_kind[k]],
            dtype=np.int64,
        )
        # A field's column in the arrays of its kind; both list kinds share the list arrays.
        n_string_lists = len(by_kind[_K_LIST_STRING])
        slot = np.array(
            [
                *range(len(floats)),
                *range(len(by_kind[_K_STRING])),
                *range(len(by_kind[_K_INT])),
                *range(n_string_lists),
                *range(n_string_lists, n_string_lists + len(by_kind[_K_LIST_INT])),
            ],
            dtype=np.int64,
        )
        keys, key_off, table, mask = _key_table(names)
        return cls(
            floats, {k: tuple(v) for k, v in by_kind.items()}, kind, slot, keys, key_off,
            table, mask,
        )  # fmt: skip

    def sparse_layout(
        self, fields: Sequence[SparseField]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each of ``fields``' kind and column, in the order given (for ``sparse_elements``)."""
        names = [*self.floats, *(s.name for k in _KINDS.values() for s in self.by_kind[k])]
        at = [names.index(f.name) for f in fields]
        return self.kind[at].copy(), self.slot[at].copy()


@dataclass(frozen=True)
class ScannedValues:
    """The kernels' reading of a chunk, before any Arrow column is made.

    ``status[i]``: 0 read, 1 left (bad, or rare: ``json.loads`` decides), 2
    skipped. Each ``*state`` is 0 where a value is absent or null; ``fstate`` 2
    marks a number beyond the fast path (its text at ``fspan``), ``sstate`` 2 a
    string with escapes. List elements are ``lints`` / ``lstrs`` (span and an
    escape flag) from ``lfirst``, ``lcount`` of them.
    """

    buf: npt.NDArray[np.uint8]
    status: npt.NDArray[np.uint8]
    fval: npt.NDArray[np.float64]
    fstate: npt.NDArray[np.uint8]
    fspan: npt.NDArray[np.int64]
    ival: npt.NDArray[np.int64]
    istate: npt.NDArray[np.uint8]
    sspan: npt.NDArray[np.int64]
    sstate: npt.NDArray[np.uint8]
    lfirst: npt.NDArray[np.int64]
    lcount: npt.NDArray[np.int64]
    lstate: npt.NDArray[np.uint8]
    lints: npt.NDArray[np.int64]
    lstrs: npt.NDArray[np.int64]


def scan_values(
    joined: bytes | npt.NDArray[np.uint8],
    starts: npt.NDArray[np.int64],
    skip: npt.NDArray[np.bool_],
    plan: ScanPlan,
    ends: npt.NDArray[np.int64] | None = None,
) -> ScannedValues:
    """Run the kernels over the joined payloads (see :func:`scan_json`); with ``ends``,
    payload ``i`` is ``joined[starts[i]:ends[i]]`` wherever it lies (``starts`` then
    has one entry per payload)."""
    if ends is None:
        ends = starts[1:] - 1
    n = ends.shape[0]
    by_kind = plan.by_kind
    nf, ns, ni = len(plan.floats), len(by_kind[_K_STRING]), len(by_kind[_K_INT])
    nl = len(by_kind[_K_LIST_STRING]) + len(by_kind[_K_LIST_INT])
    buf = np.frombuffer(joined, dtype=np.uint8)
    status = np.zeros(n, dtype=np.uint8)
    # Values and spans are only read where their state (0: absent or null) says they were set.
    fval = np.empty((n, nf))
    fstate = np.zeros((n, nf), dtype=np.uint8)
    fspan = np.empty((n, nf, 2), dtype=np.int64)
    ival = np.empty((n, ni), dtype=np.int64)
    istate = np.zeros((n, ni), dtype=np.uint8)
    sspan = np.empty((n, ns, 2), dtype=np.int64)
    sstate = np.zeros((n, ns), dtype=np.uint8)
    lfirst = np.empty((n, nl), dtype=np.int64)
    lcount = np.empty((n, nl), dtype=np.int64)
    lstate = np.zeros((n, nl), dtype=np.uint8)
    lints, lstrs, stalled = _scan_records(
        buf, starts, ends, skip, plan.kind, plan.slot, plan.keys, plan.key_off, plan.table,
        plan.mask, status, fval, fstate, fspan, ival, istate, sspan, sstate, lfirst, lcount,
        lstate, np.empty(1024, dtype=np.int64), np.empty((1024, 3), dtype=np.int64),
    )  # fmt: skip
    if stalled >= 0:
        raise ScanStalled(stalled, bytes(buf[starts[stalled] : ends[stalled]]))
    return ScannedValues(
        buf, status, fval, fstate, fspan, ival, istate, sspan, sstate, lfirst, lcount, lstate,
        lints, lstrs,
    )  # fmt: skip


@nb.njit(nogil=True, cache=True)
def _elements(
    buf: Any, kind: Any, slot: Any, max_len: Any, ival: Any, istate: Any, sspan: Any,
    sstate: Any, lfirst: Any, lcount: Any, lstate: Any, lints: Any, lstrs: Any,
    lengths: Any, field_of: Any, is_string: Any, string_offsets: Any, strings: Any, ints: Any,
) -> tuple[int, int, int]:  # fmt: skip
    """Every sparse value field by field (``kind``/``slot`` order), record by record
    within a field; -1 when a list is over its field's ``max_len``."""
    n = lengths.shape[1]
    e = 0
    s = 0
    k = 0
    string_offsets[0] = 0
    for f in range(kind.shape[0]):
        j = slot[f]
        c = kind[f]
        for i in range(n):
            count = 0
            if c == _K_STRING or c == _K_INT:  # noqa: PLR1714, SIM109 (numba: no sets)
                present = (sstate[i, j] if c == _K_STRING else istate[i, j]) > 0
                count = 1 if present else 0
            elif lstate[i, j] > 0:
                count = lcount[i, j]
                if count > max_len[f]:
                    return -1, 0, 0
            for m in range(count):
                field_of[e] = f
                if c == _K_STRING or c == _K_LIST_STRING:  # noqa: PLR1714, SIM109 (numba: no sets)
                    if c == _K_STRING:
                        a, b, escaped = sspan[i, j, 0], sspan[i, j, 1], sstate[i, j] == 2
                    else:
                        el = lfirst[i, j] + m
                        a, b, escaped = lstrs[el, 0], lstrs[el, 1], lstrs[el, 2] == 1
                    o = string_offsets[s]
                    if escaped:
                        o = _unescape(buf, a, b, strings, o)
                    else:
                        for q in range(b - a):
                            strings[o + q] = buf[a + q]
                        o += b - a
                    s += 1
                    string_offsets[s] = o
                    is_string[e] = True
                else:
                    ints[k] = ival[i, j] if c == _K_INT else lints[lfirst[i, j] + m]
                    k += 1
                    is_string[e] = False
                e += 1
            lengths[f, i] = count
    return e, s, k


@dataclass(frozen=True)
class SparseElements:
    """A chunk's sparse values, field by field and record by record within a field:
    value ``e`` is field ``field_of[e]``'s; the ``k``-th string value is the UTF-8
    bytes ``strings[string_offsets[k]:string_offsets[k + 1]]`` (escapes decoded), the
    ``k``-th int value ``ints[k]``; ``lengths[f, i]`` counts record ``i``'s values of
    field ``f``."""

    lengths: npt.NDArray[np.int32]
    field_of: npt.NDArray[np.int32]
    is_string: npt.NDArray[np.bool_]
    string_offsets: npt.NDArray[np.int64]
    strings: npt.NDArray[np.uint8]
    ints: npt.NDArray[np.int64]


def sparse_elements(
    values: ScannedValues,
    kind: npt.NDArray[np.int64],
    slot: npt.NDArray[np.int64],
    max_len: npt.NDArray[np.int64],
) -> SparseElements | None:
    """The sparse values of a chunk read whole (every ``status`` 0), in the order of
    ``kind`` and ``slot`` (``ScanPlan.sparse_layout``); None when a list is over its
    field's ``max_len``."""
    n = values.status.shape[0]
    room = int(values.buf.shape[0]) // 2 + 1  # a value takes two bytes at least ("1,")
    lengths = np.zeros((kind.shape[0], n), dtype=np.int32)
    field_of = np.empty(room, dtype=np.int32)
    is_string = np.empty(room, dtype=np.bool_)
    string_offsets = np.empty(room + 1, dtype=np.int64)
    strings = np.empty(max(1, values.buf.shape[0]), dtype=np.uint8)
    ints = np.empty(room, dtype=np.int64)
    e, s, k = _elements(
        values.buf, kind, slot, max_len, values.ival, values.istate, values.sspan,
        values.sstate, values.lfirst, values.lcount, values.lstate, values.lints, values.lstrs,
        lengths, field_of, is_string, string_offsets, strings, ints,
    )  # fmt: skip
    if e < 0:
        return None
    return SparseElements(
        lengths, field_of[:e], is_string[:e], string_offsets[: s + 1], strings, ints[:k]
    )


def scan_json(
    joined: bytes,
    starts: npt.NDArray[np.int64],
    skip: npt.NDArray[np.bool_],
    spec: FeatureSpec,
    schema: pa.Schema,
) -> tuple[pa.Table, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The scanner: a table of the records it read, their indices, and those it left."""
    plan = ScanPlan.of(spec)
    v = scan_values(joined, starts, skip, plan)
    floats, by_kind = plan.floats, plan.by_kind
    ns = len(by_kind[_K_STRING])
    buf, status, fval, fstate, fspan = v.buf, v.status, v.fval, v.fstate, v.fspan
    ival, istate, sspan, sstate = v.ival, v.istate, v.sspan, v.sstate
    lfirst, lcount, lstate, lints, lstrs = v.lfirst, v.lcount, v.lstate, v.lints, v.lstrs
    # Numbers beyond the fast path: Arrow's parser, the one pyarrow.json uses, reads them.
    hard_rows, hard_cols = np.nonzero((fstate == 2) & (status == 0)[:, None])
    if hard_rows.shape[0]:
        spans = np.ascontiguousarray(fspan[hard_rows, hard_cols][:, None, :])
        m = len(hard_rows)
        (texts,) = _gather(buf, spans, np.ones((m, 1), np.uint8), np.arange(m))
        try:
            fval[hard_rows, hard_cols] = texts.cast(pa.float64()).to_numpy(zero_copy_only=False)
            fstate[hard_rows, hard_cols] = 1
        except pa.ArrowInvalid:
            status[hard_rows] = 1  # not expected for JSON numbers; json.loads decides
    ok = status == 0
    rows = np.flatnonzero(ok)
    columns: dict[str, pa.Array] = {}
    for j, name in enumerate(floats):
        valid = fstate[rows, j] > 0
        columns[name] = pa.array(fval[rows, j], mask=~valid)
    for j, s in enumerate(by_kind[_K_INT]):
        valid = istate[rows, j] > 0
        columns[s.name] = pa.array(ival[rows, j], mask=~valid)
    if ns:
        for s, arr in zip(by_kind[_K_STRING], _gather(buf, sspan, sstate, rows), strict=True):
            columns[s.name] = arr
    lists = [*by_kind[_K_LIST_STRING], *by_kind[_K_LIST_INT]]
    for j, s in enumerate(lists):
        valid = lstate[rows, j] > 0
        counts = np.where(valid, lcount[rows, j], 0)
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        # Element k of the column is element (k - offsets[row]) of its row, from lfirst[row].
        firsts = np.repeat(lfirst[rows, j] - offsets[:-1], counts) + np.arange(offsets[-1])
        if s.type == "list_int":
            values = pa.array(lints[firsts], type=pa.int64())
        else:
            elems = lstrs[firsts]
            state = (1 + elems[:, 2:3]).astype(np.uint8)
            # Contiguous spans: the kernels are then compiled for one array layout only.
            spans = np.ascontiguousarray(elems[:, None, :2])
            (values,) = _gather(buf, spans, state, np.arange(len(firsts)))
        columns[s.name] = pa.ListArray.from_arrays(
            pa.array(offsets).cast(pa.int32()), values, mask=pa.array(~valid)
        )
    out = pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
    return out, rows.astype(np.int64), np.flatnonzero(status == 1)
