"""The plain path's reference: the columnar path (codec, then ``build_batch``), and a spec.

``plain`` gives ``PlainBatchBuilder``'s batch (or None where it declines) and
``columnar`` the one ``JsonLinesCodec.decode`` + ``build_batch`` give;
``assert_same`` holds the two equal, array for array. ``GOOD_VALUES`` and
``ODD_VALUES`` are the values of ``SPEC``'s fields the plain tests try.
"""

from __future__ import annotations

import json

import numpy as np

from connectors.codecs.json_lines import JsonLinesCodec
from connectors.spec import FeatureSpec
from connectors.types import Chunk, RawChunk
from pipeline.batch import build_batch
from pipeline.plain import PlainBatchBuilder
from pipeline.types import PreparedBatch

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["click", "buy"],
        "dense": [
            {"name": "price", "transform": "log1p", "min_value": 0},
            {"name": "delta", "transform": "signed_log1p", "clip_min": -2.0, "clip_max": 3.0},
            {"name": "age", "fill": None, "max_value": 150},
            {"name": "n"},
        ],
        "sparse": [
            {"name": "user", "table": "ids"},
            {"name": "item", "table": "ids", "type": "int"},
            {"name": "tags", "table": "tags", "type": "list_string", "pooling": "mean"},
            {"name": "cats", "table": "ids", "type": "list_int", "max_len": 4},
            {"name": "city", "table": "city"},
        ],
    }
)
CODEC = JsonLinesCodec()

GOOD_VALUES: dict[str, list[object]] = {
    "click": [0, 1, 0.5, None, "absent"],
    "buy": [0.0, 1.0, None, "absent"],
    "price": [0, 3, 2.5, 1e6, None, "absent", 1e-300],
    "delta": [-100.0, -1, 0, 0.25, 40, None, "absent", -0.0],
    "age": [0, 30, 149.5, 150],
    "n": [-(2**53), 2**53, 7, -3.5, None],
    "user": ["u1", "u2", "", "é", "日本", "a" * 40, "\u0000x", None, "absent"],
    "item": [0, 1, -1, 2**63 - 1, -(2**63), 12345678901, None],
    "tags": [[], ["a"], ["a", "b", "a"], ["é" * 9, ""], None, "absent"],
    "cats": [[], [1], [1, 1, 2, 3], [-(2**63), 2**63 - 1], None],
    "city": ["paris", "x" * 17, None, "absent"],
}


def columnar_batch(payloads: list[bytes], spec: FeatureSpec) -> tuple[PreparedBatch | None, int]:
    n = len(payloads)
    table, bad = CODEC.decode(RawChunk(Chunk("s", "p", 0, n), np.arange(n), payloads), spec)
    if bad:
        return None, len(bad)
    return build_batch(table, spec), 0


def plain_batch(payloads: list[bytes], spec: FeatureSpec) -> PreparedBatch | None:
    objects = CODEC.plain_objects(payloads, spec)
    return None if objects is None else PlainBatchBuilder(spec).build(objects)


def assert_same(plain: PreparedBatch, columnar: PreparedBatch) -> None:
    np.testing.assert_array_equal(plain.labels, columnar.labels)
    assert plain.labels.dtype == columnar.labels.dtype == np.float32
    np.testing.assert_array_equal(plain.dense, columnar.dense)
    assert plain.dense.dtype == columnar.dense.dtype == np.float32
    assert list(plain.tables) == list(columnar.tables)
    for name, want in columnar.tables.items():
        got = plain.tables[name]
        assert (got.fields, got.pooling) == (want.fields, want.pooling)
        for attr in ("unique_ids", "inverse", "offsets"):
            a, b = getattr(got, attr), getattr(want, attr)
            assert a.dtype == b.dtype, (name, attr)
            np.testing.assert_array_equal(a, b, err_msg=f"{name}.{attr}")


ODD_VALUES: list[tuple[str, str]] = [
    # (field, JSON text of its value): what a client might send
    ("user", "7"),
    ("user", "true"),
    ("user", '"\\ud800"'),
    ("user", '["a"]'),
    ("item", '"7"'),
    ("item", "7.0"),
    ("item", "true"),
    ("item", str(2**63)),
    ("item", str(-(2**63) - 1)),
    ("item", "1e3"),
    ("tags", '"a"'),
    ("tags", '["a", null]'),
    ("tags", '["a", 1]'),
    ("tags", '["\\udc00"]'),
    ("cats", "[1, 2, 3, 4, 5]"),
    ("cats", "[1.5]"),
    ("cats", "[true]"),
    ("cats", f"[{2**64}]"),
    ("price", "-1"),
    ("price", "NaN"),
    ("price", "Infinity"),
    ("price", "-Infinity"),
    ("price", "1e999"),
    ("price", '"3"'),
    ("price", "true"),
    ("price", "[1]"),
    ("age", "null"),
    ("age", "151"),
    ("n", str(2**53 + 1)),
    ("n", str(2**70)),
    ("n", "-1e400"),
    ("click", "2"),
    ("click", "-0.5"),
    ("click", '"1"'),
    ("click", "false"),
    ("click", "NaN"),
    ("buy", "null"),
]


def _base() -> dict[str, object]:
    return {"click": 1, "buy": 0, "price": 1.5, "delta": 0.5, "age": 30, "n": 2, "user": "u"}


def odd_payloads(field: str, text: str) -> list[bytes]:
    """A good record, then one whose ``field`` holds the JSON ``text``."""
    record = _base()
    record[field] = "@@"
    odd = json.dumps(record).replace('"@@"', text)
    return [json.dumps(_base()).encode(), odd.encode()]
