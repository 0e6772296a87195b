"""The scanned path (JSON bytes straight to a batch) held to the columnar path.

For every request, ``JsonScanBuilder`` either declines (None) or gives the
batch that ``JsonLinesCodec.decode`` + ``build_batch`` give, array for array;
and it never accepts a record the columnar path finds bad, however its bytes
are cut or changed.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from connectors.codecs.joined import JoinedPayloads
from connectors.spec import FeatureSpec
from pipeline.json_scan import JsonScanBuilder
from tests.pipeline.plain_reference import (
    GOOD_VALUES,
    ODD_VALUES,
    SPEC,
    assert_same,
    columnar_batch,
    odd_payloads,
    plain_batch,
)

# The plain test's values but one this path leaves to the others: a number beyond the
# scanner's exact fast path (Arrow's parser reads it on the columnar path).
SCANNED_VALUES = {name: [v for v in values if v != 1e-300] for name, values in GOOD_VALUES.items()}


def _record(rng: random.Random) -> dict[str, object]:
    record: dict[str, object] = {}
    for name, choices in SCANNED_VALUES.items():
        value = rng.choice(choices)
        if value != "absent":
            record[name] = value
    if rng.random() < 0.3:  # a key the spec does not name: skipped
        record["other"] = {"nested": [1, {"x": None}], "n": True}
    return record


def _payload(record: dict[str, object], rng: random.Random) -> bytes:
    keys = list(record)
    rng.shuffle(keys)  # any key order
    separators = rng.choice([(", ", ": "), (",", ":"), (" ,\n", " :\t")])
    # Escaped and raw UTF-8 strings both.
    text = json.dumps(
        {k: record[k] for k in keys}, ensure_ascii=rng.random() < 0.5, separators=separators
    )
    return text.encode()


@pytest.mark.parametrize("required", [False, True])
def test_good_records_give_the_columnar_batch_value_for_value(required: bool) -> None:
    spec = SPEC if required else SPEC.for_scoring()
    builder = JsonScanBuilder(spec)
    rng = random.Random(11)
    scanned = 0
    for _ in range(300):
        records = [_record(rng) for _ in range(rng.choice([1, 1, 2, 5, 17, 64]))]
        if required:
            for r in records:
                r["click"] = 1 if r.get("click") is None else r["click"]
                r["buy"] = 0 if r.get("buy") is None else r["buy"]
        payloads = [_payload(r, rng) for r in records]
        columnar, bad = columnar_batch(payloads, spec)
        assert bad == 0, payloads
        assert columnar is not None
        batch = builder.build(payloads)
        assert batch is not None, payloads  # plainly good: this path takes them all
        assert_same(batch, columnar)
        scanned += 1
    assert scanned == 300


@pytest.mark.parametrize("required", [False, True])
@pytest.mark.parametrize(("field", "text"), ODD_VALUES)
def test_an_odd_value_is_declined_or_agrees_with_the_columnar_path(
    field: str, text: str, required: bool
) -> None:
    spec = SPEC if required else SPEC.for_scoring()
    payloads = odd_payloads(field, text)
    columnar, bad = columnar_batch(payloads, spec)
    batch = JsonScanBuilder(spec).build(payloads)
    if batch is not None:
        assert bad == 0, f"the scanned path took a record the columnar path finds bad: {payloads}"
        assert columnar is not None
        assert_same(batch, columnar)


# SPEC for scoring with every dense field filled: a record of one field is good.
FILLED = FeatureSpec.model_validate(
    SPEC.model_dump()
    | {
        "labels_required": False,
        "dense": [d | {"fill": 0.0} for d in SPEC.model_dump()["dense"]],
    }
)

NUMBERS = [
    "0", "-0", "7", "-3", "0.5", "-0.0", "1e3", "1E-3", "2.5e+2", "0.1", "0.000001234",
    "123456789012345.5", "9007199254740992", "9007199254740993", "1e22", "1e23", "1e-22",
    "1e-23", "12345678901234567890", "1.7976931348623157e308", "5e-324", "01", "1.", ".5",
    "-", "1e", "1e+", "--1", "+1", "1.5.5", "0x10", "1_000", "3.14159265358979323846",
]  # fmt: skip


@pytest.mark.parametrize("text", NUMBERS)
def test_a_number_is_read_as_python_reads_it_or_declined(text: str) -> None:
    spec = SPEC.for_scoring()
    payloads = [f'{{"n": {text}, "price": 1, "age": 3, "delta": 0}}'.encode()]
    columnar, bad = columnar_batch(payloads, spec)
    batch = JsonScanBuilder(spec).build(payloads)
    if batch is not None:
        assert bad == 0, text
        assert columnar is not None
        assert_same(batch, columnar)
    if text in {"0", "-0", "7", "0.5", "-0.0", "1e3", "0.1", "1e22", "1e-22"}:
        assert batch is not None, f"{text}: a plain number this path should read"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"user": "a", "x": 1}',  # a key the spec does not name
        b'{"user": "a", "x": {"y": [1, 2]}}',
        b' {"user": "a"}',
        b'{"user": "a"}\n',
        b'{"user": "\\u0061\\n"}',
        b'{"tags": ["\\u00e9", "b"]}',
        b'{"\\u0075ser": "a"}',  # an escaped key: left to json.loads, or read alike
    ],
)
def test_what_json_allows_beyond_the_plain_form_agrees_with_the_columnar_path(
    payload: bytes,
) -> None:
    payloads = [b'{"user": "a"}', payload]
    batch = JsonScanBuilder(FILLED).build(payloads)
    columnar, bad = columnar_batch(payloads, FILLED)
    assert bad == 0
    assert columnar is not None
    if batch is not None or b"\\u0075ser" not in payload:
        assert batch is not None, payload
        assert_same(batch, columnar)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"user": "a", "user": "b"}',
        b'{"user": "\xff"}',
        b'{"user": "\xed\xa0\x80"}',  # a surrogate in UTF-8: not UTF-8
        b'{"user": "\xc0\xaf"}',  # an overlong form
        b'{"user": "a\x01"}',  # a raw control character
        b'{"user": "\\ud800"}',  # a lone surrogate
        b"[1]",
        b"null",
        b"",
        b"{",
        b'{"user": "a"',
        b'{"user": "a",}',
        b'{"user" "a"}',
        b'{"user": "a"} {"user": "b"}',
        b'{"user": nul}',
        b'{"user": True}',
        b'{"cats": [1,]}',
        b'{"cats": [1 2]}',
        b'{"cats": [null]}',
        b'{"cats": [1, 2, 3, 4, 5]}',  # over max_len
        b"{" + b'"user": "' + b"x" * 2000 + b'"}',
    ],
)
def test_payloads_that_are_not_plainly_good_are_declined(payload: bytes) -> None:
    spec = FILLED.model_copy(update={"max_record_bytes": 1024})
    builder = JsonScanBuilder(spec)
    assert builder.build([b'{"user": "a"}']) is not None  # the good one alone is taken
    assert builder.build([b'{"user": "a"}', payload]) is None
    # The same where the payloads lie in one buffer (a request's binary tensor).
    assert builder.build(JoinedPayloads.of([b'{"user": "a"}'])) is not None
    assert builder.build(JoinedPayloads.of([b'{"user": "a"}', payload])) is None


def test_bytes_views_and_empty_requests_are_declined() -> None:
    builder = JsonScanBuilder(SPEC)
    assert builder.build([memoryview(b'{"user": "a"}')]) is None  # type: ignore[list-item]
    assert builder.build([]) is None


def test_changed_bytes_are_declined_or_agree_with_the_columnar_path() -> None:
    """Random cuts, swaps and insertions of JSON's own bytes: whatever this path takes,
    the columnar path takes too, with the same batch (and so does the plain path, when it
    takes it)."""
    spec = FILLED
    builder = JsonScanBuilder(spec)
    rng = random.Random(5)
    alphabet = b'{}[],:"\\ -.0123456789eEnulltrufas\xc3\xa9\xff'
    taken = 0
    for _ in range(5000):
        good = bytearray(_payload(_record(rng), rng))
        for _ in range(rng.choice([1, 1, 2, 3])):
            # Half the changes next to JSON's structure, where a slip would matter most.
            marks = [i for i, c in enumerate(good) if c in b'{}[],:"']
            if marks and rng.random() < 0.5:
                at = min(len(good), max(0, rng.choice(marks) + rng.choice([-1, 0, 1])))
            else:
                at = rng.randrange(len(good) + 1)
            action = rng.random()
            if action < 0.4 and at < len(good):
                del good[at]
            elif action < 0.8:
                good.insert(at, rng.choice(alphabet))
            elif at < len(good):
                good[at] = rng.choice(alphabet)
        payloads = [bytes(good)]
        batch = builder.build(payloads)
        if batch is None:
            continue
        taken += 1
        columnar, bad = columnar_batch(payloads, spec)
        assert bad == 0, payloads
        assert columnar is not None
        assert_same(batch, columnar)
        plain = plain_batch(payloads, spec)  # the plain path reads less, and alike
        if plain is not None:
            assert_same(plain, columnar)
    assert taken > 100  # the changes leave many records good: the comparison is exercised


def test_a_spec_without_sparse_fields_scans() -> None:
    spec = FeatureSpec.model_validate(
        {"labels": ["y"], "labels_required": False, "dense": [{"name": "x"}], "sparse": []}
    )
    batch = JsonScanBuilder(spec).build([b'{"x": 2, "y": 1}', b"{}"])
    assert batch is not None
    np.testing.assert_array_equal(batch.dense, np.array([[2.0], [0.0]], np.float32))
    np.testing.assert_array_equal(batch.labels, np.array([[1.0], [np.nan]], np.float32))
    assert batch.tables == {}
