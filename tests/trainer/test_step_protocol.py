"""The per-step protocol as a table of transitions: a rank's state and every rank's sums
in, the decision out (no torch, no store, no threads), as distributed tests its worker
state machine."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from trainer.step_protocol import (
    ANOTHER_RANK,
    END_OF_STREAM,
    HUNGRY_CHECK_S,
    MAX_EVENTS,
    Budget,
    Control,
    Decision,
    End,
    RankState,
    RollBackAll,
    ShareSpare,
    Step,
    WaitQuietly,
    ask_stream,
    budget_at,
    decide,
    share_learned,
)


def sums(**flags: int) -> Control:
    """Every rank's sums: the flags named, the rest 0."""
    return Control(**{"active": 0, "waiting": 0, "stop": 0, "checkpoint": 0, "samples": 0} | flags)


def state(
    *,
    stop_reason: str = "",
    end_reason: str = END_OF_STREAM,
    shared_budget: bool = False,
    steps_since_checkpoint: int = 0,
) -> RankState:
    """A rank's own state (its flags do not matter to the decision: the sums carry them)."""
    return RankState(
        sums(stop=int(bool(stop_reason))),
        stop_reason=stop_reason,
        end_reason=end_reason,
        shared_budget=shared_budget,
        steps_since_checkpoint=steps_since_checkpoint,
    )


TRANSITIONS: list[tuple[str, RankState, Control, Decision]] = [
    # A failed rank anywhere: every rank rolls back, whatever else is asked for.
    ("failed here", state(), sums(failed=1), RollBackAll()),
    ("failed while active", state(), sums(active=2, samples=64, failed=1), RollBackAll()),
    ("failed while stopping", state(stop_reason="signal"), sums(stop=1, failed=2), RollBackAll()),
    ("failed while quiet", state(), sums(waiting=2, failed=1, checkpoint=1), RollBackAll()),
    (
        "failed while hungry",
        state(shared_budget=True),
        sums(hungry=1, spare=5, failed=1),
        RollBackAll(),
    ),
    # Some rank trained: every rank steps.
    ("active", state(), sums(active=1, samples=8), Step()),
    ("active, others quiet", state(), sums(active=1, waiting=1, samples=8), Step()),
    ("active, checkpoint due", state(), sums(active=1, checkpoint=1), Step(checkpoint=True)),
    (
        "active, checkpoint due with nothing new",  # a step is taken: it is something new
        state(steps_since_checkpoint=0),
        sums(active=1, checkpoint=2),
        Step(checkpoint=True),
    ),
    ("active, report", state(), sums(active=2, report=1), Step(report=True)),
    (
        "active, stop here",
        state(stop_reason="signal"),
        sums(active=1, stop=1),
        Step(stop_after="signal"),
    ),
    (
        "active, stop elsewhere",
        state(),
        sums(active=1, stop=1),
        Step(stop_after=ANOTHER_RANK),
    ),
    (
        "active, stop at max_time with a checkpoint",
        state(stop_reason="max_time"),
        sums(active=1, stop=2, checkpoint=1),
        Step(checkpoint=True, stop_after="max_time"),
    ),
    (
        "active, a stop takes the report's place",  # the run's last report follows
        state(),
        sums(active=1, stop=1, report=1),
        Step(stop_after=ANOTHER_RANK),
    ),
    (
        "active, hungry and spare: no sharing",
        state(shared_budget=True),
        sums(active=1, hungry=1, spare=5),
        Step(),
    ),
    # No rank trained, a hungry rank and spare budget: the shares move.
    ("hungry and spare", state(shared_budget=True), sums(hungry=1, spare=3), ShareSpare()),
    (
        "hungry and spare, others quiet",
        state(shared_budget=True),
        sums(hungry=1, spare=3, waiting=1),
        ShareSpare(),
    ),
    (
        "hungry and spare, a stop",
        state(shared_budget=True),
        sums(hungry=1, spare=3, stop=1),
        End(ANOTHER_RANK),
    ),
    (
        "hungry, no spare",
        state(shared_budget=True, end_reason=MAX_EVENTS),
        sums(hungry=2),
        End(MAX_EVENTS),
    ),
    (
        "hungry, no spare, others quiet",
        state(shared_budget=True),
        sums(hungry=1, waiting=1),
        WaitQuietly(),
    ),
    (
        "spare, nobody hungry",
        state(shared_budget=True, end_reason=MAX_EVENTS),
        sums(spare=3),
        End(MAX_EVENTS),
    ),
    (
        "hungry and spare, no shared budget",
        state(),
        sums(hungry=1, spare=3, waiting=1),
        WaitQuietly(),
    ),
    # No rank trained, some stream quiet, no stop: wait.
    ("all quiet", state(), sums(waiting=2), WaitQuietly()),
    (
        "all quiet, checkpoint due, steps since the last",
        state(steps_since_checkpoint=3),
        sums(waiting=2, checkpoint=1),
        WaitQuietly(checkpoint=True),
    ),
    (
        "all quiet, checkpoint due, nothing new",
        state(steps_since_checkpoint=0),
        sums(waiting=2, checkpoint=1),
        WaitQuietly(),
    ),
    (
        "all quiet, steps since the last, none due",
        state(steps_since_checkpoint=3),
        sums(waiting=1),
        WaitQuietly(),
    ),
    ("all quiet, report", state(), sums(waiting=1, report=1), WaitQuietly(report=True)),
    (
        "all quiet, checkpoint and report",
        state(steps_since_checkpoint=1),
        sums(waiting=1, report=1, checkpoint=2),
        WaitQuietly(checkpoint=True, report=True),
    ),
    # Nobody active and nobody waiting, or a stop: the end, and who stopped it.
    ("quiet, stop here", state(stop_reason="signal"), sums(waiting=1, stop=1), End("signal")),
    ("quiet, stop elsewhere", state(), sums(waiting=1, stop=1), End(ANOTHER_RANK)),
    ("every stream ended", state(), sums(), End(END_OF_STREAM)),
    ("this rank at max_events", state(end_reason=MAX_EVENTS), sums(), End(MAX_EVENTS)),
    (
        "max_time here, others ended",
        state(stop_reason="max_time", end_reason=MAX_EVENTS),
        sums(stop=1),
        End("max_time"),
    ),
    (
        "ended here, another's signal",
        state(end_reason=MAX_EVENTS),
        sums(stop=1),
        End(ANOTHER_RANK),
    ),
    (
        "ended, checkpoint and report due",  # the run's end checkpoints and reports
        state(steps_since_checkpoint=4),
        sums(checkpoint=1, report=1),
        End(END_OF_STREAM),
    ),
]


@pytest.mark.parametrize(
    ("mine", "everyone", "decision"),
    [pytest.param(m, e, d, id=name) for name, m, e, d in TRANSITIONS],
)
def test_decide(mine: RankState, everyone: Control, decision: Decision) -> None:
    assert decide(mine, everyone) == decision


@pytest.mark.parametrize(
    ("exhausted", "stop_reason", "asked", "failed", "ask"),
    [
        (False, "", False, False, True),
        (False, "", True, False, True),
        (True, "", True, False, False),  # the stream ended
        (False, "", True, True, False),  # the store failed: roll back first
        (False, "signal", False, False, False),
        (False, "signal", True, False, False),
        (False, "max_time", False, False, True),  # once: an unreachable source says so
        (False, "max_time", True, False, False),
        (False, "max_time", False, True, False),
        (True, "max_time", False, False, False),
    ],
)
def test_ask_stream(
    exhausted: bool, stop_reason: str, asked: bool, failed: bool, ask: bool
) -> None:
    assert (
        ask_stream(exhausted=exhausted, stop_reason=stop_reason, asked=asked, failed=failed) == ask
    )


@pytest.mark.parametrize(
    ("shared", "has_batch", "max_events", "events", "exhausted", "since_s", "budget"),
    [
        (False, False, 10, 10, False, 9.0, Budget()),  # one rank: its share never moves
        (True, True, 10, 10, False, 9.0, Budget()),  # a batch: no claim on the budget
        (True, False, None, 10, False, 9.0, Budget()),  # no --max-events
        (True, False, 10, 10, False, HUNGRY_CHECK_S, Budget(capped=True, check_hungry=True)),
        (True, False, 10, 12, False, 0.0, Budget(capped=True)),  # asked a moment ago
        (True, False, 10, 10, True, 9.0, Budget()),  # its stream ended: nothing to want
        (True, False, 10, 4, False, 9.0, Budget(spare=6)),
        (True, False, 10, 4, True, 9.0, Budget(spare=6)),  # ended with share left: give it
    ],
)
def test_budget_at(
    shared: bool,
    has_batch: bool,
    max_events: int | None,
    events: int,
    exhausted: bool,
    since_s: float,
    budget: Budget,
) -> None:
    got = budget_at(
        shared=shared,
        has_batch=has_batch,
        max_events=max_events,
        events=events,
        exhausted=exhausted,
        since_hungry_check_s=since_s,
    )
    assert got == budget


@pytest.mark.parametrize(
    ("facts", "control"),
    [
        ({"active": True, "samples": 8}, sums(active=1, samples=8)),
        ({"active": True, "samples": 0}, sums(active=1)),  # an empty batch still steps
        ({"quiet": True}, sums(waiting=1)),
        ({"quiet": True, "budget": Budget(capped=True), "hungry": True}, sums(hungry=1)),
        ({"budget": Budget(spare=6)}, sums(spare=6)),
        ({"quiet": True, "budget": Budget(spare=6)}, sums(waiting=1, spare=6)),
        ({"stop_reason": "signal"}, sums(stop=1)),
        ({"checkpoint_due": True, "report_due": True}, sums(checkpoint=1, report=1)),
        ({"failed": True}, sums(failed=1)),
    ],
)
def test_before_exchange(facts: dict[str, Any], control: Control) -> None:
    assert RankState.before_exchange(**facts).control == control


def test_share_learned() -> None:
    assert share_learned(events=10, max_events=10)
    assert share_learned(events=11, max_events=10)
    assert not share_learned(events=9, max_events=10)
    assert not share_learned(events=10**9, max_events=None)


def test_every_rank_reaches_the_same_decision() -> None:
    """Only ``stopped_by`` differs between ranks: each names its own reason."""
    for _, mine, everyone, _ in TRANSITIONS:
        kinds = {
            type(
                decide(
                    state(
                        stop_reason=r,
                        end_reason=e,
                        shared_budget=mine.shared_budget,  # the job's, every rank's
                        steps_since_checkpoint=n,
                    ),
                    everyone,
                )
            )
            for r in ("", "signal")
            for e in (END_OF_STREAM, MAX_EVENTS)
            for n in (1, 2)
            if not r or everyone.stop
        }
        assert len(kinds) == 1, everyone


@pytest.mark.processes
def test_the_protocol_imports_no_torch() -> None:
    code = "import sys, trainer.step_protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
