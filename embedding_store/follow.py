"""How often a serving replica follows its training shard: a constant of its own, so
that the CLI's help can show it without importing the store's numpy code."""

from __future__ import annotations

from typing import Final

FOLLOW_POLL_S: Final = 0.5
"""Seconds between a follower's rounds: rows are served about this much after training
changed them, and each round costs the training shard and the follower a fixed price
whatever it carries. Beside a job training on the same host, that price comes out of the
spare CPU that absorbs a serving load: on 2 cores, rounds every 0.1 s cost a following
server 0.05 of a core and each shard about 0.01 more than rounds every 0.5 s (0.02 on the
server), and 100 batch-64 requests a second cost the job 11-16% of its samples/s where
they cost it 6-12% with rounds every 0.5 s."""
