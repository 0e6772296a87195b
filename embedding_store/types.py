"""Configuration and result types of the embedding store, all in one module.

Configuration is a tree of frozen pydantic models that reject unknown keys, so a
misspelled YAML option is an error rather than a silently ignored setting.

>>> cfg = TableConfig(dim=8, optimizer={"kind": "adam", "lr": 0.01}, capacity=1000)
>>> cfg.optimizer.kind, cfg.optimizer.lr, cfg.initializer.kind
('adam', 0.01, 'uniform')
>>> TableConfig(dim=8, optimiser="sgd")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for TableConfig
optimiser
  Extra inputs are not permitted ...
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TABLE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

RowDtype = Literal["float16", "float32"]
CheckpointKind = Literal["full", "delta", "auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- initializers ---------------------------------------------------------------


class UniformInit(_Strict):
    """Rows start uniform in ``[-scale, scale)``, deterministic from (table, id, seed)."""

    kind: Literal["uniform"] = Field("uniform", description="uniform in [-scale, scale)")
    scale: float = Field(0.01, ge=0.0, description="half the width of the range")


class NormalInit(_Strict):
    """Rows start normal with ``mean`` and ``std``, deterministic from (table, id, seed)."""

    kind: Literal["normal"] = Field("normal", description="normal with mean and std")
    mean: float = Field(0.0, description="the mean")
    std: float = Field(0.01, ge=0.0, description="the standard deviation")


class ZerosInit(_Strict):
    """Rows start at zero (the usual choice for FTRL-trained linear weights)."""

    kind: Literal["zeros"] = Field("zeros", description="every weight 0")


InitializerConfig = Annotated[UniformInit | NormalInit | ZerosInit, Field(discriminator="kind")]


# --- sparse optimizers ----------------------------------------------------------


class SGDConfig(_Strict):
    """Stochastic gradient descent, with the semantics of ``torch.optim.SGD`` per row."""

    kind: Literal["sgd"] = Field("sgd", description="stochastic gradient descent")
    lr: float = Field(0.01, gt=0.0, description="learning rate")
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="momentum factor (a buffer per row)")
    dampening: float = Field(0.0, ge=0.0, le=1.0, description="dampening of the momentum")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum, no dampening)")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 penalty added to the gradient")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDConfig:
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            msg = (
                f"sgd: nesterov=True needs momentum > 0 and dampening == 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})"
            )
            raise ValueError(msg)
        return self


class AdagradConfig(_Strict):
    """Adagrad: element-wise (``torch.optim.Adagrad`` per row) or row-wise.

    Row-wise Adagrad keeps one accumulator per row (the mean of the squared
    gradient), which costs one float per row instead of ``dim``. The default
    rate, 0.05, is high because a row gets few updates and Adagrad's rate only
    falls from there (``benchmarks/quality.py`` compares rates on hot ids).

    >>> AdagradConfig().lr
    0.05
    """

    kind: Literal["adagrad"] = Field("adagrad", description="Adagrad")
    lr: float = Field(0.05, gt=0.0, description="learning rate")
    eps: float = Field(1e-10, gt=0.0, description="added to the root of the accumulator")
    initial_accumulator_value: float = Field(
        0.0, ge=0.0, description="where a new row's sum of squared gradients starts"
    )
    weight_decay: float = Field(0.0, ge=0.0, description="L2 penalty added to the gradient")
    lr_decay: float = Field(0.0, ge=0.0, description="lr / (1 + (updates - 1) * lr_decay)")
    rowwise: bool = Field(
        False, description="one accumulator per row (the mean squared gradient), not per weight"
    )


class AdamConfig(_Strict):
    """Adam with a per-row step count for bias correction (lazy Adam).

    ``decoupled_weight_decay=True`` gives AdamW.
    """

    kind: Literal["adam"] = Field("adam", description="Adam, bias-corrected per row")
    lr: float = Field(0.001, gt=0.0, description="learning rate")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="decay of the first moment")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="decay of the second moment")
    eps: float = Field(1e-8, gt=0.0, description="added to the root of the second moment")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 penalty (or AdamW's decay)")
    decoupled_weight_decay: bool = Field(False, description="AdamW: decay the weights directly")


class FTRLConfig(_Strict):
    """FTRL-Proximal (McMahan et al. 2013), per coordinate."""

    kind: Literal["ftrl"] = Field("ftrl", description="FTRL-Proximal")
    alpha: float = Field(0.05, gt=0.0, description="learning rate")
    beta: float = Field(1.0, ge=0.0, description="smooths the per-coordinate rate")
    l1: float = Field(0.0, ge=0.0, description="L1 strength (weights at exactly 0)")
    l2: float = Field(0.0, ge=0.0, description="L2 strength")
    initial_accumulator_value: float = Field(
        0.0, ge=0.0, description="where a new row's sum of squared gradients starts"
    )


OptimizerConfig = Annotated[
    SGDConfig | AdagradConfig | AdamConfig | FTRLConfig, Field(discriminator="kind")
]


# --- admission ------------------------------------------------------------------


class AlwaysAdmit(_Strict):
    """Every id gets a row the first time a training lookup sees it."""

    kind: Literal["always"] = Field("always", description="every new id gets a row")


class CountMinAdmission(_Strict):
    """An id gets a row once a count-min sketch has seen it ``threshold`` times."""

    kind: Literal["count_min"] = Field(
        "count_min", description="a row once the id was seen threshold times"
    )
    threshold: int = Field(2, ge=1, description="training lookups before an id gets a row")
    width: int = Field(1 << 20, ge=16, le=1 << 30, description="counters per row of the sketch")
    depth: int = Field(4, ge=1, le=16, description="rows of the sketch (hash functions)")


class ProbabilityAdmission(_Strict):
    """Each training lookup of a new id admits it with ``probability``.

    The draw is a hash of (id, seed, clock), so runs are reproducible.
    """

    kind: Literal["probability"] = Field(
        "probability", description="each lookup of a new id admits it at random"
    )
    probability: float = Field(0.5, gt=0.0, le=1.0, description="chance of admission per lookup")


AdmissionConfig = Annotated[
    AlwaysAdmit | CountMinAdmission | ProbabilityAdmission, Field(discriminator="kind")
]


# --- tables and the store -------------------------------------------------------


class TierConfig(_Strict):
    """A table larger than memory: at most ``memory_rows`` rows per shard in memory,
    the rest on local disk (``embedding_store.tier``), each with its optimizer state.
    The disk tier lives in the shard's data dir, under ``tier/``.

    >>> TierConfig(memory_rows=1_000_000).policy
    'lfu'
    """

    memory_rows: int = Field(
        ge=1, le=1 << 31, description="rows a shard keeps in memory; the rest go to disk"
    )
    policy: Literal["lfu", "lru"] = Field(
        "lfu",
        description="which rows leave memory first: the least often looked up (lfu), "
        "or the least recently (lru)",
    )
    readers: int = Field(
        16, ge=1, le=256, description="threads reading one lookup's rows from disk at once"
    )
    write_buffer_mb: int = Field(
        16,
        ge=1,
        le=4096,
        description="MiB of rows the disk engine buffers in memory before writing a file "
        "(two such buffers at most, per table and shard)",
    )


class TableConfig(_Strict):
    """One embedding table: its shape, initial values, optimizer and memory bounds."""

    dim: int = Field(ge=1, le=4096, description="weights per row")
    initializer: InitializerConfig = Field(
        default_factory=UniformInit, description="what a new row starts as"
    )
    optimizer: OptimizerConfig = Field(
        default_factory=AdagradConfig, description="how a push updates a row"
    )
    admission: AdmissionConfig = Field(
        default_factory=AlwaysAdmit, description="when a new id gets a row"
    )
    capacity: int = Field(1_000_000, ge=1, le=1 << 31, description="rows kept per shard")
    initial_rows: int = Field(1024, ge=1, description="rows allocated up front; grows to capacity")
    ttl_steps: int | None = Field(None, ge=1, description="rows unseen for this many steps expire")
    weight_clip: float | None = Field(None, gt=0.0, description="clamp weights to [-c, c]")
    seed: int = Field(0, ge=0, lt=1 << 63, description="of the initializer, with the name")
    change_log_ids: int = Field(
        1 << 20,
        ge=1,
        description="ids a shard remembers as changed for its serving replicas (8 bytes each); "
        "a replica further behind copies the table again",
    )
    tier: TierConfig | None = Field(
        None, description="keep only some rows in memory and the rest on local disk"
    )

    @model_validator(mode="after")
    def _tier_within_capacity(self) -> TableConfig:
        if self.tier is not None and self.tier.memory_rows > self.capacity:
            msg = (
                f"tier.memory_rows: {self.tier.memory_rows} is more than the table's capacity "
                f"{self.capacity}; a tiered table's capacity counts its rows on disk too"
            )
            raise ValueError(msg)
        return self


class StoreConfig(_Strict):
    """The tables a store shard serves and the limits of the service.

    >>> StoreConfig(tables={"user": {"dim": 16}}).tables["user"].dim
    16
    """

    tables: dict[str, TableConfig] = Field(min_length=1, description="the tables, by name")
    max_message_bytes: int = Field(
        64 << 20, ge=1024, le=(1 << 31) - 1, description="the largest gRPC message either way"
    )
    row_dtype: RowDtype = Field("float16", description="the dtype rows travel in to lookups")
    compression: Literal["zstd", "lz4", "none"] = Field(
        "zstd", description="of the checkpoint files"
    )
    full_checkpoint_every: int = Field(
        8, ge=1, description="with kind 'auto', a full snapshot after this many deltas"
    )
    keep_full_checkpoints: int = Field(
        2, ge=1, description="full snapshots kept (with their deltas); older ones are deleted"
    )
    remembered_push_ids: int = Field(65536, ge=1, description="push request ids kept for dedup")
    remembered_push_s: float = Field(
        300.0,
        gt=0,
        description=(
            "seconds a push request id is kept for dedup: longer than a client's retries "
            "of one push (the default RetryPolicy's longest, about 3 minutes), short "
            "enough that the shard's memory for them is flat within minutes"
        ),
    )
    server_threads: int = Field(8, ge=1, le=256, description="gRPC handler threads per shard")

    @field_validator("tables")
    @classmethod
    def _table_names(cls, tables: dict[str, TableConfig]) -> dict[str, TableConfig]:
        for name in tables:
            if not TABLE_NAME_PATTERN.match(name):
                msg = (
                    f"tables: invalid table name {name!r}: use letters, digits, '_', '.' "
                    "or '-', starting with a letter, digit or '_', at most 128 characters"
                )
                raise ValueError(msg)
        return tables


# --- results --------------------------------------------------------------------


@dataclass(frozen=True)
class RowBatch:
    """Rows taken out of (or going into) a table, each carrying its id."""

    ids: npt.NDArray[np.uint64]
    weights: npt.NDArray[np.float32]
    state: npt.NDArray[np.float32]
    row_step: npt.NDArray[np.int64]
    last_seen: npt.NDArray[np.int64]
    freq: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def select(self, mask: npt.NDArray[np.bool_]) -> RowBatch:
        """The rows where ``mask`` is true."""
        return RowBatch(
            self.ids[mask],
            self.weights[mask],
            self.state[mask],
            self.row_step[mask],
            self.last_seen[mask],
            self.freq[mask],
        )


@dataclass(frozen=True)
class RowState:
    """Rows with everything a push's arithmetic reads: weights, optimizer state and
    update count, one entry per id; ``row_step`` -1 marks an id without a row.
    """

    weights: npt.NDArray[np.float32]  # [n, dim]
    state: npt.NDArray[np.float32]  # [n, optimizer state width]
    row_step: npt.NDArray[np.int64]  # [n]

    def take(self, index: npt.NDArray[np.intp]) -> RowState:
        """The entries at ``index``, in its order."""
        return RowState(self.weights[index], self.state[index], self.row_step[index])


class FlatRows(Mapping[str, RowState]):
    """Rows of several tables held back to back, as one push reply brings them: a
    :class:`RowState` per table on demand (views), and all of them at once in
    :attr:`flat` where every table has the same dim and state width.

    >>> rows = FlatRows(["a", "b"], np.array([[1, 2, 0], [2, 2, 0]]), RowState(
    ...     np.arange(6, dtype=np.float32), np.zeros(0, np.float32), np.array([1, 2, 3])))
    >>> rows["b"].weights.tolist(), rows.flat.row_step.tolist(), list(rows)
    ([[2.0, 3.0], [4.0, 5.0]], [1, 2, 3], ['a', 'b'])
    """

    def __init__(
        self, names: Sequence[str], shapes: npt.NDArray[np.int64], packed: RowState
    ) -> None:
        """``shapes``: ``(rows, dim, state width)`` per table of ``names``; ``packed``: the
        weights and state flat (1-D), the update counts, every table's in order.
        """
        self.names = list(names)
        self.shapes = shapes
        self.packed = packed
        n, dims, widths = shapes[:, 0], shapes[:, 1], shapes[:, 2]
        # Where each table's rows, weights and state begin in ``packed``.
        starts = [np.cumsum(a) - a for a in (n, n * dims, n * widths)]
        self._at = {name: i for i, name in enumerate(self.names)}
        self._starts = np.stack(starts, axis=1).tolist()
        self.flat: RowState | None = None
        if self.names and bool((shapes[:, 1:] == shapes[0, 1:]).all()):
            total, dim, width = int(n.sum()), int(dims[0]), int(widths[0])
            self.flat = RowState(
                packed.weights.reshape(total, dim),
                packed.state.reshape(total, width),
                packed.row_step,
            )

    def __getitem__(self, name: str) -> RowState:
        i = self._at[name]
        n, dim, width = (int(v) for v in self.shapes[i])
        r, w, s = self._starts[i]
        return RowState(
            self.packed.weights[w : w + n * dim].reshape(n, dim),
            self.packed.state[s : s + n * width].reshape(n, width),
            self.packed.row_step[r : r + n],
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class ShardRows:
    """One shard's part of a push reply's rows: per table, the pushed ids the shard
    holds, where each was among the table's pushed ids (None: all, in order), and
    their rows after the push.
    """

    ids: Mapping[str, npt.NDArray[np.uint64]]
    where: Mapping[str, npt.NDArray[np.int64]] | None
    rows: Mapping[str, RowState]
    # The shard's PushResult.seen: which pushes of each writer the rows include.
    seen: tuple[int, ...] | None = None


class PushedRows(Mapping[str, RowState]):
    """A push reply's rows, each table's put back in the order of its pushed ids when
    first read; :attr:`parts` are the shards' answers as they came (a reader that
    needs no order, such as the trainer's cache, takes them without a merge).

    >>> one = RowState(np.ones((1, 2), np.float32), np.zeros((1, 0), np.float32), np.array([1]))
    >>> two = RowState(np.zeros((1, 2), np.float32), np.zeros((1, 0), np.float32), np.array([2]))
    >>> rows = PushedRows([
    ...     ShardRows({"t": np.array([9], np.uint64)}, {"t": np.array([1])}, {"t": one}),
    ...     ShardRows({"t": np.array([4], np.uint64)}, {"t": np.array([0])}, {"t": two})])
    >>> rows["t"].row_step.tolist(), list(rows)
    ([2, 1], ['t'])
    """

    def __init__(self, parts: Sequence[ShardRows]) -> None:
        self.parts = tuple(parts)
        self._merged: dict[str, RowState] = {}
        self._names = list(dict.fromkeys(name for part in self.parts for name in part.rows))

    def __getitem__(self, name: str) -> RowState:
        if name not in self._merged:
            have = [p for p in self.parts if name in p.rows]
            if not have:
                raise KeyError(name)
            if len(have) == 1 and have[0].where is None:
                self._merged[name] = have[0].rows[name]
            else:
                self._merged[name] = _merge_rows(
                    [(p.where[name] if p.where is not None else None, p.rows[name]) for p in have]
                )
        return self._merged[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _merge_rows(parts: list[tuple[npt.NDArray[np.int64] | None, RowState]]) -> RowState:
    """Shards' rows back in the order of the ids they were routed from."""
    n = sum(rows.row_step.shape[0] for _, rows in parts)
    first = parts[0][1]
    out = RowState(
        np.empty((n, first.weights.shape[1]), np.float32),
        np.empty((n, first.state.shape[1]), np.float32),
        np.empty(n, np.int64),
    )
    for where, rows in parts:
        at = slice(None) if where is None else where
        out.weights[at] = rows.weights
        out.state[at] = rows.state
        out.row_step[at] = rows.row_step
    return out


_ORIGIN = re.compile(r"(?P<group>.+)@(?P<rank>\d{1,6})/(?P<ranks>\d{1,6}):(?P<seq>\d{1,18}|read)")


@dataclass(frozen=True)
class PushOrigin:
    """Which push of which writer a push request is: the ``seq``-th (increasing, gaps
    allowed) of rank ``rank`` of the ``ranks`` writers of ``group`` (a job's ranks).

    It travels as the push's request id, so that every transport carries it; a
    shard answers such a push with the newest push of each of the group's ranks
    it had applied (``PushResult.seen``). A trainer rank learns from that which
    of the other ranks' pushes the rows of a reply include.

    A ``read`` origin (``seq`` 0) applies nothing: the shard answers with the rows as
    they are and what they include (:meth:`StoreClient.read_pushed
    <embedding_store.client.StoreClient.read_pushed>`), for a rank that holds a row
    whose pushes it cannot tell from its lookup.

    >>> origin = PushOrigin("job7", rank=1, ranks=2, seq=40)
    >>> origin.request_id
    'job7@1/2:40'
    >>> PushOrigin.parse("job7@1/2:40") == origin, PushOrigin.parse("client-3")
    (True, None)
    >>> PushOrigin.parse(PushOrigin("job7", 1, 2, 0, read=True).request_id).read
    True
    """

    group: str
    rank: int
    ranks: int
    seq: int
    read: bool = False

    @property
    def request_id(self) -> str:
        return f"{self.group}@{self.rank}/{self.ranks}:{'read' if self.read else self.seq}"

    @classmethod
    def parse(cls, request_id: str) -> PushOrigin | None:
        """The origin a request id names; None for an id of another form (or a rank
        outside its group)."""
        m = _ORIGIN.fullmatch(request_id)
        if m is None or int(m["rank"]) >= int(m["ranks"]):
            return None
        if m["seq"] == "read":
            return cls(m["group"], int(m["rank"]), int(m["ranks"]), 0, read=True)
        return cls(m["group"], int(m["rank"]), int(m["ranks"]), int(m["seq"]))


@dataclass(frozen=True)
class PushResult:
    """What one push did, summed over the tables it named.

    ``rows``: when the push asked for them, each table's pushed rows as the
    store holds them after the push (with their optimizer state), in the order
    of the pushed ids.
    """

    applied: int = 0
    dropped_not_admitted: int = 0
    rejected_nonfinite: int = 0
    duplicate_request: bool = False
    rows: Mapping[str, RowState] | None = field(default=None, compare=False, repr=False)
    # For a push with a PushOrigin: per rank of its group, the newest push the shard
    # had applied when this one was (this one included); the rows are as they left.
    seen: tuple[int, ...] | None = field(default=None, compare=False)

    def __add__(self, other: PushResult) -> PushResult:
        return PushResult(
            self.applied + other.applied,
            self.dropped_not_admitted + other.dropped_not_admitted,
            self.rejected_nonfinite + other.rejected_nonfinite,
            self.duplicate_request or other.duplicate_request,
        )


@dataclass(frozen=True)
class TableStats:
    """Counters of one table on one shard."""

    name: str
    dim: int
    rows: int
    capacity: int
    memory_bytes: int
    clock: int
    lookups: int
    lookup_ids: int
    pushes: int
    push_ids: int
    admissions: int
    rejected_admissions: int
    evictions: int
    expirations: int
    overflow: int
    dropped_not_admitted: int
    rejected_nonfinite: int
    unknown_reads: int = 0  # ids a server read that had no row (served their initial row)
    # A tiered table's (embedding_store.tier); an untiered one has every row in memory.
    memory_rows: int = 0  # rows in memory now
    disk_rows: int = 0  # rows with a copy on disk
    disk_bytes: int = 0  # the disk tier's files
    tier_asked: int = 0  # ids asked for (repeats counted)
    tier_missed: int = 0  # of those, not in memory when asked
    promotions: int = 0  # rows read back from disk
    demotions: int = 0  # rows moved out of memory (written to disk where changed)


@dataclass(frozen=True)
class TableChanges:
    """A table's rows changed since a version, as a serving replica receives them.

    ``complete`` False: the log does not reach back to the version asked for;
    the replica copies the table and follows from ``version``. ``changed_at``:
    the wall time of the log's newest version (how fresh the training shard is).
    """

    epoch: str
    version: int
    complete: bool
    ids: npt.NDArray[np.uint64]
    weights: npt.NDArray[np.float32]
    removed: npt.NDArray[np.uint64]
    changed_at: float


@dataclass(frozen=True)
class LatencySnapshot:
    """A latency histogram at one moment: Prometheus-style buckets, in seconds.

    ``buckets`` are the upper bounds, strictly increasing, the last one ``+inf``.
    ``counts`` are **cumulative**, as Prometheus' ``le`` buckets are:
    ``counts[i]`` observations took at most ``buckets[i]`` seconds, so
    ``counts[-1] == count``. ``sum_s`` is the total of every observation.

    >>> snap = LatencySnapshot((0.25, 1.0, math.inf), counts=(2, 4, 4), sum_s=2.0, count=4)
    >>> snap.quantile(0.5), snap.quantile(0.75)  # linear within a bucket
    (0.25, 0.625)
    >>> snap.mean_s
    0.5
    >>> LatencySnapshot((0.001, math.inf), (0, 0), 0.0, 0).quantile(0.5)  # nothing observed
    nan
    """

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float
    count: int

    def __post_init__(self) -> None:
        # Snapshots also arrive from the wire: refuse ones that would give
        # nonsense quantiles rather than let a dashboard show them.
        b, c = self.buckets, self.counts
        problem = None
        if len(b) < 2 or b[-1] != math.inf:
            problem = "buckets must hold at least one finite bound and end with +inf"
        elif any(not lo < hi for lo, hi in itertools.pairwise(b)) or not b[0] > 0.0:
            problem = "buckets must be positive and strictly increasing"
        elif len(c) != len(b):
            problem = f"{len(c)} counts for {len(b)} buckets"
        elif c[0] < 0 or any(lo > hi for lo, hi in itertools.pairwise(c)):
            problem = "counts must be cumulative (non-negative, non-decreasing)"
        elif c[-1] != self.count:
            problem = f"the +inf bucket holds {c[-1]} observations but count is {self.count}"
        elif not (self.sum_s >= 0.0 and math.isfinite(self.sum_s)):
            problem = f"sum_s must be finite and non-negative, got {self.sum_s}"
        if problem is not None:
            msg = f"LatencySnapshot: {problem} (buckets={b}, counts={c})"
            raise ValueError(msg)

    @property
    def mean_s(self) -> float:
        """Mean seconds per observation (NaN when nothing was observed)."""
        return self.sum_s / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Estimate the ``q``-quantile (0 <= q <= 1) as Prometheus' ``histogram_quantile``.

        Linear interpolation inside the bucket holding the rank ``q * count``,
        the first bucket starting at 0; a rank in the ``+inf`` bucket gives the
        largest finite bound. NaN when nothing was observed.
        """
        if not 0.0 <= q <= 1.0:
            msg = f"quantile: q must be in [0, 1], got {q}"
            raise ValueError(msg)
        if self.count == 0:
            return math.nan
        rank = q * self.count
        # The first bucket reaching the rank; a rank of 0 skips leading empty buckets.
        i = bisect.bisect_left(self.counts, max(rank, 1e-300))
        if i >= len(self.buckets) - 1:
            return self.buckets[-2]
        lower = self.buckets[i - 1] if i > 0 else 0.0
        before = self.counts[i - 1] if i > 0 else 0
        in_bucket = self.counts[i] - before
        return lower + (self.buckets[i] - lower) * (rank - before) / in_bucket


@dataclass(frozen=True)
class ShardStats:
    """Counters of one shard.

    ``lookup_latency`` and ``push_latency``: the time the shard's server spent
    on each Lookup and Push call (failed ones included), or None where the
    transport does not time calls (e.g. a shard server older than these fields).
    """

    tables: tuple[TableStats, ...]
    duplicate_pushes: int = 0
    last_checkpoint: CheckpointResult | None = None
    lookup_latency: LatencySnapshot | None = None
    push_latency: LatencySnapshot | None = None

    def table(self, name: str) -> TableStats:
        for t in self.tables:
            if t.name == name:
                return t
        msg = f"no table named {name!r} in these stats (tables: {[t.name for t in self.tables]})"
        raise KeyError(msg)


@dataclass(frozen=True)
class CheckpointResult:
    """Where a shard checkpoint was written and what it holds."""

    manifest: str
    kind: Literal["full", "delta"]
    seq: int
    rows: int
    tombstones: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class RestoreResult:
    """What a restore loaded."""

    manifests: tuple[str, ...]
    rows: int
    rows_by_table: dict[str, int] = field(default_factory=dict)
