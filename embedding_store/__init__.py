"""Embedding store: a persistent, sharded embedding table service (see the README)."""
