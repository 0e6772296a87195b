"""Codecs: record payloads to Arrow tables of good records, and bad records to dead-letter.

Three codecs share one protocol, :class:`Codec`:

- :class:`JsonLinesCodec` (the default): one JSON object per payload, all the
  payloads of a chunk read at once by a compiled scanner (or ``pyarrow.json``);
- :class:`CriteoTsvCodec`: Criteo lines ``label \\t I1..I13 \\t C1..C26``, read by
  ``pyarrow.csv``;
- :class:`ArrowIpcCodec`: each payload an Arrow IPC stream of one or more rows.

``decode`` returns a table of the good records only (the columns of
:func:`connectors.validate.spec_schema` and ``__position``, in record order)
and one :class:`~connectors.types.BadRecord` per bad record, in record order.
It never raises for a bad record; it raises ``ValueError`` for a bad
configuration (a TSV codec asked to read a list field). The reasons are listed
in :data:`connectors.validate.REASONS`.

``encode`` turns a table into payloads, one per row (``ArrowIpcCodec`` can
pack several rows per payload); it is for test data and ``streamrec produce``.

The modules: :mod:`~connectors.codecs.protocol` (:class:`Codec`,
:func:`make_codec`), :mod:`~connectors.codecs.steps` (the decoding steps the
codecs share), one module per codec (:mod:`~connectors.codecs.json_lines`,
:mod:`~connectors.codecs.criteo_tsv`, :mod:`~connectors.codecs.arrow_ipc`), and
the JSON codec's compiled scanner: :mod:`~connectors.codecs.json_lex` (bytes, strings,
numbers), :mod:`~connectors.codecs.json_scan` (records into arrays; its docstring says
why there is one), :mod:`~connectors.codecs.json_columns` (arrays into Arrow columns)
and :mod:`~connectors.codecs.json_sparse` (sparse values for the serving path).

>>> import numpy as np
>>> from connectors.spec import FeatureSpec
>>> from connectors.types import Chunk, RawChunk
>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"], "dense": [{"name": "price"}],
...     "sparse": [{"name": "user", "table": "users"}],
... })
>>> payloads = [b'{"click": 1, "price": 2.5, "user": "u1"}', b'{"click": "yes"}', b'{"cl']
>>> raw = RawChunk(Chunk("kafka", "events/0", 40, 43), np.arange(40, 43), payloads)
>>> good, bad = make_codec("json").decode(raw, spec)
>>> good.to_pylist()
[{'click': 1.0, 'price': 2.5, 'user': 'u1', '__position': 40}]
>>> [(b.position, b.reason) for b in bad]
[(41, 'label_wrong_type'), (42, 'not_json')]
"""

from __future__ import annotations

from connectors.codecs.arrow_ipc import ArrowIpcCodec
from connectors.codecs.criteo_tsv import CriteoTsvCodec
from connectors.codecs.json_lines import JsonLinesCodec
from connectors.codecs.protocol import Codec, CodecName, make_codec

__all__ = [
    "ArrowIpcCodec",
    "Codec",
    "CodecName",
    "CriteoTsvCodec",
    "JsonLinesCodec",
    "make_codec",
]
