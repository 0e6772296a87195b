"""Fixtures of the connector tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connectors.kafka import KafkaSource
from tests.support.kafka import make_kafka_source


@pytest.fixture
def sources() -> Iterator[Callable[..., KafkaSource]]:
    """A factory of sources that are all closed at teardown."""
    made: list[KafkaSource] = []

    def make(bootstrap: str, topic: str, **overrides: Any) -> KafkaSource:
        source = make_kafka_source(bootstrap, topic, **overrides)
        made.append(source)
        return source

    yield make
    for source in made:
        source.close()
