"""The JSON scanner's sparse side: a chunk's sparse values laid out field by field, for
the serving path's batch (``pipeline.json_scan``), without Arrow columns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.codecs.json_lex import unescape
from connectors.codecs.json_scan import (
    ABSENT,
    DEFERRED,
    K_INT,
    K_LIST_STRING,
    K_STRING,
    ScannedValues,
)


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
            if c == K_STRING or c == K_INT:  # noqa: PLR1714, SIM109 (numba: no sets)
                present = (sstate[i, j] if c == K_STRING else istate[i, j]) > ABSENT
                count = 1 if present else 0
            elif lstate[i, j] > ABSENT:
                count = lcount[i, j]
                if count > max_len[f]:
                    return -1, 0, 0
            for m in range(count):
                field_of[e] = f
                if c == K_STRING or c == K_LIST_STRING:  # noqa: PLR1714, SIM109 (numba: no sets)
                    if c == K_STRING:
                        a, b, escaped = sspan[i, j, 0], sspan[i, j, 1], sstate[i, j] == DEFERRED
                    else:
                        el = lfirst[i, j] + m
                        a, b, escaped = lstrs[el, 0], lstrs[el, 1], lstrs[el, 2] == 1
                    o = string_offsets[s]
                    if escaped:
                        o = unescape(buf, a, b, strings, o)
                    else:
                        for q in range(b - a):
                            strings[o + q] = buf[a + q]
                        o += b - a
                    s += 1
                    string_offsets[s] = o
                    is_string[e] = True
                else:
                    ints[k] = ival[i, j] if c == K_INT else lints[lfirst[i, j] + m]
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
