"""Bad JSON-lines records of every kind, and the spec they are bad against.

``JSON_BAD_CASES`` holds one entry per *kind* of bad record: the payload, the
reason it is bad for and the field a dead letter names (None when the payload
as a whole is wrong). Together they cover the 19 reasons a JSON payload can
have (every reason in ``connectors.validate.REASONS`` but the TSV and Arrow
ones). The codec tests decode them; the runner tests send them through Kafka.

``feature_spec`` makes specs of these fields with other limits (the validate
tests use one), and ``value_reason`` is the reference for the label and dense
values the codec and validate oracles share.
"""

from __future__ import annotations

import json
import math
from typing import Any

from connectors.spec import FeatureSpec


def feature_spec(*, price_max: float = 1000, max_len: int = 3, **options: Any) -> FeatureSpec:
    """A label ``click``, dense ``price`` in [0, price_max] and ``age`` (no fill), and four
    sparse fields: ``user``, ``item`` (int), lists ``tags`` and ``cats`` of ``max_len``."""
    return FeatureSpec.model_validate(
        {
            "labels": ["click"],
            "dense": [
                {"name": "price", "min_value": 0, "max_value": price_max},
                {"name": "age", "fill": None},
            ],
            "sparse": [
                {"name": "user", "table": "users"},
                {"name": "item", "table": "items", "type": "int"},
                {"name": "tags", "table": "tags", "type": "list_string", "max_len": max_len},
                {"name": "cats", "table": "cats", "type": "list_int", "max_len": max_len},
            ],
            **options,
        }
    )


SPEC = feature_spec(max_record_bytes=512)
I64_MAX = 2**63 - 1


def value_reason(
    click: float | None, price: float | None, age: float | None, *, price_max: float
) -> str | None:
    """Why a row with these (numeric or null) label and dense values is bad; None: good.

    The documented rules for a ``feature_spec(price_max=...)`` spec, in the order
    they are checked.
    """
    if click is None:
        return "null_label"
    if not math.isfinite(click):
        return "label_not_finite"
    if not 0 <= click <= 1:
        return "label_out_of_range"
    if price is not None:
        if not math.isfinite(price):
            return "dense_not_finite"
        if price < 0:
            return "dense_below_min"
        if price > price_max:
            return "dense_above_max"
    if age is None:
        return "missing_dense"
    if not math.isfinite(age):
        return "dense_not_finite"
    return None


def j(obj: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


def base(**fields: Any) -> dict[str, Any]:
    """A good record with some fields replaced (a value of ... removes the field)."""
    rec: dict[str, Any] = {"click": 1, "price": 5.0, "age": 30.0, "user": "u", "item": 1}
    rec.update(fields)
    return {k: v for k, v in rec.items() if v is not ...}


# (payload, reason, field named by the dead letter)
JSON_BAD_CASES: list[tuple[bytes, str, str | None]] = [
    (b"", "empty_payload", None),
    (j(base(user="x" * 600)), "oversize", None),
    (b'{"click":1,"age":1,"user":"\xff\xfe"}', "not_utf8", None),  # the payload is not UTF-8
    (b'{"click":1,"age":1,"user":"\\ud800"}', "not_utf8", "user"),  # a lone surrogate escape
    (b'{"click":1,"age":1', "not_json", None),  # truncated
    (b'{"click":1,"age":1} x', "not_json", None),  # trailing garbage
    (b'{"click":1,"age":1}{"click":0,"age":1}', "not_json", None),  # two objects in one payload
    (b"   ", "not_json", None),
    (b'\xef\xbb\xbf{"click":1,"age":1}', "not_json", None),  # a byte-order mark
    (b'{"click":1,"age":1,"user":"a\tb"}', "not_json", None),  # a raw control byte in a string
    (b'{"click":1,"age":01}', "not_json", None),  # a leading zero
    (b"null", "not_object", None),  # a first value of null crashes pyarrow's reader
    (b"[1, 2]", "not_object", None),
    (b"3", "not_object", None),
    (b'"click"', "not_object", None),
    (b'{"click":1,"click":0,"age":1}', "duplicate_field", "click"),
    (b'{"click":1,"cl\\u0069ck":0,"age":1}', "duplicate_field", "click"),  # escaped key
    (j(base(click=...)), "missing_label", "click"),
    (j(base(click=None)), "null_label", "click"),
    (j(base(click="1")), "label_wrong_type", "click"),
    (j(base(click=True)), "label_wrong_type", "click"),
    (j(base(click=[1])), "label_wrong_type", "click"),
    (j(base(click=1.5)), "label_out_of_range", "click"),
    (j(base(click=-1)), "label_out_of_range", "click"),
    (b'{"click":NaN,"age":1}', "label_not_finite", "click"),
    (b'{"click":1e999,"age":1}', "label_not_finite", "click"),
    (j(base(price="3")), "dense_wrong_type", "price"),
    (j(base(price="NaN")), "dense_wrong_type", "price"),
    (j(base(price=False)), "dense_wrong_type", "price"),
    (j(base(price={"v": 1})), "dense_wrong_type", "price"),
    (j(base(price=[1.0])), "dense_wrong_type", "price"),
    (b'{"click":1,"price":Infinity,"age":1}', "dense_not_finite", "price"),
    (b'{"click":1,"price":1e999,"age":1}', "dense_not_finite", "price"),
    (b'{"click":1,"age":-1e400}', "dense_not_finite", "age"),
    # An int too big for a double.
    (b'{"click":1,"age":' + b"9" * 400 + b"}", "dense_not_finite", "age"),
    (j(base(price=-0.5)), "dense_below_min", "price"),
    (j(base(price=1000.5)), "dense_above_max", "price"),
    (j(base(age=...)), "missing_dense", "age"),
    (j(base(age=None)), "missing_dense", "age"),
    (j(base(user=3.5)), "sparse_wrong_type", "user"),
    (j(base(user=7)), "sparse_wrong_type", "user"),  # strict: an int is not a string
    (j(base(user={"id": "a"})), "sparse_wrong_type", "user"),
    (j(base(user=["a"])), "sparse_wrong_type", "user"),
    (j(base(item="5")), "sparse_wrong_type", "item"),
    (j(base(item=5.0)), "sparse_wrong_type", "item"),  # strict: a float is not an int
    (j(base(item=True)), "sparse_wrong_type", "item"),
    (j(base(tags="a")), "sparse_wrong_type", "tags"),
    (j(base(tags=["a", 1])), "sparse_wrong_type", "tags"),
    (j(base(tags=["a", None])), "sparse_wrong_type", "tags"),
    (j(base(cats=[1.5])), "sparse_wrong_type", "cats"),
    (j(base(cats=[1, "2"])), "sparse_wrong_type", "cats"),
    (j(base(item=I64_MAX + 1)), "int_overflow", "item"),
    (j(base(item=-(2**63) - 1)), "int_overflow", "item"),
    (j(base(cats=[1, 10**20])), "int_overflow", "cats"),
    (j(base(tags=["a", "b", "c", "d"])), "list_too_long", "tags"),
    (j(base(cats=[1, 2, 3, 4])), "list_too_long", "cats"),
]

JSON_BAD: list[tuple[bytes, str]] = [(payload, reason) for payload, reason, _ in JSON_BAD_CASES]
"""``JSON_BAD_CASES`` without the fields: (payload, reason)."""
