"""The :class:`Codec` protocol every codec follows, and :func:`make_codec`, a codec by name."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

import pyarrow as pa

from connectors.codecs.arrow_ipc import ArrowIpcCodec
from connectors.codecs.criteo_tsv import CriteoTsvCodec
from connectors.codecs.json_lines import JsonLinesCodec
from connectors.spec import FeatureSpec
from connectors.types import BadRecord, RawChunk

CodecName = Literal["json", "criteo_tsv", "arrow"]


class Codec(Protocol):
    """Payload bytes to a table of good records and a list of bad ones, and back."""

    def decode(self, raw: RawChunk, spec: FeatureSpec) -> tuple[pa.Table, list[BadRecord]]:
        """The good records of ``raw`` (spec columns and ``__position``) and the bad ones."""
        ...

    def encode(self, table: pa.Table) -> list[bytes]:
        """Payloads for the rows of ``table`` (a ``__position`` column is left out)."""
        ...


def make_codec(name: CodecName, **options: Any) -> Codec:
    """The codec called ``name``, with its options (unknown options are an error).

    >>> make_codec("criteo_tsv", columns=["y", "a", "b"])
    CriteoTsvCodec(columns=('y', 'a', 'b'))
    >>> make_codec("json", colums=["y"])
    Traceback (most recent call last):
    ...
    ValueError: codec 'json' has no option 'colums'; its options: ['engine', 'segment_bytes']
    """
    codecs: dict[str, type[JsonLinesCodec] | type[CriteoTsvCodec] | type[ArrowIpcCodec]] = {
        "json": JsonLinesCodec,
        "criteo_tsv": CriteoTsvCodec,
        "arrow": ArrowIpcCodec,
    }
    cls = codecs.get(name)
    if cls is None:
        msg = f"unknown codec {name!r}; the codecs are {sorted(codecs)}"
        raise ValueError(msg)
    allowed = sorted(f.name for f in dataclasses.fields(cls))
    for option in options:
        if option not in allowed:
            msg = f"codec {name!r} has no option {option!r}; its options: {allowed}"
            raise ValueError(msg)
    return cls(**options)
