"""Fresh reads of a rank's own pushes: hot rows are trained as sync mode would read them.

A hybrid rank looks a batch's rows up ``staleness`` steps ahead of training
it, so a row that the steps in between pushed to (a hot id: a popular item, a
heavy user, in nearly every batch of a real log) is read without those
pushes. On a real rating log that costs AUC against sync mode, where the
synthetic stream (ids spread over large vocabularies) hides it
(``benchmarks/quality.py`` measures both).

The store answers each push with exactly the rows it pushed, as they are
after it, with their optimizer state (``StoreClient.push(...,
return_rows=True)``: a batch's worth). The :class:`trainer.pusher.Pusher`
keeps the newest of each in a cache (:mod:`trainer.row_cache`), one per
:class:`TableGroup` (tables the store updates with the same arithmetic), and
before a step :func:`view_of` brings the batch's rows of a group up to date:

- a row whose state an answered push left is read from the cache, and is at
  least as new as its lookup;
- for the pushes not answered yet (the push queue lets the trainer run one
  step ahead of its last push), :func:`predict_rows` computes what the store
  will make of the rows they share with the batch, with the store's own
  arithmetic (``embedding_store.kernels.rows.update_rows``) from their last answered
  state, and that prediction replaces the batch's row. A row whose state is
  not remembered (no push named it lately) misses those pushes, or with
  ``fresh_rows: exact`` the trainer waits for its own, and reads a row that
  only other ranks' pushes name again (``StoreClient.read_pushed``): its lookup
  may hold some of those pushes, and only the read says which.

With several ranks, every rank tells the others at each step's collective the
gradients it is about to push and the answers its pushes got
(:meth:`trainer.pusher.Pusher.share`). Each push names its origin
(``embedding_store.types.PushOrigin``: the job, the rank, the step) and a
shard answers with the newest push of every rank it had applied by then, so a
rank knows exactly which of the others' pushes an answered row includes, and
predicts the rest in sync mode's order (by step, then by rank). The rows a
rank trains are then what a sync lookup would have read, whichever rank
pushed them, while the lookups and the pushes still overlap the training.

>>> from embedding_store.types import SGDConfig, TableConfig
>>> rule = PushRule.of("t", TableConfig(dim=1, optimizer=SGDConfig(lr=1.0)), "float32")
>>> before = RowState(np.array([[2.0]], np.float32), np.zeros((1, 0), np.float32),
...                   np.array([3]))
>>> after = predict_rows(before, np.array([[0.5]], np.float32), rule)
>>> after.weights.ravel().tolist(), after.row_step.tolist()
([1.5], [4])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from embedding_store.hashing import init_params, init_rows, init_rows_of, table_seed
from embedding_store.kernels.rows import update_rows
from embedding_store.optim import RowOptimizer, make_optimizer
from embedding_store.types import FlatRows, RowDtype, RowState, ShardRows, TableConfig
from pipeline.types import TableBatch
from trainer.row_cache import PushedRowCache, Remembered, RowIndex

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
_T = TypeVar("_T", bound=np.generic)
Grads = Mapping[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]


@dataclass(frozen=True)
class PushRule:
    """What the store does with one table's rows: how it starts a new row (its
    initializer), what a push does (optimizer, clip) and the dtype its gradients
    travel in (they are rounded to it on the wire).
    """

    optimizer: RowOptimizer
    weight_clip: float | None
    grad_dtype: RowDtype
    dim: int
    init: tuple[np.uint64, int, float, float]  # table seed, then init_params' (kind, a, b)
    # Equal for tables whose pushes do the same arithmetic (all but the initializer).
    arithmetic: str = ""

    @classmethod
    def of(cls, name: str, config: TableConfig, grad_dtype: RowDtype) -> PushRule:
        """The rule of table ``name`` with ``config`` (the store's ``tables:`` entry)."""
        return cls(
            make_optimizer(config.optimizer),
            config.weight_clip,
            grad_dtype,
            config.dim,
            (table_seed(name, config.seed), *init_params(config.initializer)),
            f"{config.dim}|{config.optimizer.model_dump_json()}|{config.weight_clip}|{grad_dtype}",
        )

    def new_rows(self, ids: U64) -> RowState:
        """The rows ``ids`` start as in the store: its initializer's weights (a function of
        the id), the optimizer's initial state, no update yet.

        >>> from embedding_store.table import EmbeddingTable
        >>> config = TableConfig(dim=3)
        >>> table = EmbeddingTable("t", config)
        >>> ids = np.array([11, 12], np.uint64)
        >>> fresh = PushRule.of("t", config, "float32").new_rows(ids)
        >>> bool((fresh.weights == table.lookup(ids)).all()), fresh.row_step.tolist()
        (True, [0, 0])
        """
        n = ids.shape[0]
        weights = np.zeros((n, self.dim), np.float32)
        init_rows(weights, np.ascontiguousarray(ids, np.uint64), *self.init)
        state = np.zeros((n, self.optimizer.state_width(self.dim)), np.float32)
        self.optimizer.initialize(weights, state, np.arange(n, dtype=np.int64))
        return RowState(weights, state, np.zeros(n, np.int64))


def predict_rows(before: RowState, grads: npt.NDArray[np.floating], rule: PushRule) -> RowState:
    """The rows ``before`` as the store leaves them after it applies ``grads`` to them.

    Rows without a row in the store (``row_step`` -1) and gradients with a NaN or
    Inf are left as they are, as the store drops and rejects them.

    >>> from embedding_store.types import SGDConfig, TableConfig
    >>> rule = PushRule.of("t", TableConfig(dim=1, optimizer=SGDConfig(lr=0.5)), "float32")
    >>> before = RowState(np.ones((2, 1), np.float32), np.zeros((2, 0), np.float32),
    ...                   np.array([0, -1]))
    >>> after = predict_rows(before, np.ones((2, 1), np.float32), rule)
    >>> after.weights.ravel().tolist(), after.row_step.tolist()
    ([0.5, 1.0], [1, -1])
    """
    g = np.ascontiguousarray(np.asarray(grads).astype(rule.grad_dtype), dtype=np.float32)
    weights = before.weights.copy()
    state = before.state.copy()
    row_step = before.row_step.copy()
    slots = np.arange(weights.shape[0], dtype=np.int64)
    slots[(row_step < 0) | ~np.isfinite(g).all(axis=1)] = -1
    update_rows(rule.optimizer, rule.weight_clip, weights, state, row_step, slots, g)
    return RowState(weights, state, row_step)


# What a reply's rows are taken to include of the ranks a shard did not name: all of
# their pushes (the rows are then never predicted for those ranks' pushes).
_ALL = np.iinfo(np.int64).max // 2


@dataclass(frozen=True)
class Answered:
    """Rows of one group that one answered push left: each row's table number in the
    group, its id, its state, and per rank the newest push it includes ([n, ranks], or
    [1, ranks]: the same for every row, as a shard's reply has it); ``acked``: when the
    push was answered (unix s).
    """

    tab: I32
    ids: U64
    rows: RowState
    seen: I64
    acked: float


class TableGroup:
    """Tables whose pushes the store applies with the same arithmetic, each a number in
    the group: they share one cache of pushed rows and one prediction per push.
    ``rules`` None: the arithmetic is unknown (one table per group, nothing predicted).
    ``ranks``: the job's trainer ranks, whose answered pushes the cache keeps.
    """

    def __init__(
        self, rules: Sequence[tuple[str, PushRule | None]], *, cached_rows: int, ranks: int = 1
    ) -> None:
        """``cached_rows``: rows remembered for the group's tables together."""
        self.members = {name: i for i, (name, _) in enumerate(rules)}
        self.key = rules[0][0]  # the same on every rank: the tables are in name order
        self.rules = [rule for _, rule in rules]
        self.rule = self.rules[0]
        # Each table's initializer by its number (see init_rows_of); None: not all known.
        known = [r for r in self.rules if r is not None]
        self.inits = (
            (
                np.array([r.init[0] for r in known], np.uint64),
                np.array([r.init[1] for r in known], np.int64),
                np.array([r.init[2] for r in known], np.float64),
                np.array([r.init[3] for r in known], np.float64),
            )
            if len(known) == len(self.rules)
            else None
        )
        self.max_rows = cached_rows
        self.ranks = ranks
        self.cache: PushedRowCache | None = None  # made by the first answered push

    def remember(
        self, parts: Sequence[ShardRows], *, rank: int, step: int, push: int, acked: float
    ) -> list[Answered]:
        """Keep the rows this rank's push ``push`` (of step ``step``) left, as its reply
        brought them; returns them as kept, one piece per shard that held any.
        """
        kept = []
        for part in parts:
            answered = self._answered(part, rank, step, acked)
            if answered is not None:
                self.take(answered, push=push)
                kept.append(answered)
        return kept

    def take(self, answered: Answered, *, push: int = 0) -> None:
        """Keep what a push left where no newer state of a row is held (``push``: this
        rank's number of it; 0: another rank's push)."""
        if self.cache is None:
            dim, width = answered.rows.weights.shape[1], answered.rows.state.shape[1]
            self.cache = PushedRowCache(dim, width, max_rows=self.max_rows, ranks=self.ranks)
        self.cache.put(
            answered.tab, answered.ids, answered.rows, answered.seen, acked=answered.acked,
            push=push,
        )  # fmt: skip

    def _answered(self, part: ShardRows, rank: int, step: int, acked: float) -> Answered | None:
        """One shard's reply to this rank's push of ``step``, as the group keeps it: a
        reply that holds only the group's tables back to back is taken as it came (no
        copy of its rows)."""
        rows = part.rows
        if isinstance(rows, FlatRows) and rows.flat is not None:
            names = rows.names
            if not names or not all(name in self.members for name in names):
                return self._pieces(part, rank, step, acked)
            tab = np.repeat(
                np.array([self.members[name] for name in names], np.int32), rows.shapes[:, 0]
            )
            ids = _concat([np.asarray(part.ids[name], np.uint64) for name in names])
            return Answered(tab, ids, rows.flat, self._seen(part, rank, step), acked)
        return self._pieces(part, rank, step, acked)

    def _seen(self, part: ShardRows, rank: int, step: int) -> I64:
        """What a shard's reply to this rank's push of ``step`` includes ([1, ranks]:
        the same for all its rows)."""
        if part.seen is not None and len(part.seen) == self.ranks:
            return np.array([part.seen], np.int64)
        # One rank, or a shard that does not say: its own pushes up to this one.
        vector = np.full((1, self.ranks), _ALL, np.int64)
        vector[0, rank] = step
        return vector

    def _pieces(self, part: ShardRows, rank: int, step: int, acked: float) -> Answered | None:
        pieces = [
            (i, part.ids[name], part.rows[name])
            for name, i in self.members.items()
            if name in part.rows
        ]
        if not pieces:
            return None
        tab = _numbers([(i, ids.shape[0]) for i, ids, _ in pieces])
        ids = _concat([np.asarray(ids, np.uint64) for _, ids, _ in pieces])
        state = RowState(
            _concat([r.weights for _, _, r in pieces]),
            _concat([r.state for _, _, r in pieces]),
            _concat([r.row_step for _, _, r in pieces]),
        )
        return Answered(tab, ids, state, self._seen(part, rank, step), acked)


def _concat(arrays: Sequence[npt.NDArray[_T]]) -> npt.NDArray[_T]:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _numbers(counts: list[tuple[int, int]]) -> I32:
    """Each number repeated its count of times."""
    return np.repeat(
        np.array([i for i, _ in counts], np.int32), np.array([n for _, n in counts], np.int64)
    )


class InFlight:
    """A push whose answer this rank has not kept yet: this rank's (its number
    ``seq``) or another rank's (``seq`` 0); the ``step`` it was pushed at, the ``rank``
    that pushed it, its gradients and, per group of tables, its keys indexed (made on
    first use).

    >>> group = TableGroup([("a", None), ("b", None)], cached_rows=8)
    >>> push = InFlight(1, {"b": (np.array([5, 2], np.uint64), np.ones((2, 1), np.float32))})
    >>> index, grads = push.keyed(group)
    >>> index.rows_of(np.array([1, 0], np.int32), np.array([2, 2], np.uint64)).tolist()
    [1, -1]
    """

    def __init__(self, seq: int, grads: Grads, *, rank: int = 0, step: int | None = None) -> None:
        self.seq = seq
        self.grads = grads
        self.rank = rank
        self.step = seq if step is None else step
        self._keyed: dict[int, tuple[RowIndex, npt.NDArray[np.floating]] | None] = {}

    @property
    def order(self) -> tuple[int, int]:
        """Where the push falls in sync mode's order: by step, then by rank."""
        return (self.step, self.rank)

    def keyed(self, group: TableGroup) -> tuple[RowIndex, npt.NDArray[np.floating]] | None:
        """The push's keys in ``group`` indexed and its gradients in the index's row
        order, None if it names none of the group's tables.
        """
        key = id(group)
        if key not in self._keyed:
            parts = [(i, name) for name, i in group.members.items() if name in self.grads]
            if not parts:
                self._keyed[key] = None
            else:
                ids = [np.asarray(self.grads[name][0], np.uint64) for _, name in parts]
                tab = _numbers([(i, k.shape[0]) for (i, _), k in zip(parts, ids, strict=True)])
                grads = _concat([np.asarray(self.grads[name][1]) for _, name in parts])
                self._keyed[key] = (RowIndex(tab, _concat(ids)), grads)
        return self._keyed[key]


@dataclass
class Freshened:
    """What :meth:`trainer.pusher.Pusher.freshen` did to one batch, per row of its tables."""

    wait_s: float = 0.0  # waiting for this rank's last pushes to land
    # Rows by how many of this rank's pushes to them their lookup missed ...
    missed_by_row: dict[int, int] = field(default_factory=dict)
    # ... and by how many they were still without when trained (pushes in flight).
    trained_missed_by_row: dict[int, int] = field(default_factory=dict)
    replaced: int = 0  # rows whose value came from a push's reply instead of the lookup
    predicted: int = 0  # rows a push in flight will change, computed ahead of its reply
    waited: int = 0  # pushes in flight waited for (a row's state before them was unknown)
    read: int = 0  # rows read again (only other ranks' pushes in flight named them)


def _count(histogram: dict[int, int], values: I32) -> None:
    counts = np.bincount(values) if values.shape[0] else np.zeros(0, np.int64)
    for k in np.flatnonzero(counts):
        histogram[int(k)] = histogram.get(int(k), 0) + int(counts[k])


@dataclass(frozen=True)
class GroupView:
    """One group's tables of a batch as this rank's pushes leave them; rows are numbered
    across the tables, in their order.
    """

    tables: list[TableBatch]
    starts: I64  # where each table's rows begin, then their total
    rows: npt.NDArray[np.floating]  # the tables' rows back to back, as looked up
    missed: I32  # per row: own pushes its lookup missed
    still: I32  # per row: pushes in flight it is trained without
    replace: npt.NDArray[np.intp]  # rows whose value changes (sorted) ...
    values: npt.NDArray[np.float32]  # ... to these (float32; rounded as a lookup rounds)
    predicted: int  # rows whose value is a prediction of a push in flight
    unknown_seq: int  # the newest push in flight naming a row not predicted (0: none)
    # The rows trained without a push in flight: each one's table number and id.
    unknown_tab: I32
    unknown_ids: U64

    def apply(self, out: Freshened) -> None:
        """Write the new values into the tables' rows and count what was done in ``out``."""
        if self.replace.shape[0]:
            # The tables' rows written at once in their copy, each table then a view of
            # its part: a write per table cost more than the rows (26 tables a step).
            rows = self.rows
            rows[self.replace] = self.values
            bounds = self.starts.tolist()
            for k, table in enumerate(self.tables):
                table.rows = rows[bounds[k] : bounds[k + 1]]
        _count(out.missed_by_row, self.missed)
        _count(out.trained_missed_by_row, self.still)
        out.replaced += int(self.replace.shape[0])
        out.predicted += self.predicted


def view_of(
    group: TableGroup,
    batch: Sequence[tuple[int, TableBatch]],
    in_flight: Sequence[InFlight],
    applied_before: int,
    looked_up_at: float = np.inf,
    rank: int = 0,
) -> GroupView:
    """What the pushes make of ``batch``'s tables (each with its number in ``group``,
    all with rows), as rank ``rank`` knows them: what answered pushes left is read
    from the group's cache (this rank's after its push number ``applied_before``, and
    any answered after the lookup at ``looked_up_at``, unix s); the pushes
    ``in_flight`` (in sync mode's order) are predicted where a row's state is known
    from before them (see the module docstring).
    """
    tables = [t for _, t in batch]
    lens = [t.unique_ids.shape[0] for t in tables]
    starts = np.zeros(len(tables) + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    ids = _concat([np.ascontiguousarray(t.unique_ids, np.uint64) for t in tables])
    tab = _numbers([(i, n) for (i, _), n in zip(batch, lens, strict=True)])
    looked_up = np.concatenate([np.asarray(t.rows) for t in tables])
    n = ids.shape[0]
    # Per push in flight, the row of its gradients for each of the batch's rows (-1: none).
    hits: list[tuple[InFlight, I64, npt.NDArray[np.floating]]] = []
    pending = np.zeros(n, np.int32)
    for push in in_flight:
        keyed = push.keyed(group)
        if keyed is not None:
            at = keyed[0].rows_of(tab, ids)
            pending += at >= 0
            hits.append((push, at, keyed[1]))
    # Only the rows an answered push changed or a push in flight names need more than
    # a probe: on large vocabularies, few of a batch's.
    rule = group.rule
    cache = group.cache
    if cache is None:
        width = rule.optimizer.state_width(rule.dim) if rule is not None else 0
        missed = np.zeros(n, np.int32)
        seen = Remembered.nothing(np.flatnonzero(pending), looked_up.shape[1], width, group.ranks)
    else:
        missed, seen = cache.read(tab, ids, applied_before, pending > 0, looked_up_at)
    sel, rows, included = seen.at, seen.rows, seen.seen
    ahead = pending[sel] > 0
    known = seen.known.copy() if rule is not None else np.zeros(sel.shape[0], np.bool_)
    predicted = 0
    if rule is not None and hits:
        _start_new_rows(group, looked_up, ids, tab, sel, ahead, known, rows, included)
        for push, at, grads in hits:
            # Rows this push names whose known state does not include it.
            named = at[sel]
            now = np.flatnonzero(known & (named >= 0) & (included[:, push.rank] < push.step))
            if now.shape[0] == 0:
                continue
            after = predict_rows(rows.take(now), grads[named[now]], rule)
            rows.weights[now] = after.weights
            rows.state[now] = after.state
            rows.row_step[now] = after.row_step
            included[now, push.rank] = push.step
            predicted += now.shape[0]
    # A known row read is at least as new as its lookup (what it lacks is predicted);
    # a row in flight and not known keeps its lookup and misses those pushes. Without
    # the arithmetic nothing is predicted: a remembered row is taken where no push in
    # flight names it, or where this rank's pushes after the lookup changed it.
    changed = known if rule is not None else seen.known & (~ahead | (missed[sel] > 0))
    still = np.zeros(n, np.int32)
    still[sel] = np.where(ahead & ~known, pending[sel], 0)
    unknown = sel[ahead & ~known]
    unknown_seq = max(
        (
            push.seq
            for push, at, _ in hits
            if push.rank == rank and ((at[sel] >= 0) & (still[sel] > 0)).any()
        ),
        default=0,
    )
    return GroupView(
        tables,
        starts,
        looked_up,
        missed + pending,
        still,
        sel[changed],
        rows.weights[changed],
        predicted,
        unknown_seq,
        tab[unknown],
        ids[unknown],
    )


def _start_new_rows(
    group: TableGroup,
    looked_up: npt.NDArray[np.floating],
    ids: U64,
    tab: I32,
    sel: I64,
    ahead: npt.NDArray[np.bool_],
    known: npt.NDArray[np.bool_],
    rows: RowState,
    included: I64,
) -> None:
    """Mark known, with its initial state, each row in flight and not remembered whose
    lookup read exactly what the store starts it as: it is new, its state before the
    push is the initial one (a row whose updates all rounded away would be predicted
    one step wrong). ``sel``: the batch's positions of ``ahead``, ``known``, ``rows``
    and ``included``; ``looked_up``, ``ids`` and ``tab`` are the whole batch's.
    """
    unknown = np.flatnonzero(ahead & ~known)
    if unknown.shape[0] == 0 or group.inits is None or group.rule is None:
        return
    where = sel[unknown]
    start = np.empty((where.shape[0], looked_up.shape[1]), np.float32)
    init_rows_of(start, ids[where], tab[where], *group.inits)
    new = (start.astype(looked_up.dtype) == looked_up[where]).all(axis=1)
    at = unknown[new]
    weights = start[new]
    state = np.zeros((at.shape[0], rows.state.shape[1]), np.float32)
    # The group's tables share the optimizer: one initial state for all.
    group.rule.optimizer.initialize(weights, state, np.arange(at.shape[0], dtype=np.int64))
    rows.weights[at] = weights
    rows.state[at] = state
    rows.row_step[at] = 0
    included[at] = 0
    known[at] = True
