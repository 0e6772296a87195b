"""Every sparse field of a batch pooled into one ``[B, sum(dims)]`` matrix, in one pass.

The general path (``trainer.pooling``) makes each table's rows a float32 leaf,
pools each table with its own torch op and joins the fields for the model,
whose backward splits the gradient again: dozens of small ops per step. Here,
where every field holds one id per sample (one categorical value, as in
Criteo) and all have one dim, the rows of all the tables are widened once, end
to end, and one ``index_select`` gathers the model's whole input; otherwise
one numba kernel per table writes its fields, sum- or mean-pooled, straight
into their columns. The backward is one numba pass that adds each field's
block of the matrix's gradient into its table's per-unique-id gradient. It
does in one pass what the general path does in dozens of small ops, which
matters most for a small model, whose step those ops dominate
(``benchmarks/e2e.py``'s ``step`` mode times the loop's step). Sums run in bag
order, so a step is deterministic; it equals the general path's up to float
rounding (bit for bit on the forward of one-id bags).

It is the trainer's path on a CPU; a CUDA device keeps the general one.

>>> import numpy as np
>>> from connectors.spec import FeatureSpec
>>> from pipeline.types import PreparedBatch, TableBatch
>>> spec = FeatureSpec.model_validate({"labels": ["y"], "sparse": [
...     {"name": "tags", "table": "t", "type": "list_int", "pooling": "mean"},
...     {"name": "user", "table": "u", "type": "int"}]})
>>> batch = PreparedBatch(
...     labels=np.array([[1.0], [0.0]], np.float32),
...     dense=np.zeros((2, 0), np.float32),
...     tables={
...         "t": TableBatch(
...             fields=("tags",),
...             unique_ids=np.array([5, 6], np.uint64),
...             inverse=np.array([0, 1, 0], np.int32),
...             offsets=np.array([0, 3, 3], np.int32),  # sample 1 has no tags
...             rows=np.array([[1.0, 2.0], [4.0, 8.0]], np.float16)),
...         "u": TableBatch(
...             fields=("user",),
...             unique_ids=np.array([9], np.uint64),
...             inverse=np.array([0, 0], np.int32),
...             offsets=np.array([0, 1, 2], np.int32),
...             rows=np.array([[0.5]], np.float32))})
>>> joined = JoinedFields(batch, spec)
>>> x = joined.tensor()
>>> x.tolist()  # tags: the mean of rows 5, 6, 5 (an empty bag is zeros); then user
[[2.0, 4.0, 0.5], [0.0, 0.0, 0.5]]
>>> x.sum().backward()
>>> grads = joined.row_grads()
>>> grads["t"].astype(float).round(3).tolist(), grads["u"].tolist()  # id 5: 2 of 3 ids
([[0.667, 0.667], [0.333, 0.333]], [[2.0]])
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from connectors.spec import FeatureSpec
from pipeline.types import FlatIds, PreparedBatch
from trainer.pooling import checked_pooled_table

__all__ = ["JoinedFields", "joined_flat", "widened"]

# A spec's sparse fields as (name, table, pooling), in spec order: what the layout of
# the joined matrix depends on, with the tables' dims.
_SpecKey = tuple[tuple[str, str, str], ...]


@functools.lru_cache(maxsize=64)
def _tables_of(key: _SpecKey) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each table's fields and their pooling, in spec order (``FeatureSpec.tables``)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    for name, table, pooling in key:
        fields, poolings = out.setdefault(table, ([], []))
        fields.append(name)
        poolings.append(pooling)
    return {t: (tuple(f), tuple(p)) for t, (f, p) in out.items()}


@dataclass(frozen=True)
class _Layout:
    """Where each table's fields go in the joined matrix (per table, in table order)."""

    width: int
    cols: tuple[npt.NDArray[np.int64], ...]  # each field's first column
    mean: tuple[npt.NDArray[np.bool_], ...]  # each field's mean flag
    one_id: tuple[npt.NDArray[np.int64], ...] | None  # each field's index; None: dims differ


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False  # shared by every batch of the spec
    return a


@functools.lru_cache(maxsize=64)
def _layout(key: _SpecKey, dims: tuple[int, ...]) -> _Layout:
    """The layout of the spec ``key`` with its tables' ``dims`` (in table order): the
    same for every batch, and a request's batch is small enough to notice making it."""
    tables = _tables_of(key)
    dim_of = dict(zip(tables, dims, strict=True))
    starts: dict[str, int] = {}
    column = 0
    for name, table, _ in key:
        starts[name] = column
        column += dim_of[table]
    index_of = {name: i for i, (name, _, _) in enumerate(key)}
    return _Layout(
        width=column,
        cols=tuple(
            _frozen(np.array([starts[f] for f in fs], np.int64)) for fs, _ in tables.values()
        ),
        mean=tuple(
            _frozen(np.array([p == "mean" for p in ps], np.bool_)) for _, ps in tables.values()
        ),
        one_id=tuple(
            _frozen(np.array([index_of[f] for f in fs], np.int64)) for fs, _ in tables.values()
        )
        if len(set(dims)) == 1
        else None,
    )


@nb.njit(nogil=True, cache=True)
def _gather_flat(
    rows: npt.NDArray[np.float32],
    unique_at: npt.NDArray[np.int64],
    inverse: npt.NDArray[np.int32],
    inverse_at: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int32],
    offsets_at: npt.NDArray[np.int64],
    firsts: npt.NDArray[np.int64],
    cols: npt.NDArray[np.int64],
    mean: npt.NDArray[np.bool_],
    out: npt.NDArray[np.float32],
) -> None:
    """Every table's fields, sum- or mean-pooled, into their columns of ``out``, from
    shared arrays (``pipeline.types.FlatIds``): table ``t``'s unique ids have their rows
    from ``rows[unique_at[t]]`` on, and its bags ``b * fields + k``. Sums run in bag
    order; a bag of one id is a copy."""
    dim = rows.shape[1]
    acc = np.empty(dim, dtype=np.float32)
    for t in range(firsts.shape[0] - 1):
        f0 = firsts[t]
        fields = firsts[t + 1] - f0
        ub, ib, ob = unique_at[t], inverse_at[t], offsets_at[t]
        for b in range(out.shape[0]):
            for k in range(fields):
                bag = ob + b * fields + k
                lo = offsets[bag]
                hi = offsets[bag + 1]
                c = cols[f0 + k]
                if hi - lo == 1:  # one id: a copy (as the per-table kernel and index_select)
                    r = ub + inverse[ib + lo]
                    for d in range(dim):
                        out[b, c + d] = rows[r, d]
                    continue
                for d in range(dim):
                    acc[d] = 0.0
                for j in range(lo, hi):
                    r = ub + inverse[ib + j]
                    for d in range(dim):
                        acc[d] += rows[r, d]
                n = np.float32(hi - lo) if mean[f0 + k] and hi - lo > 1 else np.float32(1.0)
                for d in range(dim):
                    out[b, c + d] = acc[d] / n


@nb.njit(nogil=True, cache=True)
def _gather(
    rows: npt.NDArray[np.float32],
    inverse: npt.NDArray[np.int32],
    offsets: npt.NDArray[np.int32],
    cols: npt.NDArray[np.int64],
    mean: npt.NDArray[np.bool_],
    out: npt.NDArray[np.float32],
) -> None:
    """One table's fields pooled into their columns of ``out``: ``_gather_flat`` of it."""
    _gather_flat(
        rows, np.array([0, rows.shape[0]]), inverse, np.array([0, inverse.shape[0]]), offsets,
        np.array([0, offsets.shape[0]]), np.array([0, cols.shape[0]]), cols, mean, out,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _flat_layout(
    key: _SpecKey, dim: int, lead: int = 0
) -> tuple[int, npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The width, and each field's first column and mean flag in table order, of the
    spec ``key`` with every table of dim ``dim``, after ``lead`` columns."""
    layout = _layout(key, (dim,) * len(_tables_of(key)))
    width = lead + layout.width
    if not layout.cols:
        return width, _frozen(np.zeros(0, np.int64)), _frozen(np.zeros(0, np.bool_))
    return width, _frozen(np.concatenate(layout.cols) + lead), _frozen(np.concatenate(layout.mean))


def sparse_key(spec: FeatureSpec) -> _SpecKey:
    """What the joined layout of ``spec`` depends on: each sparse field's name, table and
    pooling (a caller that joins many batches of one spec makes it once)."""
    return tuple((s.name, s.table, s.pooling) for s in spec.sparse)


def joined_flat(
    rows: npt.NDArray[np.float32],
    flat: FlatIds,
    key: _SpecKey,
    batch_size: int,
    lead: npt.NDArray[np.float32] | None = None,
) -> Tensor:
    """The joined ``[B, width]`` matrix of :class:`JoinedFields`, straight from every
    table's ids in shared arrays and their rows side by side (``rows[unique_at[t]]`` on
    for table ``t``; every table of one dim): no per-table objects, for a prediction
    request's few ids in each of dozens of tables. Equal to ``JoinedFields.gather``
    bit for bit: the same copies and the same sums in the same order. With ``lead``
    (``[B, k]``), its columns come first: ``concat(dense, joined)`` in one matrix.

    >>> from connectors.spec import FeatureSpec
    >>> from pipeline.types import FlatIds
    >>> spec = FeatureSpec.model_validate({"labels": ["y"], "sparse": [
    ...     {"name": "user", "table": "u", "type": "int"},
    ...     {"name": "tags", "table": "t", "type": "list_int", "pooling": "mean"}]})
    >>> flat = FlatIds(  # table u: one id per sample; table t: sample 0 has 5, 6, 5
    ...     unique=np.array([9, 5, 6], np.uint64), unique_at=np.array([0, 1, 3]),
    ...     inverse=np.array([0, 0, 0, 1, 0], np.int32), inverse_at=np.array([0, 2, 5]),
    ...     offsets=np.array([0, 1, 2, 0, 3, 3], np.int32), offsets_at=np.array([0, 3, 6]),
    ...     firsts=np.array([0, 1, 2]))
    >>> rows = np.array([[0.5, 0.5], [1.0, 2.0], [4.0, 8.0]], np.float32)
    >>> joined_flat(rows, flat, sparse_key(spec), 2).tolist()  # user, then the tags' mean
    [[0.5, 0.5, 2.0, 4.0], [0.5, 0.5, 0.0, 0.0]]
    >>> joined_flat(rows, flat, sparse_key(spec), 2, np.array([[7], [8]], np.float32)).tolist()
    [[7.0, 0.5, 0.5, 2.0, 4.0], [8.0, 0.5, 0.5, 0.0, 0.0]]
    """
    k = 0 if lead is None else int(lead.shape[1])
    width, cols, mean = _flat_layout(key, int(rows.shape[1]), k)
    out = np.empty((batch_size, width), dtype=np.float32)
    if lead is not None:
        out[:, :k] = lead
    _gather_flat(
        np.ascontiguousarray(rows, dtype=np.float32), flat.unique_at, flat.inverse,
        flat.inverse_at, flat.offsets, flat.offsets_at, flat.firsts, cols, mean, out,
    )  # fmt: skip
    return torch.from_numpy(out)


@nb.njit(nogil=True, cache=True)
def _scatter(
    grad_out: npt.NDArray[np.float32],
    inverse: npt.NDArray[np.int32],
    offsets: npt.NDArray[np.int32],
    cols: npt.NDArray[np.int64],
    mean: npt.NDArray[np.bool_],
    grad_rows: npt.NDArray[np.float32],
) -> None:
    fields = cols.shape[0]
    dim = grad_rows.shape[1]
    for b in range(grad_out.shape[0]):
        for k in range(fields):
            bag = b * fields + k
            lo = offsets[bag]
            hi = offsets[bag + 1]
            c = cols[k]
            if mean[k] and hi - lo > 1:
                n = np.float32(hi - lo)
                for j in range(lo, hi):
                    r = inverse[j]
                    for d in range(dim):
                        grad_rows[r, d] += grad_out[b, c + d] / n
            else:
                for j in range(lo, hi):
                    r = inverse[j]
                    for d in range(dim):
                        grad_rows[r, d] += grad_out[b, c + d]


@nb.njit(nogil=True, cache=True)
def _fill_one_id(
    inverse: npt.NDArray[np.int32],
    offsets: npt.NDArray[np.int32],
    columns: npt.NDArray[np.int64],
    base: int,
    index: npt.NDArray[np.int64],
) -> bool:
    """Fill the table's fields' columns of ``index``; False if a bag holds not one id."""
    fields = columns.shape[0]
    if inverse.shape[0] != offsets.shape[0] - 1:
        return False
    for bag in range(offsets.shape[0] - 1):
        if offsets[bag + 1] - offsets[bag] != 1:
            return False
    for b in range(index.shape[0]):
        for k in range(fields):
            index[b, columns[k]] = inverse[b * fields + k] + base
    return True


@nb.njit(nogil=True, cache=True)
def _scatter_one_id(
    grad_out: npt.NDArray[np.float32],
    index: npt.NDArray[np.int64],
    grad_rows: npt.NDArray[np.float32],
) -> None:
    dim = grad_rows.shape[1]
    for b in range(index.shape[0]):
        for f in range(index.shape[1]):
            r = index[b, f]
            c = f * dim
            for d in range(dim):
                grad_rows[r, d] += grad_out[b, c + d]


def widened(rows: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """``rows`` as float32 (float16 rows widened by torch: numpy's cast is much slower)."""
    if rows.dtype == np.float32:
        return np.ascontiguousarray(rows)
    with warnings.catch_warnings():
        # Rows unpickled from a Dask message are read-only; torch only reads them here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(rows)).float().numpy()


class _Join(torch.autograd.Function):
    """The joined matrix; its backward hands the gradient to the ``JoinedFields``."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, fields: JoinedFields) -> Tensor:
        ctx.fields = fields
        return fields.gather()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.fields.scatter(grad)
        return None, None


class JoinedFields:
    """A batch's sparse fields, pooled side by side (``spec.sparse`` order), on a CPU.

    :meth:`tensor` is the ``[B, sum(dims)]`` float32 input of a model's
    ``forward_joined``; once the loss is back-propagated through it,
    :meth:`row_grads` are the per-unique-id gradients to push, as
    ``trainer.pooling.row_grads`` gives them on the general path.
    """

    def __init__(self, batch: PreparedBatch, spec: FeatureSpec) -> None:
        self.batch_size = len(batch)
        key = sparse_key(spec)
        checked = [
            (name, checked_pooled_table(batch, name, fields, pooling))
            for name, (fields, pooling) in _tables_of(key).items()
        ]
        dims = tuple(int(tb.rows.shape[1]) for _, tb in checked if tb.rows is not None)
        layout = _layout(key, dims)
        self.width = layout.width
        # Per table: the batch's arrays, each field's first column, and its mean flag.
        self._tables: list[tuple[str, Any, Any, Any, npt.NDArray[np.int64], Any]] = []
        for (name, tb), cols, mean in zip(checked, layout.cols, layout.mean, strict=True):
            fields = tb.fields
            if tb.offsets.shape[0] != self.batch_size * len(fields) + 1:
                msg = (
                    f"table {name!r}: offsets has {tb.offsets.shape[0]} entries; "
                    f"{self.batch_size} samples x {len(fields)} fields need "
                    f"{self.batch_size * len(fields) + 1}"
                )
                raise ValueError(msg)
            inverse = np.ascontiguousarray(tb.inverse, dtype=np.int32)
            offsets = np.ascontiguousarray(tb.offsets, dtype=np.int32)
            self._tables.append((name, tb.rows, inverse, offsets, cols, mean))
        self._grads: dict[str, npt.NDArray[np.float32]] | None = None
        self._every_grad: npt.NDArray[np.float32] | None = None  # the one-id path's
        self._one_id = self._one_id_index(layout.one_id, len(key))

    def _one_id_index(
        self, columns: tuple[npt.NDArray[np.int64], ...] | None, num_fields: int
    ) -> npt.NDArray[np.int64] | None:
        """Where every bag holds one id and every field has one dim (one categorical
        value per field, as in Criteo): per sample and field (``spec.sparse``
        order), the id's row among all the tables' rows put end to end. None
        otherwise (the per-table kernels pool any bags). ``columns``: each table's
        fields' indices (None: the dims differ).
        """
        if columns is None:
            return None
        index = np.empty((self.batch_size, num_fields), dtype=np.int64)
        base = 0
        for (_, rows, inverse, offsets, _, _), cols in zip(self._tables, columns, strict=True):
            if not _fill_one_id(inverse, offsets, cols, base, index):
                return None
            base += int(rows.shape[0])
        return index

    def gather(self) -> Tensor:
        """The pooled fields side by side, ``[B, width]`` (no autograd: see :meth:`tensor`)."""
        if self._one_id is not None:
            # One gather of whole rows, which torch copies faster than a numba loop.
            every = np.concatenate([rows for _, rows, _, _, _, _ in self._tables])
            wide = torch.from_numpy(every).float()  # a new array: writable
            index = torch.from_numpy(self._one_id).view(-1)
            return wide.index_select(0, index).view(self.batch_size, self.width)
        out = np.empty((self.batch_size, self.width), dtype=np.float32)
        for _, rows, inverse, offsets, cols, mean in self._tables:
            _gather(widened(rows), inverse, offsets, cols, mean, out)
        return torch.from_numpy(out)

    def tensor(self) -> Tensor:
        """The joined ``[B, width]`` float32 tensor, whose backward fills :meth:`row_grads`."""
        anchor = torch.empty(0, requires_grad=True)  # makes autograd call the backward
        out: Tensor = _Join.apply(anchor, self)  # type: ignore[no-untyped-call]
        return out

    def scatter(self, grad: Tensor) -> None:
        """Add ``grad`` (``[B, width]``, the joined tensor's) into the rows' gradients."""
        g = grad.detach().to(device="cpu", dtype=torch.float32).numpy()
        grads = self._grads if self._grads is not None else self._fresh_grads()
        if self._one_id is not None:
            assert self._every_grad is not None  # made with the grads
            _scatter_one_id(g, self._one_id, self._every_grad)
        else:
            for name, _, inverse, offsets, cols, mean in self._tables:
                _scatter(g, inverse, offsets, cols, mean, grads[name])
        self._grads = grads

    def row_grads(self) -> dict[str, npt.NDArray[np.float32]]:
        """Each table's gradient per unique id (``[U, dim]`` float32), zeros where none flowed."""
        return self._grads if self._grads is not None else self._fresh_grads()

    def _fresh_grads(self) -> dict[str, npt.NDArray[np.float32]]:
        """Zero gradients per table; on the one-id path views of one array, which
        ``_every_grad`` then holds (the scatter adds into it by global row)."""
        if self._one_id is None:
            return {
                name: np.zeros(rows.shape, dtype=np.float32)
                for name, rows, _, _, _, _ in self._tables
            }
        total = sum(int(rows.shape[0]) for _, rows, _, _, _, _ in self._tables)
        dim = int(self._tables[0][1].shape[1]) if self._tables else 0
        self._every_grad = np.zeros((total, dim), dtype=np.float32)
        out: dict[str, npt.NDArray[np.float32]] = {}
        base = 0
        for name, rows, _, _, _, _ in self._tables:
            out[name] = self._every_grad[base : base + rows.shape[0]]
            base += int(rows.shape[0])
        return out
