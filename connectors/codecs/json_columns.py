"""The JSON scanner's Arrow side: the arrays of :func:`~connectors.codecs.json_scan.scan_values`
made into the columns of a table, strings copied (and unescaped) in one pass.

:func:`scan_json` is the default engine of :class:`~connectors.codecs.JsonLinesCodec`.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from connectors.codecs.json_lex import unescape, unescaped_length
from connectors.codecs.json_scan import (
    ABSENT,
    DEFERRED,
    K_INT,
    K_LIST_INT,
    K_LIST_STRING,
    K_STRING,
    LEFT,
    PRESENT,
    READ,
    ScanPlan,
    scan_values,
)
from connectors.spec import FeatureSpec


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
            if st == PRESENT:
                totals[j] += span[r, j, 1] - span[r, j, 0]
            elif st == DEFERRED:
                totals[j] += unescaped_length(buf, span[r, j, 0], span[r, j, 1])
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
            if st == PRESENT:
                cur[j] += span[r, j, 1] - span[r, j, 0]
            elif st == DEFERRED:
                cur[j] += unescaped_length(buf, span[r, j, 0], span[r, j, 1])
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
            if st == PRESENT:
                s = span[r, j, 0]
                o = dest[k, j]
                for q in range(span[r, j, 1] - s):
                    data[o + q] = buf[s + q]
            elif st == DEFERRED:
                unescape(buf, span[r, j, 0], span[r, j, 1], data, dest[k, j])


def _gather(
    buf: npt.NDArray[np.uint8],
    span: npt.NDArray[np.int64],
    state: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.int64],
) -> list[pa.Array]:
    """String columns from spans: column ``j`` holds ``span[r, j]`` for each row ``r`` of ``rows``.

    ``state[r, j]`` is ``ABSENT`` for null, ``PRESENT`` for plain bytes, ``DEFERRED`` for a
    JSON string with escapes.
    """
    offsets, base, dest = _string_offsets(span, state, rows, buf)
    ns = state.shape[1]
    if offsets.shape[0] != ns:
        msg = "a string column of this chunk holds 2 GiB or more: read smaller chunks"
        raise ValueError(msg)
    data = np.empty(int(base[-1]), dtype=np.uint8)
    _copy_strings(buf, span, state, rows, dest, data)
    valid = state[rows] != ABSENT
    return [_string_array(offsets[j], data[base[j] : base[j + 1]], valid[:, j]) for j in range(ns)]


def _string_array(
    offsets: npt.NDArray[np.int32], data: npt.NDArray[np.uint8], valid: npt.NDArray[np.bool_]
) -> pa.Array:
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.string(), valid.shape[0], buffers)


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
    ns = len(by_kind[K_STRING])
    buf, status, fval, fstate, fspan = v.buf, v.status, v.fval, v.fstate, v.fspan
    ival, istate, sspan, sstate = v.ival, v.istate, v.sspan, v.sstate
    lfirst, lcount, lstate, lints, lstrs = v.lfirst, v.lcount, v.lstate, v.lints, v.lstrs
    # Numbers beyond the fast path: Arrow's parser, the one pyarrow.json uses, reads them.
    hard_rows, hard_cols = np.nonzero((fstate == DEFERRED) & (status == READ)[:, None])
    if hard_rows.shape[0]:
        spans = np.ascontiguousarray(fspan[hard_rows, hard_cols][:, None, :])
        m = len(hard_rows)
        (texts,) = _gather(buf, spans, np.ones((m, 1), np.uint8), np.arange(m))
        try:
            fval[hard_rows, hard_cols] = texts.cast(pa.float64()).to_numpy(zero_copy_only=False)
            fstate[hard_rows, hard_cols] = PRESENT
        except pa.ArrowInvalid:
            status[hard_rows] = LEFT  # not expected for JSON numbers; json.loads decides
    ok = status == READ
    rows = np.flatnonzero(ok)
    columns: dict[str, pa.Array] = {}
    for j, name in enumerate(floats):
        valid = fstate[rows, j] != ABSENT
        columns[name] = pa.array(fval[rows, j], mask=~valid)
    for j, s in enumerate(by_kind[K_INT]):
        valid = istate[rows, j] != ABSENT
        columns[s.name] = pa.array(ival[rows, j], mask=~valid)
    if ns:
        for s, arr in zip(by_kind[K_STRING], _gather(buf, sspan, sstate, rows), strict=True):
            columns[s.name] = arr
    lists = [*by_kind[K_LIST_STRING], *by_kind[K_LIST_INT]]
    for j, s in enumerate(lists):
        valid = lstate[rows, j] != ABSENT
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
    return out, rows.astype(np.int64), np.flatnonzero(status == LEFT)
