"""Moved to :mod:`tests.support.kafka` (helpers) and ``tests/conftest.py`` (fixtures).

Kept only while the benchmark smoke tests still import :class:`KafkaForTests`
from here; import it from :mod:`tests.support.kafka` instead.
"""

from tests.support.kafka import KafkaForTests

__all__ = ["KafkaForTests"]
