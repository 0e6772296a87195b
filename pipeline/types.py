"""``PreparedBatch``: what a Dask worker hands a trainer (numpy arrays only).

Per table, the ids of every bag of every sample are deduplicated:
``unique_ids[inverse]`` gives the ids in bag order, and ``offsets`` delimits the
bags. Bags are sample-major: bag ``b * F + f`` is field ``f`` (in the order of
``fields``) of sample ``b``, so ``offsets`` has ``B * F + 1`` entries and pooled
embeddings reshape to ``[B, F, dim]``.

>>> import numpy as np
>>> t = TableBatch(
...     fields=("user",),
...     unique_ids=np.array([7, 9], dtype=np.uint64),
...     inverse=np.array([0, 1, 0], dtype=np.int32),
...     offsets=np.array([0, 1, 2, 3], dtype=np.int32),
... )
>>> t.unique_ids[t.inverse].tolist(), t.num_bags
([7, 9, 7], 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass
class TableBatch:
    """The ids one table receives from one batch, deduplicated, and their rows."""

    fields: tuple[str, ...]
    unique_ids: npt.NDArray[np.uint64]
    inverse: npt.NDArray[np.int32]
    offsets: npt.NDArray[np.int32]
    rows: npt.NDArray[np.floating] | None = None  # [U, dim], after the store lookup
    pooling: tuple[str, ...] = ()  # "sum" or "mean" per field

    @property
    def num_bags(self) -> int:
        return int(self.offsets.shape[0] - 1)


@dataclass
class PreparedBatch:
    """One chunk's records, decoded, validated, hashed and looked up."""

    labels: npt.NDArray[np.float32]  # [B, T]
    dense: npt.NDArray[np.float32]  # [B, D]
    tables: dict[str, TableBatch]
    source: str = ""
    partition: str = ""
    start: int = 0  # the chunk's range [start, end) in its partition
    end: int = 0
    bad_records: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    looked_up_at: float = 0.0  # unix time the rows were read from the store; 0: not looked up

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class FlatIds:
    """Every table's deduplicated ids in shared arrays: what ``TableBatch`` views
    would hold, before any is made (a prediction request's few ids in each of
    dozens of tables cost more in objects than in work).

    Table ``t`` (in ``spec.tables()`` order) has the unique ids
    ``unique[unique_at[t]:unique_at[t + 1]]``, the inverse
    ``inverse[inverse_at[t]:inverse_at[t + 1]]`` (into its own unique ids) and the
    bag offsets ``offsets[offsets_at[t]:offsets_at[t + 1]]`` (into its inverse).
    ``firsts[t]`` is its first field among every table's fields side by side.
    """

    unique: npt.NDArray[np.uint64]
    unique_at: npt.NDArray[np.int64]
    inverse: npt.NDArray[np.int32]
    inverse_at: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int32]
    offsets_at: npt.NDArray[np.int64]
    firsts: npt.NDArray[np.int64]


@dataclass(frozen=True)
class FlatBatch:
    """Records read to a batch whose tables are still :class:`FlatIds`."""

    labels: npt.NDArray[np.float32]  # [B, T]
    dense: npt.NDArray[np.float32]  # [B, D]
    ids: FlatIds

    def __len__(self) -> int:
        return int(self.labels.shape[0])
