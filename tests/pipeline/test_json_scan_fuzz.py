"""The JSON scanner fuzzed against Python's ``json``: the same batch, and always an end.

Batches are drawn at sizes on both sides of the scanner's scratch stores (1,024
list elements of a kind to start with, doubled as needed) and of the powers of
two around them, with long lists, many lists, empty lists, escapes and long
strings. Every scan runs on a thread under a time limit: a scan that does not
end fails the test instead of holding it. The oracle is the plain path
(``json.loads``, then ``PlainBatchBuilder``); the scanner's two callers, the
serving path (``JsonScanBuilder``) and the codec (``JsonLinesCodec``'s scan
engine), must give its batch.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.codecs import json_scan
from connectors.codecs.json_scan import STALLED, ScanPlan, ScanStalled, scan_values
from connectors.spec import FeatureSpec
from pipeline.json_scan import JsonScanBuilder
from tests.pipeline.plain_reference import assert_same, columnar_batch, plain_batch

T = TypeVar("T")

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["y"],
        "labels_required": False,
        "dense": [{"name": "x"}],
        "sparse": [
            {"name": "s", "table": "t"},
            {"name": "i", "table": "t", "type": "int"},
            {"name": "a", "table": "t", "type": "list_string", "max_len": 5000},
            {"name": "b", "table": "t", "type": "list_int", "max_len": 5000},
            {"name": "c", "table": "u", "type": "list_string", "max_len": 5000},
        ],
    }
)
# Record counts on both sides of the stores' first sizes and of nearby powers of two.
SIZES = [1, 2, 3, 63, 64, 65, 341, 342, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 3073]
LIMIT_S = 60.0


def ends(call: Callable[[], T], what: object) -> T:
    """``call()`` on a thread; fails the test when it has not returned after ``LIMIT_S``."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    if thread.is_alive():
        pytest.fail(f"the scan did not end within {LIMIT_S:g}s: {what}")
    if errors:
        raise errors[0]
    return out[0]


# Strings: plain, escaped (quotes, backslashes, control bytes), non-ASCII, astral, long.
texts = st.one_of(
    st.text(max_size=6),
    st.text(alphabet='"\\/\b\f\n\r\t\x00\x1f é€😀', max_size=12),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=200, max_size=2000),
)
ints = st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1))


def lists_of(elements: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    return st.one_of(
        st.just([]),
        st.lists(elements, min_size=1, max_size=7),
        st.lists(elements, min_size=100, max_size=1100),  # one record past a store
    )


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    """A good record: any of the fields, in any order, with an unknown key or not."""
    fields: dict[str, st.SearchStrategy[Any]] = {
        "y": st.sampled_from([0, 1, 0.5]),
        # Numbers of the scanner's exact fast path: others it leaves, by design, to Arrow.
        "x": st.integers(-(10**8), 10**8).map(lambda k: k / 100) | st.integers(-1000, 1000),
        "s": texts,
        "i": ints,
        "a": lists_of(texts),
        "b": lists_of(ints),
        "c": lists_of(st.text(max_size=3)),
    }
    rec = {name: draw(s) for name, s in fields.items() if draw(st.booleans()) or name == "x"}
    if draw(st.booleans()):
        rec["other"] = draw(st.recursive(
            st.none() | st.booleans() | st.integers() | texts,
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=3),
            max_leaves=12,
        ))  # fmt: skip
    order = draw(st.permutations(sorted(rec)))
    return {k: rec[k] for k in order}


def payload(rec: dict[str, Any], style: int) -> bytes:
    if style == 0:
        return json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode()
    if style == 1:
        return json.dumps(rec, ensure_ascii=True).encode()  # every non-ASCII one escaped
    return json.dumps(rec, separators=(" , ", " :\t"), ensure_ascii=False).encode()


@st.composite
def batches(draw: st.DrawFn) -> list[bytes]:
    """A few drawn records, repeated to one of ``SIZES``."""
    templates = [payload(draw(records()), draw(st.integers(0, 2)))
                 for _ in range(draw(st.integers(1, 5)))]  # fmt: skip
    n = draw(st.sampled_from(SIZES))
    return [templates[k % len(templates)] for k in range(n)]


@given(payloads=batches())
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_scan_gives_json_loads_batch_and_ends(payloads: list[bytes]) -> None:
    want = plain_batch(payloads, SPEC)
    assert want is not None, "the plain path takes good records"
    scanned = ends(lambda: JsonScanBuilder(SPEC).build(payloads), payloads[:3])
    assert scanned is not None, "the scanner declined good records"
    assert_same(scanned, want)
    columnar, bad = ends(lambda: columnar_batch(payloads, SPEC), payloads[:3])
    assert bad == 0
    assert columnar is not None
    assert_same(want, columnar)


MUTATIONS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"-", b"0", b" ", b"\\u", b"tru"]


@given(payloads=batches(), data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_changed_batch_ends_and_is_declined_or_agrees(
    payloads: list[bytes], data: st.DataObject
) -> None:
    """Bytes cut, dropped or added anywhere: the scan ends, and what it accepts agrees."""
    changed = list(payloads)
    for _ in range(data.draw(st.integers(1, 4))):
        k = data.draw(st.integers(0, len(changed) - 1))
        b = bytearray(changed[k])
        at = data.draw(st.integers(0, len(b)))
        edit = data.draw(st.integers(0, 2))
        if edit == 0:
            del b[at:]
        elif edit == 1:
            b[at:at] = data.draw(st.sampled_from(MUTATIONS))
        elif b:
            del b[min(at, len(b) - 1)]
        changed[k] = bytes(b) or b"{}"
    scanned = ends(lambda: JsonScanBuilder(SPEC).build(changed), changed[:3])
    columnar, bad = ends(lambda: columnar_batch(changed, SPEC), changed[:3])
    if scanned is not None:
        assert bad == 0, "the scanner took a record json.loads finds bad"
        assert columnar is not None
        assert_same(scanned, columnar)


def _no_progress(*args: Any) -> int:
    return json_scan._OUT_OF_ROOM  # always "out of room", however the stores grow


def test_a_scan_that_cannot_progress_ends_naming_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record read again and again without end stops the scan with a refusal that
    names it: the kernel (run as Python, its record reader replaced) grows the full
    store past what any record of that size can need, then gives up."""
    monkeypatch.setattr(json_scan, "_scan_record", _no_progress)
    monkeypatch.setattr(json_scan, "_scan_records", json_scan._scan_records.py_func)
    plan = ScanPlan.of(SPEC)
    payloads = [b'{"a": []}', b'{"a": ["x", "y"]}']
    joined = b"\n".join(payloads) + b"\n"
    starts = np.array([0, len(payloads[0]) + 1, len(joined)], dtype=np.int64)
    skip = np.array([True, False])  # the first is skipped: the second is the one named
    with pytest.raises(ScanStalled, match=r"no progress in record 1 of the chunk") as e:
        ends(lambda: scan_values(joined, starts, skip, plan), payloads)
    assert e.value.record == 1
    assert e.value.payload == payloads[1]
    assert STALLED == 3
