"""Kafka fixtures (a real broker for the whole test session); filled in with the Kafka work."""
