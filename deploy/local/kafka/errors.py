"""The local Kafka's errors: it cannot be had here, or a server did not start."""

from __future__ import annotations


class KafkaSetupError(RuntimeError):
    """Kafka cannot be obtained or started here; the message says what to install or fix."""


class KafkaStartError(RuntimeError):
    """A server process exited or did not become ready; the message holds its log tail."""
