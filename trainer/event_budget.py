"""A job's ``--max-events`` over its ranks: shares that move to where the records are.

Each rank starts with an even share of the events the job may still learn.
Partitions are rarely even: a rank can reach its share while another waits on
partitions that hold fewer records (or none). At a step where no rank trained,
the events that the ranks without work could still learn (their *spare*) go
to the ranks that reached their share with records left (the *hungry* ones),
split evenly in rank order; the givers keep what they learned and give up the
rest. The job learns exactly ``max_events`` events whenever the partitions
hold them, each once, and ends; a rank that gave its share away and later
finds records takes spare back the same way.

Pure functions of the ranks' numbers: every rank computes the same shares from
the same gathered claims.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["even_shares", "share_spare"]


def even_shares(total: int, world: int) -> list[int]:
    """``total`` events over ``world`` ranks, the first ranks one more each.

    >>> even_shares(10, 3)
    [4, 3, 3]
    >>> even_shares(0, 2)
    [0, 0]
    """
    if world < 1:
        msg = f"world: expected at least 1 rank, got {world}"
        raise ValueError(msg)
    total = max(0, total)
    return [total // world + (1 if r < total % world else 0) for r in range(world)]


def share_spare(hungry: Sequence[bool], spare: Sequence[int]) -> list[int]:
    """The events each rank may still learn once the spare of the ranks that are not
    hungry went, split evenly, to the hungry ones; ranks not hungry keep none.

    >>> share_spare([True, False], [0, 34])  # rank 1's partition held 34 fewer
    [34, 0]
    >>> share_spare([True, True, False], [0, 0, 5])
    [3, 2, 0]
    >>> share_spare([False, False], [3, 4])  # nobody to give to: nothing moves
    [3, 4]
    """
    if len(hungry) != len(spare):
        msg = f"hungry and spare: one entry per rank each, got {len(hungry)} and {len(spare)}"
        raise ValueError(msg)
    takers = [r for r, h in enumerate(hungry) if h]
    if not takers:
        return list(spare)
    given = sum(e for r, e in enumerate(spare) if not hungry[r])
    # A hungry rank's own spare is 0 (it is at its share); it is counted all the same.
    given += sum(spare[r] for r in takers)
    out = [0] * len(spare)
    for r, n in zip(takers, even_shares(given, len(takers)), strict=True):
        out[r] = n
    return out
