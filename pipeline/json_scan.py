"""JSON records read straight from their bytes to the batch ``build_batch`` makes.

A prediction server's request holds JSON records in the job's format. The
Python path (``json.loads``, then :class:`pipeline.plain.PlainBatchBuilder`)
spends its time creating a Python object for every value and looking at each
one, most of a batch-64 request's cost; the columnar path pays per field (an
Arrow column, a check and a hash call each). :class:`JsonScanBuilder` runs the
codec's own scanner
(:mod:`connectors.codecs.json_scan`) and takes its values as arrays: every
sparse value, field by field, to the training path's hash
(:class:`pipeline.hashing.ValueHasher`) in one call, then its dedup
(``dedup_tables``), and the labels and the dense matrix checked and filled in
one kernel pass (a request that finds the caches cold pays for every numpy
call it makes), then transformed (``transform_dense``) a few columns at a
time.

Like the plain path it only ever accepts: a record the scanner leaves to
``json.loads`` (a bad one, or a rare form such as an escaped key), a number
beyond its exact fast path, invalid UTF-8, a value out of its field's range,
a missing value without a fill, a missing or out-of-range label where labels
are required, or a list over ``max_len`` makes :meth:`JsonScanBuilder.build`
return None, and the caller takes the plain path, then the columnar one,
which decides and names what is wrong. The values it reads are the columnar
path's own, and the tests hold the batch to that path's value for value.

>>> from connectors.spec import FeatureSpec
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"], "labels_required": False,
...     "dense": [{"name": "price", "transform": "log1p"}],
...     "sparse": [{"name": "user", "table": "ids"}, {"name": "item", "table": "ids"}],
... })
>>> builder = JsonScanBuilder(spec)
>>> batch = builder.build([b'{"price": 0, "user": "u1", "item": "i1"}', b'{"user": "u1"}'])
>>> batch.dense.tolist(), batch.tables["ids"].offsets.tolist(), batch.tables["ids"].inverse.tolist()
([[0.0], [0.0]], [0, 1, 2, 3, 3], [0, 1, 0])
>>> builder.build([b'{"user": 7}']) is None  # an int in a string field: the columnar path says why
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.codecs.joined import JoinedPayloads
from connectors.codecs.json_scan import ScanPlan, scan_values
from connectors.codecs.json_sparse import sparse_elements
from connectors.codecs.steps import join, utf8_ok
from connectors.spec import DenseField, FeatureSpec
from pipeline.batch import transform_dense
from pipeline.plain import PlainBatchBuilder
from pipeline.types import FlatBatch, PreparedBatch

__all__ = ["JsonScanBuilder"]


class JsonScanBuilder:
    """Builds ``build_batch``'s batch from JSON records' bytes, or answers None."""

    def __init__(self, spec: FeatureSpec) -> None:
        self.spec = spec
        # Its hash, dedup and tables are the plain path's; callers share this one.
        self.plain = PlainBatchBuilder(spec)
        self._plan = ScanPlan.of(spec)
        fields = self.plain.sparse_fields
        self._kind, self._slot = self._plan.sparse_layout(fields)
        self._max_len = np.array([f.max_len for f in fields], dtype=np.int64)
        dense = spec.dense
        inf = np.inf
        self._min_value = np.array([-inf if d.min_value is None else d.min_value for d in dense])
        self._max_value = np.array([inf if d.max_value is None else d.max_value for d in dense])
        self._no_fill = np.array([d.fill is None for d in dense], dtype=np.bool_)
        self._fill = np.array([0.0 if d.fill is None else d.fill for d in dense])
        # The fields that share a transform and clipping take one call (None: all of them).
        groups: dict[tuple[object, ...], list[int]] = {}
        for j, d in enumerate(dense):
            if d.transform != "none" or d.clip_min is not None or d.clip_max is not None:
                groups.setdefault((d.transform, d.clip_min, d.clip_max), []).append(j)
        self._transforms: list[tuple[npt.NDArray[np.int64] | None, DenseField]] = [
            (None if js == list(range(len(dense))) else np.array(js, np.int64), dense[js[0]])
            for js in groups.values()
        ]

    def build(self, payloads: Sequence[bytes]) -> PreparedBatch | None:
        """The batch of ``payloads`` (one JSON object each), or None when one is not
        plainly good."""
        flat = self.scan(payloads)
        if flat is None:
            return None
        return PreparedBatch(flat.labels, flat.dense, self.plain.tables_of(flat.ids))

    def scan(self, payloads: Sequence[bytes]) -> FlatBatch | None:
        """:meth:`build`'s batch with its tables' ids still in shared arrays."""
        n = len(payloads)
        if n == 0:
            return None
        joined: bytes | npt.NDArray[np.uint8]
        if isinstance(payloads, JoinedPayloads):  # read where they lie, UTF-8 known
            if not payloads.utf8:
                return None
            joined, starts, ends = payloads.buffer, payloads.starts, payloads.ends
        elif any(type(p) is not bytes for p in payloads):
            return None
        else:
            joined, bounds, _ = join(payloads, {})
            if not utf8_ok(joined):
                return None
            starts, ends = bounds[:-1], bounds[1:] - 1  # newline-separated
        if not _spans_within(starts, ends, self.spec.max_record_bytes):
            return None
        skip = np.zeros(n, dtype=np.bool_)
        values = scan_values(joined, starts, skip, self._plan, ends)
        labels = np.empty((n, len(self.spec.labels)), dtype=np.float32)
        dense = np.empty((n, len(self.spec.dense)), dtype=np.float64)
        if not _checked_floats(
            values.status, values.fstate, values.fval, self.spec.labels_required,
            self._min_value, self._max_value, self._no_fill, self._fill, labels, dense,
        ):  # fmt: skip
            return None
        elements = sparse_elements(values, self._kind, self._slot, self._max_len)
        if elements is None:
            return None
        ids = self.plain.hasher.scanned_ids(
            elements.is_string, elements.field_of, elements.string_offsets, elements.strings,
            elements.ints,
        )  # fmt: skip
        return FlatBatch(
            labels, self._transformed(dense), self.plain.flat_ids(ids, elements.lengths)
        )

    def _transformed(self, dense: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
        """The filled dense matrix transformed, fields that share a transform at once."""
        for columns, d in self._transforms:
            if columns is None:
                transform_dense(dense, d)
            else:
                block = dense[:, columns]
                transform_dense(block, d)
                dense[:, columns] = block
        return dense.astype(np.float32)


@nb.njit(nogil=True, cache=True)
def _spans_within(starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64], limit: int) -> bool:
    """Whether every span is of 1 to ``limit`` bytes (one call where numpy took three)."""
    for i in range(starts.shape[0]):
        n = ends[i] - starts[i]
        if n < 1 or n > limit:
            return False
    return True


@nb.njit(nogil=True, cache=True)
def _checked_floats(
    status: npt.NDArray[np.uint8], fstate: npt.NDArray[np.uint8], fval: npt.NDArray[np.float64],
    labels_required: bool, min_value: npt.NDArray[np.float64],
    max_value: npt.NDArray[np.float64], no_fill: npt.NDArray[np.bool_],
    fill: npt.NDArray[np.float64], labels: npt.NDArray[np.float32],
    dense: npt.NDArray[np.float64],
) -> bool:  # fmt: skip
    """The scanned labels (NaN where absent) into ``labels`` and the dense values,
    absent ones filled, into ``dense``; False, part written, where a record is not
    plainly good: left to ``json.loads``, a number beyond the fast path, a label
    absent or outside [0, 1] where labels are required, a value outside its field's
    bounds, or one absent without a fill."""
    n_labels = labels.shape[1]
    for i in range(status.shape[0]):
        if status[i] != 0:
            return False
        for j in range(fstate.shape[1]):
            if fstate[i, j] == 2:
                return False
        for j in range(n_labels):
            v = fval[i, j] if fstate[i, j] > 0 else np.nan
            if labels_required and not (v >= 0.0 and v <= 1.0):  # NaN fails both
                return False
            labels[i, j] = v
        for k in range(dense.shape[1]):
            j = n_labels + k
            if fstate[i, j] > 0:
                v = fval[i, j]
                if v < min_value[k] or v > max_value[k]:
                    return False
            elif no_fill[k]:
                return False
            else:
                v = fill[k]
            dense[i, k] = v
    return True
