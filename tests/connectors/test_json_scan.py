"""The JSON scanner's record statuses, by name: what ``scan_values`` reads, leaves to
``json.loads`` and skips, and that it ends on records that grow its stores or nest
past its stack."""

from __future__ import annotations

import numpy as np

from connectors.codecs.json_scan import (
    DEFERRED,
    FIRST_STORE,
    LEFT,
    MAX_DEPTH,
    PRESENT,
    READ,
    SKIPPED,
    ScanPlan,
    scan_values,
)
from connectors.spec import FeatureSpec

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["y"],
        "labels_required": False,
        "dense": [{"name": "x"}],
        "sparse": [
            {"name": "s", "table": "t"},
            {"name": "b", "table": "t", "type": "list_int", "max_len": 10_000},
        ],
    }
)


def scan(payloads: list[bytes], skip: list[bool] | None = None) -> np.ndarray:
    joined = b"\n".join(payloads) + b"\n"
    starts = np.zeros(len(payloads) + 1, dtype=np.int64)
    np.cumsum([len(p) + 1 for p in payloads], out=starts[1:])
    skipped = np.array(skip if skip is not None else [False] * len(payloads))
    return scan_values(joined, starts, skipped, ScanPlan.of(SPEC)).status


def test_each_record_gets_a_named_status() -> None:
    payloads = [
        b'{"y": 1, "x": 2.5, "s": "a", "b": [1, 2]}',
        b'{"y": "one"}',  # a wrong type: json.loads names it
        b'{"y": 1, "y": 0}',  # a spec key twice
        b'{"y": 1}',
        b'{"y": 1, "x": 1e400}',  # beyond the fast path: read, its text kept
    ]
    status = scan(payloads, skip=[False, False, False, True, False])
    assert status.tolist() == [READ, LEFT, LEFT, SKIPPED, READ]


def test_value_states_are_named() -> None:
    joined = b'{"x": 1e400, "s": "a\\u00e9"}\n{"y": 0}\n'
    starts = np.array([0, joined.index(b"\n") + 1, len(joined)], dtype=np.int64)
    v = scan_values(joined, starts, np.zeros(2, dtype=np.bool_), ScanPlan.of(SPEC))
    assert v.status.tolist() == [READ, READ]
    assert v.fstate[0].tolist() == [0, DEFERRED]  # y absent, x beyond the fast path
    assert v.sstate[0].tolist() == [DEFERRED]  # a string with escapes
    assert v.fstate[1].tolist() == [PRESENT, 0]


def test_a_list_longer_than_the_first_store_is_read_whole() -> None:
    long_list = b'{"b": [' + b",".join(b"7" for _ in range(3 * FIRST_STORE)) + b"]}"
    assert scan([long_list, b'{"b": []}']).tolist() == [READ, READ]


def test_a_value_nested_past_the_stack_is_left_not_a_crash() -> None:
    deep = b'{"z": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b', "y": 1}'
    shallow = b'{"z": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b', "y": 1}'
    assert scan([deep, shallow]).tolist() == [LEFT, READ]
