"""The plain path (Python records straight to a batch) held to the columnar path.

For every request, ``PlainBatchBuilder`` either declines (None) or gives the
batch that ``JsonLinesCodec.decode`` + ``build_batch`` give, array for array;
and it never accepts a record the columnar path finds bad.
"""

from __future__ import annotations

import json
import random

import pytest

from pipeline.hashing import ValueHasher, feature_id
from tests.pipeline.plain_reference import (
    CODEC,
    GOOD_VALUES,
    ODD_VALUES,
    SPEC,
    assert_same,
    columnar_batch,
    odd_payloads,
    plain_batch,
)


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
        columnar, bad = columnar_batch(payloads, spec)
        assert bad == 0, payloads
        plain = plain_batch(payloads, spec)
        assert plain is not None, payloads  # plainly good: the plain path takes them all
        assert columnar is not None
        assert_same(plain, columnar)
        accepted += 1
    assert accepted == 300


@pytest.mark.parametrize("required", [False, True])
@pytest.mark.parametrize(("field", "text"), ODD_VALUES)
def test_an_odd_value_is_left_to_the_columnar_path_or_agrees_with_it(
    field: str, text: str, required: bool
) -> None:
    spec = SPEC if required else SPEC.for_scoring()
    payloads = odd_payloads(field, text)
    columnar, bad = columnar_batch(payloads, spec)
    plain = plain_batch(payloads, spec)
    if plain is not None:
        assert bad == 0, f"the plain path took a record the columnar path finds bad: {payloads}"
        assert columnar is not None
        assert_same(plain, columnar)


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
