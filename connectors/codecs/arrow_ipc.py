"""The Arrow IPC codec, :class:`ArrowIpcCodec`: each payload an Arrow IPC stream of rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.ipc as pa_ipc

from connectors.codecs.steps import drop_position, finish, none_good, payloads_of, screen
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, RawChunk
from connectors.validate import Checked, Problem, check, show


@dataclass(frozen=True)
class ArrowIpcCodec:
    """Each payload an Arrow IPC stream of one or more rows, of any schema.

    A payload that is not a readable, valid stream is ``bad_ipc``; its rows'
    columns are cast to the spec's types like any Arrow table (see
    :mod:`connectors.validate`: an int64 column for a string field makes each
    non-null row ``sparse_wrong_type``). Every row of a payload has the payload's
    position; a bad row is dead-lettered as a one-row IPC stream of its own
    (the payload's other rows may be good). A stream with no rows holds no
    records. ``max_record_bytes`` applies to the whole payload, before reading
    it. ``encode`` packs ``rows_per_payload`` rows in each payload.

    >>> from connectors.spec import FeatureSpec
    >>> spec = FeatureSpec(labels=["y"], sparse=[{"name": "u", "table": "t", "type": "int"}])
    >>> codec = ArrowIpcCodec(rows_per_payload=2)
    >>> payloads = codec.encode(pa.table({"y": [1.0, 7.0, 0.0], "u": [5, 6, 7]}))
    >>> len(payloads)
    2
    >>> from connectors.types import Chunk, RawChunk
    >>> raw = RawChunk(Chunk("s", "p", 10, 13), np.array([10, 11, 12]), [*payloads, b"junk"])
    >>> good, bad = codec.decode(raw, spec)
    >>> good.to_pylist()
    [{'y': 1.0, 'u': 5, '__position': 10}, {'y': 0.0, 'u': 7, '__position': 11}]
    >>> [(b.position, b.reason) for b in bad]
    [(10, 'label_out_of_range'), (12, 'bad_ipc')]
    """

    rows_per_payload: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.rows_per_payload, int) or self.rows_per_payload < 1:
            msg = f"rows_per_payload must be a positive int, got {self.rows_per_payload!r}"
            raise ValueError(msg)

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good rows of ``raw``'s streams and the bad ones (see the class docstring)."""
        payloads = payloads_of(raw, "arrow")
        n = len(payloads)
        _, early = screen(payloads, spec)
        # Tables of one schema are checked together: one check per schema, not per payload.
        groups: dict[pa.Schema, list[tuple[int, pa.Table]]] = {}
        for i in range(n):
            if i in early:
                continue
            try:
                table = _read_ipc(payloads[i])
            except (pa.ArrowException, OSError, ValueError) as e:
                early[i] = Problem(
                    i,
                    "bad_ipc",
                    None,
                    f"the payload is not a valid Arrow IPC stream: {show(str(e), 160)}",
                )
                continue
            if table.num_rows:
                groups.setdefault(table.schema, []).append((i, table))
        if not groups:
            return none_good(raw, spec, early)
        parts: list[tuple[Checked, npt.NDArray[np.int64], npt.NDArray[np.int64], pa.Table]] = []
        for members in groups.values():
            originals = pa.concat_tables([t for _, t in members])
            record = np.concatenate([np.full(t.num_rows, i, dtype=np.int64) for i, t in members])
            within = np.concatenate([np.arange(t.num_rows, dtype=np.int64) for _, t in members])
            parts.append((check(originals, spec), record, within, originals))
        # Merge the groups back into record order, rows of a payload in their order.
        record = np.concatenate([p[1] for p in parts])
        within = np.concatenate([p[2] for p in parts])
        order = np.lexsort((within, record))
        table = pa.concat_tables([p[0].table for p in parts]).take(pa.array(order))
        good = np.concatenate([p[0].good for p in parts])[order]
        # Row k of the groups, concatenated, is row k - starts[g] of group g.
        starts = np.cumsum([0, *(p[1].shape[0] for p in parts)])
        problems = [
            p._replace(row=p.row + int(starts[g]))
            for g, part in enumerate(parts)
            for p in part[0].problems
        ]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        moved = [p._replace(row=int(rank[p.row])) for p in problems]

        def raw_of_row(row: int) -> bytes:
            k = int(order[row])
            g = int(np.searchsorted(starts, k, side="right")) - 1
            return _write_ipc(parts[g][3].take([k - int(starts[g])]))

        checked = Checked(table, good, sorted(moved))
        return finish(raw, checked, record[order], early, raw_of_row)

    def encode(self, table: pa.Table) -> list[bytes]:
        """IPC streams of ``rows_per_payload`` rows each.

        >>> p = ArrowIpcCodec().encode(pa.table({"y": [1.0, 0.0]}))
        >>> len(p), pa.ipc.open_stream(p[1]).read_all().to_pylist()
        (2, [{'y': 0.0}])
        """
        table = drop_position(table)
        k, n = self.rows_per_payload, table.num_rows
        # `take` copies the rows: a slice would carry its arrays' whole buffers into the stream.
        return [_write_ipc(table.take(np.arange(i, min(i + k, n)))) for i in range(0, n, k)]


def _read_ipc(payload: bytes) -> pa.Table:
    with pa_ipc.open_stream(pa.py_buffer(payload)) as reader:
        table = reader.read_all()
    # Full validation catches corrupt offsets and broken UTF-8 before any kernel reads them.
    table.validate(full=True)
    return table.replace_schema_metadata(None)


def _write_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa_ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
