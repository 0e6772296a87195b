"""The plain path (Python records straight to a batch) held to the columnar path.

For every request, ``PlainBatchBuilder`` either declines (None) or gives the
batch that ``JsonLinesCodec.decode`` + ``build_batch`` give, array for array;
and it never accepts a record the columnar path finds bad.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from connectors.codecs.json_lines import JsonLinesCodec
from connectors.spec import FeatureSpec
from connectors.types import Chunk, RawChunk
from pipeline.batch import build_batch
from pipeline.hashing import ValueHasher, feature_id
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


def _record(rng: random.Random) -> dict[str, object]:
    record: dict[str, object] = {}
    for name, choices in GOOD_VALUES.items():
        value = rng.choice(choices)
        if value != "absent":
            record[name] = value
    if rng.random() < 0.3:
        record["other"] = {"nested": [1, {"x": None}], "n": True}
    return record


def _payload(record: dict[str, object]) -> bytes:
    # Escaped and raw UTF-8 strings both: the two parsers must agree on either.
    return json.dumps(record, ensure_ascii=len(record) % 2 == 0).encode()


def _columnar(payloads: list[bytes], spec: FeatureSpec) -> tuple[PreparedBatch | None, int]:
    n = len(payloads)
    table, bad = CODEC.decode(RawChunk(Chunk("s", "p", 0, n), np.arange(n), payloads), spec)
    if bad:
        return None, len(bad)
    return build_batch(table, spec), 0


def _plain(payloads: list[bytes], spec: FeatureSpec) -> PreparedBatch | None:
    objects = CODEC.plain_objects(payloads, spec)
    return None if objects is None else PlainBatchBuilder(spec).build(objects)


def _assert_same(plain: PreparedBatch, columnar: PreparedBatch) -> None:
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


@pytest.mark.parametrize("required", [False, True])
def test_good_records_give_the_columnar_batch_value_for_value(required: bool) -> None:
    spec = SPEC if required else SPEC.for_scoring()
    rng = random.Random(7)
    accepted = 0
    for _ in range(300):
        records = [_record(rng) for _ in range(rng.choice([1, 1, 2, 5, 17]))]
        if required:  # a learned record needs its labels
            for r in records:
                r.setdefault("click", 1)
                r.setdefault("buy", 0)
                r["click"] = r["click"] if r["click"] is not None else 0
                r["buy"] = r["buy"] if r["buy"] is not None else 1
        payloads = [_payload(r) for r in records]
        columnar, bad = _columnar(payloads, spec)
        assert bad == 0, payloads
        plain = _plain(payloads, spec)
        assert plain is not None, payloads  # plainly good: the plain path takes them all
        assert columnar is not None
        _assert_same(plain, columnar)
        accepted += 1
    assert accepted == 300


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


@pytest.mark.parametrize("required", [False, True])
@pytest.mark.parametrize(("field", "text"), ODD_VALUES)
def test_an_odd_value_is_left_to_the_columnar_path_or_agrees_with_it(
    field: str, text: str, required: bool
) -> None:
    spec = SPEC if required else SPEC.for_scoring()
    payloads = odd_payloads(field, text)
    columnar, bad = _columnar(payloads, spec)
    plain = _plain(payloads, spec)
    if plain is not None:
        assert bad == 0, f"the plain path took a record the columnar path finds bad: {payloads}"
        assert columnar is not None
        _assert_same(plain, columnar)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"user": "a", "user": "b"}',
        b'{"user": "a", "x": 1, "x": 2}',
        b' {"user": "a"}',
        b'{"user": "a"}\n',
        b'{"user": "\xff"}',
        b"[1]",
        b"null",
        b"",
        b'{"user": "a"',
        b'{"user": "a"} {"user": "b"}',
        b"{" + b'"pad": "' + b"x" * 2000 + b'"}',
    ],
)
def test_payloads_that_are_not_plainly_one_object_are_declined(payload: bytes) -> None:
    spec = SPEC.for_scoring().model_copy(update={"max_record_bytes": 1024})
    assert CODEC.plain_objects([b'{"user": "a"}', payload], spec) is None


def test_bytes_views_are_declined_rather_than_copied() -> None:
    assert CODEC.plain_objects([memoryview(b'{"user": "a"}')], SPEC) is None  # type: ignore[list-item]


def test_the_value_hasher_gives_the_columns_ids() -> None:
    rng = random.Random(3)
    fields = ["a", "b", "c"]
    values: list[str | int] = []
    field_of: list[int] = []
    for _ in range(500):
        f = rng.randrange(3)
        v: str | int = (
            rng.randrange(-(2**63), 2**63)
            if rng.random() < 0.5
            else "".join(rng.choice("aé日x") for _ in range(rng.randrange(0, 20)))
        )
        values.append(v)
        field_of.append(f)
    ids = ValueHasher(fields).ids(field_of, values)
    assert [int(i) for i in ids] == [
        feature_id(fields[f], v) for f, v in zip(field_of, values, strict=True)
    ]
    with pytest.raises(ValueError, match=r"field_of must hold 2 indices in \[0, 3\)"):
        ValueHasher(fields).ids([0, 3], ["x", "y"])
    assert ValueHasher(fields).ids([], []).shape == (0,)
