"""Tables larger than memory: a disk tier under a shard's rows."""
