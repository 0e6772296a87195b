"""The steps every codec's ``decode`` shares: checking the chunk, screening and joining
payloads, and finishing with the good table and the bad records in record order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from connectors.spec import FeatureSpec
from connectors.types import BadRecord, RawChunk
from connectors.validate import (
    POSITION,
    Checked,
    Problem,
    problems_to_bad,
    spec_schema,
    with_positions,
)


def payloads_of(raw: RawChunk, codec: str) -> Sequence[bytes]:
    """The payloads of ``raw``: an error, naming ``codec``, for a table or a count mismatch."""
    if raw.payloads is None:
        msg = (
            f"chunk {raw.chunk.name} holds an Arrow table, not payloads: the {codec} codec "
            "decodes payloads (check a table with connectors.validate.validate)"
        )
        raise ValueError(msg)
    if len(raw.payloads) != len(raw.positions):
        msg = (
            f"chunk {raw.chunk.name} has {len(raw.payloads)} payloads "
            f"but {len(raw.positions)} positions"
        )
        raise ValueError(msg)
    return raw.payloads


def screen(
    payloads: Sequence[bytes], spec: FeatureSpec
) -> tuple[npt.NDArray[np.int64], dict[int, Problem]]:
    """Payload lengths, and the empty and oversize payloads (which are not decoded)."""
    n = len(payloads)
    lens = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    early: dict[int, Problem] = {}
    for i in np.flatnonzero(lens == 0):
        early[int(i)] = Problem(int(i), "empty_payload", None, "the payload is empty (0 bytes)")
    limit = spec.max_record_bytes
    for i in np.flatnonzero(lens > limit):
        early[int(i)] = Problem(
            int(i),
            "oversize",
            None,
            f"the payload is {int(lens[i]):,} bytes, over max_record_bytes {limit:,}",
        )
    return lens, early


def join(
    payloads: Sequence[bytes],
    replaced: dict[int, bytes],
    lens: npt.NDArray[np.int64] | None = None,
) -> tuple[bytes, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Payloads joined by newlines (some replaced), each one's start offset and length.

    ``starts`` has one more entry than there are payloads: where a payload after
    the last would start. ``lens`` saves measuring the payloads again.
    """
    if replaced:
        work = list(payloads)
        for i, p in replaced.items():
            work[i] = p
        payloads = work
    joined = b"\n".join(payloads)
    if lens is None or replaced:
        lens = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
    starts = np.zeros(len(payloads) + 1, dtype=np.int64)
    np.cumsum(lens + 1, out=starts[1:])
    return joined, starts, lens


def utf8_ok(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, checked by Arrow's (SIMD) validator without a copy."""
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64))
    text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(data)])
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def finish(
    raw: RawChunk,
    checked: Checked,
    record_of_row: npt.NDArray[np.int64],
    early: dict[int, Problem],
    raw_of_row: Callable[[int], bytes] | None = None,
) -> tuple[pa.Table, list[BadRecord]]:
    """The good table with positions, and every bad record (early ones too) in record order."""
    positions = np.asarray(raw.positions, dtype=np.int64)[record_of_row]
    good = with_positions(checked.table, checked.good, positions)
    late = problems_to_bad(checked.problems, record_of_row, raw, raw_of_row)
    keyed = [
        (int(record_of_row[p.row]), p.row, b) for p, b in zip(checked.problems, late, strict=True)
    ]
    if early:
        keyed += [
            (i, -1, b)
            for i, b in zip(
                early,
                problems_to_bad(list(early.values()), np.arange(len(raw), dtype=np.int64), raw),
                strict=True,
            )
        ]
    keyed.sort(key=lambda k: (k[0], k[1]))
    return good, [b for _, _, b in keyed]


def relabel(
    checked: Checked, reason: str, new_reason: str, new_detail: Callable[[Problem], str | None]
) -> None:
    """Rewrite some problems of ``reason`` (when ``new_detail`` gives a sentence)."""
    for k, p in enumerate(checked.problems):
        if p.reason == reason:
            detail = new_detail(p)
            if detail is not None:
                checked.problems[k] = p._replace(reason=new_reason, detail=detail)


def none_good(
    raw: RawChunk, spec: FeatureSpec, early: dict[int, Problem]
) -> tuple[pa.Table, list[BadRecord]]:
    """No good records: an empty good table, and the ``early`` problems in record order."""
    bad = problems_to_bad(
        [early[i] for i in sorted(early)], np.arange(len(raw), dtype=np.int64), raw
    )
    return spec_schema(spec, position=True).empty_table(), bad


def drop_position(table: pa.Table) -> pa.Table:
    """``table`` without its ``__position`` column, if it has one."""
    return table.drop_columns([POSITION]) if POSITION in table.column_names else table
