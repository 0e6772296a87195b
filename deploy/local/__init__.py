"""Running streamrec on one machine: store shard processes (and, later, the rest)."""
