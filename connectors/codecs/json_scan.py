"""The JSON scanner's record kernels: one pass over a chunk's joined payloads that reads
every record the scanner takes into arrays, and marks the rest for ``json.loads``.

:func:`scan_values` runs them; :func:`connectors.codecs.json_columns.scan_json` turns
their arrays into Arrow columns, the default engine of
:class:`~connectors.codecs.JsonLinesCodec`. A record is read when it is a JSON object
whose spec fields hold values of the right type; any other record is left
(``LEFT``) to ``json.loads``, which names the problem.

Why a hand-written scanner rather than a JSON library: the libraries put in its place
(``pyarrow.json``, orjson, pysimdjson), each with the rest of the codec unchanged and
checked to give the same verdicts, all decode at a fraction of its rate, because they
pay Python's per-record and per-value costs that a single compiled pass does not;
``python benchmarks/decode_micro.py`` measures them side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.codecs.json_lex import (
    CLOSE_ARRAY,
    CLOSE_OBJECT,
    COLON,
    COMMA,
    LITERAL_N,
    NOT_JSON,
    NULL,
    OPEN_ARRAY,
    OPEN_OBJECT,
    QUOTE,
    SKIP_STALLED,
    escapes_ok,
    exact_float,
    int64,
    literal,
    number,
    skip_value,
    skip_ws,
    starts_number,
    string,
)
from connectors.spec import FeatureSpec, SparseField

# The kinds of spec field; each kind has its own arrays (both list kinds share theirs).
K_FLOAT, K_STRING, K_INT, K_LIST_STRING, K_LIST_INT = 0, 1, 2, 3, 4
KINDS = {
    "string": K_STRING,
    "int": K_INT,
    "list_string": K_LIST_STRING,
    "list_int": K_LIST_INT,
}

# A record's status (``ScannedValues.status``), and what ``_scan_record`` answers.
READ = 0  # read into the arrays
LEFT = 1  # left to json.loads: bad, or rare (an escaped key, a NaN literal)
SKIPPED = 2  # not scanned: the caller's screening already decided it
# A loop over a record's bytes that did not move on: the scan ends there and names the
# record (``ScanStalled``). Every such loop checks that its position advanced, so a
# fault in the scanner surfaces as this refusal rather than as a core spinning forever.
STALLED = 3
# Out of room for list elements: the record is read again once the store has grown.
# ``_scan_record`` answers it; it is never a record's status.
_OUT_OF_ROOM = 4

# A value's state (``fstate``, ``istate``, ``sstate``, ``lstate``).
ABSENT = 0  # absent or null: the value and span arrays hold nothing there
PRESENT = 1  # read: the value (or span of plain bytes) is set
DEFERRED = 2  # a number beyond the fast path (its text at ``fspan``), or a string with escapes

MAX_DEPTH = 64  # nesting of skipped values; deeper records go to json.loads
FIRST_STORE = 1024  # list elements of a kind room is made for at first; doubled as needed
_FNV_OFFSET, _FNV_PRIME = 14695981039346656037, 1099511628211


@nb.njit(nogil=True, cache=True, inline="always")
def _same(buf: Any, s: int, e: int, keys: Any, ks: int, ke: int) -> bool:
    if ke - ks != e - s:
        return False
    for k in range(e - s):  # noqa: SIM110 (numba compiles loops, not generators)
        if keys[ks + k] != buf[s + k]:
            return False
    return True


@nb.njit(nogil=True, cache=True, inline="always")
def _field_of(buf: Any, s: int, e: int, key_table: Any) -> int:
    """The spec field named by the key bytes ``buf[s:e]``, or -1 (FNV-1a, linear probing)."""
    keys, key_off, table, mask = key_table
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
def _int_value(buf: Any, p: int, end: int) -> tuple[bool, Any, int]:
    """An int64 at ``p``: (whether it is one, its value, the position after it)."""
    if not starts_number(buf[p]):
        return False, 0, p
    q, is_int, neg, w, _, exact = number(buf, p, end)
    if q < 0 or not is_int or not exact:
        return False, 0, p
    fits, v = int64(neg, w)
    return fits, v, q


@nb.njit(nogil=True, cache=True, inline="always")
def _list_element(
    buf: Any, p: int, end: int, of_ints: bool, elements: Any, esc: Any
) -> tuple[int, int]:
    """One list element at ``p`` into the element store of its kind: (status, position after)."""
    lints, lstrs, used = elements
    if of_ints:
        ok, v, q = _int_value(buf, p, end)
        if not ok:
            return LEFT, p
        if used[0] >= lints.shape[0]:
            return _OUT_OF_ROOM, p
        lints[used[0]] = v
        used[0] += 1
        return READ, q
    if buf[p] != QUOTE:
        return LEFT, p
    q = string(buf, p, end)
    if q == NOT_JSON:
        return LEFT, p
    if used[1] >= lstrs.shape[0]:
        return _OUT_OF_ROOM, p
    lstrs[used[1], 2] = 0
    if q < NOT_JSON:
        q = -2 - q
        esc[0] = 1
        lstrs[used[1], 2] = 1
    lstrs[used[1], 0] = p + 1
    lstrs[used[1], 1] = q - 1
    used[1] += 1
    return READ, q


@nb.njit(nogil=True, cache=True)
def _read_list(
    buf: Any, p: int, end: int, i: int, j: int, of_ints: bool, out: Any, elements: Any, esc: Any
) -> tuple[int, int]:
    """A list field at ``p``: its elements into their store, where they start and how many
    into row ``i``, column ``j`` of the list arrays; (status, position after)."""
    if buf[p] != OPEN_ARRAY:
        return LEFT, p
    used = elements[2]
    p = skip_ws(buf, p + 1, end)
    first = used[0] if of_ints else used[1]
    count = 0
    if p < end and buf[p] == CLOSE_ARRAY:
        p += 1
    else:
        while True:
            if p >= end:
                return LEFT, p
            r, q = _list_element(buf, p, end, of_ints, elements, esc)
            if r != READ:
                return r, p
            count += 1
            if q <= p:
                return STALLED, p
            p = skip_ws(buf, q, end)
            if p < end and buf[p] == COMMA:
                p = skip_ws(buf, p + 1, end)
            elif p < end and buf[p] == CLOSE_ARRAY:
                p += 1
                break
            else:
                return LEFT, p
    lfirst, lcount, lstate = out[3]
    lfirst[i, j] = first
    lcount[i, j] = count
    lstate[i, j] = PRESENT
    return READ, p


@nb.njit(nogil=True, cache=True)
def _scan_record(
    buf: Any, p: int, end: int, i: int, plan: Any, out: Any, elements: Any, scratch: Any
) -> int:
    """Read record ``i`` (bytes ``p..end``); its status, or ``_OUT_OF_ROOM``.

    ``plan`` is ``(kind, slot, key_table)`` (see :class:`ScanPlan`); ``out`` the
    arrays per kind, ``(floats, ints, strings, lists)``; ``elements`` the list element
    stores and their use, ``(lints, lstrs, used)``; ``scratch`` is ``(seen, stack,
    esc)``. Sets ``esc[0]`` when a string in the record has escapes (unchecked so far).
    The scalar kinds are read here, in one function: split into kernels of their own,
    the common case ran several times slower (``benchmarks/decode_micro.py``).
    """
    kind, slot, key_table = plan
    seen, stack, esc = scratch
    (fval, fstate, fspan), (ival, istate), (sspan, sstate), _ = out
    p = skip_ws(buf, p, end)
    if p >= end or buf[p] != OPEN_OBJECT:
        return LEFT
    p = skip_ws(buf, p + 1, end)
    if p < end and buf[p] == CLOSE_OBJECT:
        return READ if skip_ws(buf, p + 1, end) == end else LEFT
    while True:
        if p >= end or buf[p] != QUOTE:
            return LEFT
        q = string(buf, p, end)
        if q < 0:
            return LEFT  # keys with escapes are left to json.loads
        f = _field_of(buf, p + 1, q - 1, key_table)
        if q <= p:
            return STALLED
        p = skip_ws(buf, q, end)
        if p >= end or buf[p] != COLON:
            return LEFT
        p = skip_ws(buf, p + 1, end)
        if p >= end:
            return LEFT
        if f < 0:
            p = skip_value(buf, p, end, stack, esc)
            if p < 0:
                return STALLED if p == SKIP_STALLED else LEFT
        else:
            if seen[f] == i:
                return LEFT  # a spec key twice
            seen[f] = i
            k = kind[f]
            j = slot[f]
            c = buf[p]
            if c == LITERAL_N:
                p = literal(buf, p, end, NULL)
                if p < 0:
                    return LEFT
            elif k == K_FLOAT:
                if not starts_number(c):
                    return LEFT
                q, _, neg, w, e10, exact = number(buf, p, end)
                if q < 0:
                    return LEFT
                good, v = exact_float(neg, w, e10, exact)
                if good:
                    fval[i, j] = v
                    fstate[i, j] = PRESENT
                else:
                    fspan[i, j, 0] = p
                    fspan[i, j, 1] = q
                    fstate[i, j] = DEFERRED
                p = q
            elif k == K_STRING:
                if c != QUOTE:
                    return LEFT
                q = string(buf, p, end)
                if q == NOT_JSON:
                    return LEFT
                if q < NOT_JSON:
                    q = -2 - q
                    esc[0] = 1
                    sstate[i, j] = DEFERRED
                else:
                    sstate[i, j] = PRESENT
                sspan[i, j, 0] = p + 1
                sspan[i, j, 1] = q - 1
                p = q
            elif k == K_INT:
                ok, iv, q = _int_value(buf, p, end)
                if not ok:
                    return LEFT
                ival[i, j] = iv
                istate[i, j] = PRESENT
                p = q
            else:
                r, p = _read_list(buf, p, end, i, j, k == K_LIST_INT, out, elements, esc)
                if r != READ:
                    return r
        p = skip_ws(buf, p, end)
        if p < end and buf[p] == COMMA:
            p = skip_ws(buf, p + 1, end)
        elif p < end and buf[p] == CLOSE_OBJECT:
            return READ if skip_ws(buf, p + 1, end) == end else LEFT
        else:
            return LEFT


@nb.njit(nogil=True, cache=True)
def _scan_records(
    buf: Any, starts: Any, ends: Any, skip: Any, plan: Any, out: Any, status: Any,
    lints: Any, lstrs: Any,
) -> tuple[Any, Any, int]:  # fmt: skip
    """Scan every record not skipped (record ``i`` is ``buf[starts[i]:ends[i]]``) into
    ``status`` and ``out`` (see ``_scan_record``); returns the list element stores and
    the first record the scan stalled on (-1: none; the scan ends there, that record's
    status ``STALLED``)."""
    n = ends.shape[0]
    seen = np.full(plan[0].shape[0], -1, np.int64)
    stack = np.empty(MAX_DEPTH, np.int64)  # open containers of a skipped value
    used = np.zeros(2, np.int64)
    esc = np.zeros(1, np.int64)
    scratch = (seen, stack, esc)
    for i in range(n):
        if skip[i]:
            status[i] = SKIPPED
            continue
        # A record holds at most one list element per two of its bytes ("1,"): a store
        # with that much room past its use cannot run out, so each read of the record
        # again follows a store's growth past its capacity, and at most
        # log2(record bytes) of them are needed.
        need = (ends[i] - starts[i]) // 2 + 1
        while True:
            before0, before1 = used[0], used[1]
            esc[0] = 0
            elements = (lints, lstrs, used)
            r = _scan_record(buf, starts[i], ends[i], i, plan, out, elements, scratch)
            if r == READ and esc[0] and not escapes_ok(buf, starts[i], ends[i]):
                r = LEFT
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
                lints = np.concatenate(
                    (lints, np.empty(max(lints.shape[0], FIRST_STORE), np.int64))
                )
            if full_strs:
                grown = np.empty((max(lstrs.shape[0], FIRST_STORE), 3), np.int64)
                lstrs = np.concatenate((lstrs, grown))
        if r == STALLED:
            status[i] = STALLED
            return lints, lstrs, i
        status[i] = r
    return lints, lstrs, -1


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
        by_kind: dict[int, list[SparseField]] = {k: [] for k in KINDS.values()}
        for s in spec.sparse:
            by_kind[KINDS[s.type]].append(s)
        names = [*floats, *(s.name for k in KINDS.values() for s in by_kind[k])]
        kind = np.array(
            [K_FLOAT] * len(floats) + [k for k in KINDS.values() for _ in by_kind[k]],
            dtype=np.int64,
        )
        # A field's column in the arrays of its kind; both list kinds share the list arrays.
        n_string_lists = len(by_kind[K_LIST_STRING])
        slot = np.array(
            [
                *range(len(floats)),
                *range(len(by_kind[K_STRING])),
                *range(len(by_kind[K_INT])),
                *range(n_string_lists),
                *range(n_string_lists, n_string_lists + len(by_kind[K_LIST_INT])),
            ],
            dtype=np.int64,
        )
        keys, key_off, table, mask = _key_table(names)
        return cls(
            floats, {k: tuple(v) for k, v in by_kind.items()}, kind, slot, keys, key_off,
            table, mask,
        )  # fmt: skip

    def kernel_plan(self) -> tuple[Any, ...]:
        """The plan as ``_scan_record`` takes it: ``(kind, slot, key_table)``."""
        return self.kind, self.slot, (self.keys, self.key_off, self.table, self.mask)

    def sparse_layout(
        self, fields: Sequence[SparseField]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each of ``fields``' kind and column, in the order given (for ``sparse_elements``)."""
        names = [*self.floats, *(s.name for k in KINDS.values() for s in self.by_kind[k])]
        at = [names.index(f.name) for f in fields]
        return self.kind[at].copy(), self.slot[at].copy()


@dataclass(frozen=True)
class ScannedValues:
    """The kernels' reading of a chunk, before any Arrow column is made.

    ``status[i]``: ``READ``, ``LEFT`` (bad, or rare: ``json.loads`` decides) or
    ``SKIPPED``. Each ``*state`` is ``ABSENT`` where a value is absent or null;
    ``fstate`` ``DEFERRED`` marks a number beyond the fast path (its text at
    ``fspan``), ``sstate`` ``DEFERRED`` a string with escapes. List elements are
    ``lints`` / ``lstrs`` (span and an escape flag) from ``lfirst``, ``lcount`` of them.
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
    """Run the kernels over the joined payloads (see
    :func:`~connectors.codecs.json_columns.scan_json`); with ``ends``, payload ``i`` is
    ``joined[starts[i]:ends[i]]`` wherever it lies (``starts`` then has one entry per
    payload)."""
    if ends is None:
        ends = starts[1:] - 1
    n = ends.shape[0]
    by_kind = plan.by_kind
    nf, ns, ni = len(plan.floats), len(by_kind[K_STRING]), len(by_kind[K_INT])
    nl = len(by_kind[K_LIST_STRING]) + len(by_kind[K_LIST_INT])
    buf = np.frombuffer(joined, dtype=np.uint8)
    status = np.zeros(n, dtype=np.uint8)
    # Values and spans are only read where their state (ABSENT: absent or null) says they were set.
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
    out = ((fval, fstate, fspan), (ival, istate), (sspan, sstate), (lfirst, lcount, lstate))
    lints, lstrs, stalled = _scan_records(
        buf, starts, ends, skip, plan.kernel_plan(), out, status,
        np.empty(FIRST_STORE, dtype=np.int64), np.empty((FIRST_STORE, 3), dtype=np.int64),
    )  # fmt: skip
    if stalled >= 0:
        raise ScanStalled(stalled, bytes(buf[starts[stalled] : ends[stalled]]))
    return ScannedValues(
        buf, status, fval, fstate, fspan, ival, istate, sspan, sstate, lfirst, lcount, lstate,
        lints, lstrs,
    )  # fmt: skip
