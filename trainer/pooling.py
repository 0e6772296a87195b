"""From a ``PreparedBatch`` (numpy) to torch tensors, pooled embeddings and row gradients.

The rows of a batch's unique ids are a leaf tensor per table; pooling gathers
them into bags with one ``embedding_bag`` call per table, so after
``backward()`` each leaf's ``.grad`` is exactly the per-unique-id gradient the
trainer pushes to the store (duplicate ids already summed by autograd).

>>> import numpy as np
>>> from connectors.spec import FeatureSpec
>>> from pipeline.types import PreparedBatch, TableBatch
>>> spec = FeatureSpec.model_validate({"labels": ["y"], "sparse": [
...     {"name": "tags", "table": "t", "type": "list_int", "pooling": "mean"}]})
>>> batch = PreparedBatch(
...     labels=np.array([[1.0], [0.0]], np.float32),
...     dense=np.zeros((2, 0), np.float32),
...     tables={"t": TableBatch(
...         fields=("tags",),
...         unique_ids=np.array([5, 6], np.uint64),
...         inverse=np.array([0, 1, 0], np.int32),
...         offsets=np.array([0, 3, 3], np.int32),  # sample 1 has no tags
...         rows=np.array([[1.0, 2.0], [4.0, 8.0]], np.float32),
...         pooling=("mean",))})
>>> bt = to_tensors(batch, spec)
>>> (pooled,) = pool(bt, spec)
>>> pooled.tolist()  # mean of rows 5, 6, 5; an empty bag pools to zeros
[[2.0, 4.0], [0.0, 0.0]]
>>> pooled.sum().backward()
>>> row_grads(bt)["t"].astype(float).round(3).tolist()  # id 5 is 2 of the bag's 3 ids
[[0.667, 0.667], [0.333, 0.333]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from connectors.spec import FeatureSpec
from pipeline.types import PreparedBatch, TableBatch

POOLING_MODES = ("sum", "mean")


@dataclass
class TableTensors:
    """One table's part of a batch, on the training device.

    ``rows`` is a float32 leaf with ``requires_grad=True``; ``inverse`` maps
    each id occurrence (in bag order) to its row; ``offsets`` (``B * F + 1``
    entries) delimits the sample-major bags.
    """

    rows: Tensor  # [U, dim] float32, leaf
    inverse: Tensor  # [nnz] int64
    offsets: Tensor  # [B * F + 1] int64
    fields: tuple[str, ...]
    pooling: tuple[str, ...]  # "sum" or "mean" per field
    one_per_bag: bool = False  # every bag holds exactly one id (pooling is a gather)


@dataclass
class BatchTensors:
    """A ``PreparedBatch`` as torch tensors: labels ``[B, T]``, dense ``[B, D]``, tables."""

    labels: Tensor  # [B, T] float32
    dense: Tensor  # [B, D] float32
    tables: dict[str, TableTensors]

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])


_NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.float32: np.float32,
    torch.int64: np.int64,
}


def _to_device(
    array: npt.NDArray[np.generic],
    device: torch.device,
    non_blocking: bool,
    pin: bool,
    dtype: torch.dtype,
) -> Tensor:
    if device.type == "cpu":
        want = _NUMPY_DTYPES[dtype]
        if array.dtype != want:
            # Widened in one pass into a new array (float16 rows, int32 indices).
            return torch.from_numpy(np.ascontiguousarray(array, dtype=want))
        if not array.flags.writeable:
            # Arrays unpickled from a Dask message or decoded from a gRPC reply are
            # read-only views; torch.from_numpy would share (and warn about) them.
            array = array.copy()
        return torch.from_numpy(np.ascontiguousarray(array))
    if not array.flags.writeable:
        array = array.copy()
    t = torch.from_numpy(np.ascontiguousarray(array))
    if pin:
        # A copy from pageable memory is synchronous whatever non_blocking says;
        # from pinned memory it overlaps with compute already queued.
        t = t.pin_memory()
    # Narrow types travel narrow and are widened on the device.
    return t.to(device, non_blocking=non_blocking).to(dtype)


def checked_table(
    batch: PreparedBatch, spec: FeatureSpec, name: str, fields: tuple[str, ...]
) -> tuple[TableBatch, tuple[str, ...]]:
    """``batch``'s table ``name``, checked against the spec's ``fields``, and its pooling.

    The table must be there, with the spec's fields in its order, their pooling
    (where the batch says), and looked-up rows, one per unique id.
    """
    pooling = tuple(spec.field(f).pooling for f in fields)
    return checked_pooled_table(batch, name, fields, pooling), pooling


def checked_pooled_table(
    batch: PreparedBatch, name: str, fields: tuple[str, ...], pooling: tuple[str, ...]
) -> TableBatch:
    """:func:`checked_table` with the fields' ``pooling`` already known."""
    tb = batch.tables.get(name)
    if tb is None:
        msg = f"batch has no table {name!r} (it has {sorted(batch.tables)}); the spec needs it"
        raise ValueError(msg)
    if tb.fields != fields:
        msg = f"table {name!r}: batch fields {tb.fields} differ from the spec's {fields}"
        raise ValueError(msg)
    if tb.pooling and tb.pooling != pooling:
        msg = f"table {name!r}: batch pooling {tb.pooling} differs from the spec's {pooling}"
        raise ValueError(msg)
    if tb.rows is None:
        msg = f"table {name!r} has no rows: look the batch up in the store first"
        raise ValueError(msg)
    if tb.rows.ndim != 2 or tb.rows.shape[0] != tb.unique_ids.shape[0]:
        msg = (
            f"table {name!r}: rows of shape {tb.rows.shape} for {tb.unique_ids.shape[0]} unique ids"
        )
        raise ValueError(msg)
    return tb


def host_tensor(array: npt.NDArray[np.generic], dtype: torch.dtype = torch.float32) -> Tensor:
    """``array`` as a CPU tensor of ``dtype`` that owns (or may write) its memory.

    >>> host_tensor(np.array([1, 2], np.int32), torch.int64).tolist()
    [1, 2]
    """
    return _to_device(array, torch.device("cpu"), False, False, dtype)


def to_tensors(
    batch: PreparedBatch,
    spec: FeatureSpec,
    device: torch.device | str = "cpu",
    non_blocking: bool = False,
    pin_memory: bool = False,
) -> BatchTensors:
    """The tensors of ``batch`` on ``device``; every table named by ``spec`` must have rows.

    Rows held as float16 travel as float16 and are widened on the device (half
    the bytes to copy); the index arrays are widened to int64 there as well.
    ``pin_memory`` and ``non_blocking`` only matter for a CUDA ``device``.
    """
    dev = torch.device(device)
    pin = pin_memory and dev.type == "cuda"
    tables: dict[str, TableTensors] = {}
    for name, fields in spec.tables().items():
        tb, pooling = checked_table(batch, spec, name, fields)
        assert tb.rows is not None  # checked
        rows = _to_device(tb.rows, dev, non_blocking, pin, torch.float32)
        bags = tb.offsets.shape[0] - 1
        tables[name] = TableTensors(
            rows=rows.requires_grad_(True),
            inverse=_to_device(tb.inverse, dev, non_blocking, pin, torch.int64),
            offsets=_to_device(tb.offsets, dev, non_blocking, pin, torch.int64),
            fields=fields,
            pooling=pooling,
            # Decided on the host, from the arrays at hand: no device sync in pool().
            one_per_bag=bool(tb.inverse.shape[0] == bags > 0 and np.all(np.diff(tb.offsets) == 1)),
        )
    return BatchTensors(
        labels=_to_device(batch.labels, dev, non_blocking, pin, torch.float32),
        dense=_to_device(batch.dense, dev, non_blocking, pin, torch.float32),
        tables=tables,
    )


def pool_table(
    weight: Tensor,
    indices: Tensor,
    offsets: Tensor,
    pooling: Sequence[str],
    batch_size: int,
    *,
    sparse: bool = False,
    one_per_bag: bool = False,
) -> Tensor:
    """Pool sample-major bags of ``weight`` rows: ``[batch_size, len(pooling), dim]``.

    Bag ``b * F + f`` (``F = len(pooling)``) is field ``f`` of sample ``b``;
    ``indices`` are rows of ``weight`` and ``offsets`` has ``B * F + 1``
    entries. One ``embedding_bag`` sums every bag; mean fields are then divided
    by their bag lengths (an empty bag stays 0). ``sparse=True`` gives
    ``weight`` a sparse gradient (a full table, as ``nn.EmbeddingBag`` has).
    ``one_per_bag=True`` says every bag holds exactly one id (``offsets`` is
    ``0, 1, ..., B * F``), as with one categorical value per field: sum and
    mean are then a plain gather, whose backward is one scatter-add instead of
    ``embedding_bag``'s sort and segment reduction.

    >>> w = torch.tensor([[1.0], [10.0]])
    >>> pool_table(w, torch.tensor([0, 1, 1]), torch.tensor([0, 2, 3]), ["sum", "mean"], 1)
    tensor([[[11.],
             [10.]]])
    """
    num_fields = len(pooling)
    if offsets.shape[0] != batch_size * num_fields + 1:
        msg = (
            f"offsets has {offsets.shape[0]} entries; {batch_size} samples x {num_fields} "
            f"fields need {batch_size * num_fields + 1}"
        )
        raise ValueError(msg)
    for mode in pooling:
        if mode not in POOLING_MODES:
            msg = f"unknown pooling {mode!r}: use one of {POOLING_MODES}"
            raise ValueError(msg)
    dim = weight.shape[1]
    if one_per_bag and not sparse:
        return weight.index_select(0, indices).view(batch_size, num_fields, dim)
    if indices.shape[0] == 0:
        # embedding_bag rejects an empty weight; with no ids every bag is empty anyway.
        return weight.new_zeros((batch_size, num_fields, dim))
    summed = torch.nn.functional.embedding_bag(
        indices, weight, offsets, mode="sum", sparse=sparse, include_last_offset=True
    ).view(batch_size, num_fields, dim)
    means = [f for f, mode in enumerate(pooling) if mode == "mean"]
    if not means:
        return summed
    lengths = (offsets[1:] - offsets[:-1]).view(batch_size, num_fields)
    divisor = torch.ones((batch_size, num_fields), dtype=weight.dtype, device=weight.device)
    cols = torch.tensor(means, device=weight.device)
    divisor[:, cols] = lengths[:, cols].clamp(min=1).to(weight.dtype)
    return summed / divisor.unsqueeze(-1)


def pool(bt: BatchTensors, spec: FeatureSpec) -> list[Tensor]:
    """One pooled ``[B, dim]`` tensor per sparse field, in ``spec.sparse`` order."""
    pooled: dict[str, Tensor] = {}
    for t in bt.tables.values():
        out = pool_table(
            t.rows, t.inverse, t.offsets, t.pooling, bt.batch_size, one_per_bag=t.one_per_bag
        )
        # One unbind, not a select per field: each select's backward would write a
        # zero [B, F, dim] gradient of its own, F of them to add up per table.
        for field, column in zip(t.fields, out.unbind(1), strict=True):
            pooled[field] = column
    missing = [s.name for s in spec.sparse if s.name not in pooled]
    if missing:
        msg = f"sparse fields {missing} are in no table of the batch tensors"
        raise ValueError(msg)
    return [pooled[s.name] for s in spec.sparse]


def row_grads(bt: BatchTensors) -> dict[str, npt.NDArray[np.float32]]:
    """Each table's gradient per unique id (float32 ``[U, dim]``), zeros where none flowed.

    Call after ``backward()``; this is what the trainer pushes to the store.
    """
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name, t in bt.tables.items():
        grad = t.rows.grad
        if grad is None:
            out[name] = np.zeros(tuple(t.rows.shape), dtype=np.float32)
        else:
            out[name] = grad.detach().to(device="cpu", dtype=torch.float32).numpy()
    return out
