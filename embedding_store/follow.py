"""How often a serving replica follows its training shard: a constant of its own, so
that the CLI's help can show it without importing the store's numpy code."""

from __future__ import annotations

from typing import Final

FOLLOW_POLL_S: Final = 0.5
"""Seconds between a follower's rounds: rows are served about this much after training
changed them, and each round costs the training shard and the follower a fixed price
whatever it carries, taken from the spare CPU that absorbs a serving load beside a job
training on the same host; shorter rounds buy freshness with the job's samples/s
(``benchmarks/serve.py`` measures both)."""
