"""``LatencyHistogram`` and ``LatencySnapshot``: bucketing, quantiles, validation, threads."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedding_store.latency import DEFAULT_BUCKETS_S, LatencyHistogram, LatencySnapshot

INF = math.inf


def test_default_buckets_are_the_documented_ones() -> None:
    assert DEFAULT_BUCKETS_S == (
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, INF,
    )  # fmt: skip
    assert LatencyHistogram().buckets_s == DEFAULT_BUCKETS_S


def test_an_empty_histogram() -> None:
    snap = LatencyHistogram().snapshot()
    assert snap.count == 0
    assert snap.sum_s == 0.0
    assert snap.counts == (0,) * len(DEFAULT_BUCKETS_S)
    assert math.isnan(snap.mean_s)
    assert math.isnan(snap.quantile(0.99))


def test_a_bound_belongs_to_its_own_bucket() -> None:
    # Prometheus' `le`: an observation equal to a bound counts in that bucket.
    hist = LatencyHistogram((0.1, 1.0))
    for seconds in (0.0, 0.1, 0.10001, 1.0, 7.0):
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap.buckets == (0.1, 1.0, INF)
    assert snap.counts == (2, 4, 5)  # cumulative
    assert snap.count == 5
    assert snap.sum_s == pytest.approx(8.20001)
    assert snap.mean_s == pytest.approx(8.20001 / 5)


def test_inf_is_appended_once() -> None:
    assert LatencyHistogram((0.5,)).buckets_s == (0.5, INF)
    assert LatencyHistogram((0.5, INF)).buckets_s == (0.5, INF)


@pytest.mark.parametrize(
    "buckets", [(), (INF,), (0.1, 0.1), (0.2, 0.1), (0.0, 1.0), (-1.0, 1.0), (math.nan,)]
)
def test_bad_buckets_are_refused(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets_s must be positive"):
        LatencyHistogram(buckets)


@pytest.mark.parametrize("seconds", [-0.001, math.nan, INF])
def test_bad_durations_are_refused(seconds: float) -> None:
    hist = LatencyHistogram()
    with pytest.raises(ValueError, match="finite and non-negative"):
        hist.observe(seconds)
    assert hist.snapshot().count == 0


def test_time_observes_the_block_even_when_it_raises() -> None:
    hist = LatencyHistogram()
    with hist.time():
        pass
    with pytest.raises(RuntimeError), hist.time():
        raise RuntimeError("boom")
    snap = hist.snapshot()
    assert snap.count == 2
    assert snap.sum_s >= 0.0


def test_quantile_interpolates_like_histogram_quantile() -> None:
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 1], 2 beyond 1.
    snap = LatencySnapshot((0.1, 1.0, INF), (4, 8, 10), sum_s=12.0, count=10)
    assert snap.quantile(0.2) == pytest.approx(0.05)  # rank 2 of 4 in the first bucket
    assert snap.quantile(0.4) == pytest.approx(0.1)
    assert snap.quantile(0.6) == pytest.approx(0.1 + 0.9 * 2 / 4)
    assert snap.quantile(0.8) == pytest.approx(1.0)
    # A rank in the +Inf bucket gives the largest finite bound, as Prometheus does.
    assert snap.quantile(0.9) == 1.0
    assert snap.quantile(1.0) == 1.0
    assert snap.mean_s == 1.2


def test_quantile_zero_is_the_start_of_the_first_used_bucket() -> None:
    snap = LatencySnapshot((0.1, 1.0, INF), (0, 3, 3), sum_s=1.5, count=3)
    assert snap.quantile(0.0) == 0.1


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_quantile_outside_0_1_is_refused(q: float) -> None:
    snap = LatencySnapshot((0.1, INF), (1, 1), sum_s=0.05, count=1)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        snap.quantile(q)


@pytest.mark.parametrize(
    ("buckets", "counts", "sum_s", "count", "problem"),
    [
        ((0.1,), (1,), 0.0, 1, "end with \\+inf"),
        ((0.1, 1.0), (1, 1), 0.0, 1, "end with \\+inf"),
        ((1.0, 0.1, INF), (0, 0, 0), 0.0, 0, "strictly increasing"),
        ((0.1, INF), (1,), 0.0, 1, "1 counts for 2 buckets"),
        ((0.1, INF), (2, 1), 0.0, 1, "cumulative"),
        ((0.1, INF), (-1, 0), 0.0, 0, "cumulative"),
        ((0.1, INF), (1, 2), 0.0, 3, "count is 3"),
        ((0.1, INF), (1, 1), -1.0, 1, "sum_s"),
        ((0.1, INF), (1, 1), math.nan, 1, "sum_s"),
    ],
)
def test_inconsistent_snapshots_are_refused(
    buckets: tuple[float, ...], counts: tuple[int, ...], sum_s: float, count: int, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        LatencySnapshot(buckets, counts, sum_s, count)


def test_snapshots_are_frozen_and_do_not_move_with_the_histogram() -> None:
    hist = LatencyHistogram()
    hist.observe(0.001)
    snap = hist.snapshot()
    hist.observe(0.001)
    assert snap.count == 1
    assert hist.snapshot().count == 2
    with pytest.raises(AttributeError):
        snap.count = 5  # type: ignore[misc]


def test_threads_lose_no_observation() -> None:
    hist = LatencyHistogram()
    per_thread, threads = 5000, 8

    def work(k: int) -> None:
        for i in range(per_thread):
            hist.observe((i % 100) * 1e-4 * (k + 1))

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    snap = hist.snapshot()
    assert snap.count == per_thread * threads
    assert snap.counts[-1] == snap.count
    want_sum = sum((i % 100) * 1e-4 * (k + 1) for k in range(threads) for i in range(per_thread))
    assert snap.sum_s == pytest.approx(want_sum)


durations = st.lists(
    st.floats(min_value=0.0, max_value=5.0, allow_nan=False), min_size=1, max_size=200
)


@given(durations, st.floats(min_value=0.0, max_value=1.0))
def test_quantile_lies_in_the_bucket_of_the_true_quantile(values: list[float], q: float) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.observe(v)
    snap = hist.snapshot()
    estimate = snap.quantile(q)
    # The true value of rank ceil(q * n) (at least the first), and its bucket.
    ordered = sorted(values)
    true = ordered[max(0, math.ceil(q * len(values)) - 1)]
    finite = snap.buckets[:-1]
    if true > finite[-1]:
        assert estimate == finite[-1]
        return
    i = next(i for i, b in enumerate(finite) if true <= b)
    lower = finite[i - 1] if i > 0 else 0.0
    assert lower <= estimate <= finite[i]


@given(durations)
def test_quantile_is_monotone_in_q(values: list[float]) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.observe(v)
    snap = hist.snapshot()
    qs = [snap.quantile(q / 20) for q in range(21)]
    assert all(a <= b for a, b in itertools.pairwise(qs))
    assert sum(values) == pytest.approx(snap.sum_s)
