"""The per-step protocol every trainer rank runs, as pure decisions.

Each step a rank decides whether to ask its stream for a batch
(:func:`ask_stream`), where it stands against its share of a job-wide
``--max-events`` (:func:`budget_at`), and what it tells the other ranks
(:meth:`RankState.before_exchange`: its :class:`Control`).
The one exchange sums every rank's flags; from its own state and those sums
each rank then decides the same thing (:func:`decide`):

==========================================  =================================
every rank's sums                            decision
==========================================  =================================
any rank failed (lost the store)             :class:`RollBackAll`
no rank active, one hungry, spare > 0,       :class:`ShareSpare`
no stop (shared budget)
no rank active, one waiting, no stop         :class:`WaitQuietly`
no rank active otherwise                     :class:`End`
some rank active                             :class:`Step`
==========================================  =================================

Every rank reaches the same decision from the same sums (only ``stopped_by``
differs: a rank names its own reason), so every rank takes the same
collectives after it. :class:`trainer.loop.TrainLoop` gathers the state and
carries the decision out; this module does no I/O, which keeps the protocol
testable as a table (``tests/trainer/test_step_protocol.py``).

>>> mine = RankState.before_exchange(samples=8, active=True)
>>> decide(mine, mine.control)
Step(checkpoint=False, report=False, stop_after='')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ANOTHER_RANK",
    "END_OF_STREAM",
    "HUNGRY_CHECK_S",
    "MAX_EVENTS",
    "Budget",
    "Control",
    "Decision",
    "End",
    "RankState",
    "RollBackAll",
    "ShareSpare",
    "Step",
    "WaitQuietly",
    "ask_stream",
    "budget_at",
    "decide",
    "share_learned",
]


@dataclass(frozen=True)
class Control:
    """One rank's flags into the step's exchange (:class:`trainer.dense_sync.DenseSync`),
    every rank's sums out."""

    active: int  # ranks that trained this step
    waiting: int  # ranks with no batch now whose stream goes on (quiet partitions)
    stop: int  # ranks asking to stop (SIGTERM, --max-time, an error)
    checkpoint: int  # ranks whose checkpoint timer is due
    samples: int  # samples trained this step
    # Ranks that lost the embedding store (a shard died or restarted): every rank
    # then rolls back to the newest job checkpoint together.
    failed: int = 0
    # With a job-wide --max-events: ranks at their share whose source holds more
    # (hungry), and the events the ranks without work could still learn (spare).
    hungry: int = 0
    spare: int = 0
    # Ranks asking for a report now: every rank then reports, with figures over every
    # rank's predictions (a gather), at the same step.
    report: int = 0

    def any(
        self,
        flag: Literal["active", "waiting", "stop", "checkpoint", "failed", "hungry", "report"],
    ) -> bool:
        return bool(getattr(self, flag) > 0)


# How often a rank at its share of --max-events asks its source whether it holds more.
HUNGRY_CHECK_S = 0.5
END_OF_STREAM = "end_of_stream"
MAX_EVENTS = "max_events"
ANOTHER_RANK = "another rank"


def ask_stream(*, exhausted: bool, stop_reason: str, asked: bool, failed: bool) -> bool:
    """Whether a rank asks its stream for a batch at this step.

    Not once the stream ended, a stop is asked for or the store failed; but a
    deadline that passed while the job started still lets the source be asked
    once, so that a source that cannot be reached says so (exit 1) rather than
    the job ending as if it had trained what there was.

    >>> ask_stream(exhausted=False, stop_reason="", asked=True, failed=False)
    True
    >>> ask_stream(exhausted=False, stop_reason="max_time", asked=False, failed=False)
    True
    >>> ask_stream(exhausted=False, stop_reason="signal", asked=False, failed=False)
    False
    """
    first_ask = not asked and stop_reason == "max_time"
    return not exhausted and (not stop_reason or first_ask) and not failed


@dataclass(frozen=True)
class Budget:
    """A rank without a batch against its share of a job-wide ``--max-events``.

    ``capped``: its share is learned and its stream has not ended, so it is not
    waiting on a quiet stream but on more share; ``check_hungry``: it asks its
    stream now whether it holds more (the answer is the ``hungry`` flag; between
    checks the last answer stands); ``spare``: the events it may still learn and
    has no batch for, which hungry ranks may take.
    """

    capped: bool = False
    check_hungry: bool = False
    spare: int = 0


def budget_at(
    *,
    shared: bool,
    has_batch: bool,
    max_events: int | None,
    events: int,
    exhausted: bool,
    since_hungry_check_s: float,
) -> Budget:
    """Where a rank stands against its share (only a shared budget and no batch count).

    >>> budget_at(shared=True, has_batch=False, max_events=10, events=10, exhausted=False,
    ...           since_hungry_check_s=1.0)
    Budget(capped=True, check_hungry=True, spare=0)
    >>> budget_at(shared=True, has_batch=False, max_events=10, events=4, exhausted=False,
    ...           since_hungry_check_s=1.0)
    Budget(capped=False, check_hungry=False, spare=6)
    """
    if not shared or has_batch or max_events is None:
        return Budget()
    left = max_events - events
    if left <= 0 and not exhausted:
        return Budget(capped=True, check_hungry=since_hungry_check_s >= HUNGRY_CHECK_S)
    return Budget(spare=max(0, left))


def share_learned(*, events: int, max_events: int | None) -> bool:
    """Whether a rank learned its whole share of ``--max-events`` with this step.

    It then ends its stream, unless the share may still grow (a shared budget:
    the rank keeps asking its stream, see :mod:`trainer.event_budget`).

    >>> share_learned(events=10, max_events=10), share_learned(events=3, max_events=None)
    (True, False)
    """
    return max_events is not None and events >= max_events


@dataclass(frozen=True)
class RankState:
    """A rank's state before a step's exchange: what it tells every rank (``control``)
    and what only it knows that the decision after the exchange needs."""

    control: Control
    stop_reason: str = ""  # "signal", "max_time", or "" to go on
    end_reason: str = END_OF_STREAM  # why its stream ended: "end_of_stream" or "max_events"
    shared_budget: bool = False  # a job-wide --max-events moves between the ranks
    steps_since_checkpoint: int = 0

    @classmethod
    def before_exchange(
        cls,
        *,
        active: bool = False,
        samples: int = 0,
        quiet: bool = False,
        budget: Budget | None = None,
        hungry: bool = False,
        stop_reason: str = "",
        checkpoint_due: bool = False,
        failed: bool = False,
        report_due: bool = False,
        end_reason: str = END_OF_STREAM,
        shared_budget: bool = False,
        steps_since_checkpoint: int = 0,
    ) -> RankState:
        """The state of a rank that has a batch (``active``, of ``samples``) or none
        (``quiet``: its stream goes on; a ``budget.capped`` rank is not waiting).

        >>> RankState.before_exchange(quiet=True, budget=Budget(capped=True)).control.waiting
        0
        """
        budget = budget or Budget()
        return cls(
            control=Control(
                active=int(active),
                waiting=int(quiet and not budget.capped),
                stop=int(bool(stop_reason)),
                checkpoint=int(checkpoint_due),
                samples=samples,
                failed=int(failed),
                hungry=int(hungry),
                spare=budget.spare,
                report=int(report_due),
            ),
            stop_reason=stop_reason,
            end_reason=end_reason,
            shared_budget=shared_budget,
            steps_since_checkpoint=steps_since_checkpoint,
        )


@dataclass(frozen=True)
class RollBackAll:
    """Some rank lost the store: nothing of this step is learned, every rank goes back
    to the newest job checkpoint."""


@dataclass(frozen=True)
class ShareSpare:
    """No rank trained, and hungry ranks can take the spare of the others: the shares
    move (a gather), and the ranks go on without a step."""


@dataclass(frozen=True)
class WaitQuietly:
    """Every stream is quiet for now: no step, no spinning; a checkpoint when one is
    due and there is something new to hold, a report when asked for."""

    checkpoint: bool = False
    report: bool = False


@dataclass(frozen=True)
class End:
    """No rank has anything more to learn, or a stop was asked for: the run ends."""

    stopped_by: str


@dataclass(frozen=True)
class Step:
    """Some rank trained: every rank steps its dense optimizer; then a checkpoint, a
    stop (``stop_after``: the ``stopped_by`` to end with, "" to go on) or a report."""

    checkpoint: bool = False
    report: bool = False
    stop_after: str = ""


Decision = RollBackAll | ShareSpare | WaitQuietly | End | Step


def decide(mine: RankState, everyone: Control) -> Decision:
    """What a rank does after the exchange, from its own state and every rank's sums.

    >>> decide(RankState(Control(0, 0, 0, 0, 0)), Control(0, 0, 0, 0, 0))
    End(stopped_by='end_of_stream')
    >>> decide(RankState(Control(0, 0, 0, 0, 0)), Control(1, 0, 1, 0, 8))
    Step(checkpoint=False, report=False, stop_after='another rank')
    """
    if everyone.any("failed"):
        return RollBackAll()
    stop = everyone.any("stop")
    stopped_by = mine.stop_reason or ANOTHER_RANK
    if everyone.any("active"):
        return Step(
            checkpoint=everyone.any("checkpoint"),
            report=everyone.any("report") and not stop,
            stop_after=stopped_by if stop else "",
        )
    if mine.shared_budget and everyone.any("hungry") and everyone.spare > 0 and not stop:
        return ShareSpare()
    if everyone.any("waiting") and not stop:
        # What was learned before the quiet still gets its checkpoint when one is due
        # (and so its offsets committed), not only when records come again.
        return WaitQuietly(
            checkpoint=everyone.any("checkpoint") and mine.steps_since_checkpoint > 0,
            report=everyone.any("report"),
        )
    return End(stopped_by=stopped_by if stop else mine.stop_reason or mine.end_reason)
