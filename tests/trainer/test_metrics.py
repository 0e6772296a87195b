"""Progressive validation metrics against brute-force definitions.

AUC is checked against the probability that a random positive outscores a
random negative, counted over every pair (ties count one half); the sliding
window against the same figures computed on the last ``window`` samples kept
in a plain list.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.metrics import MetricsSnapshot, ProgressiveMetrics, auc, logloss

F64 = npt.NDArray[np.float64]


def pairwise_auc(labels: F64, scores: F64) -> float:
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def brute_logloss(labels: F64, probs: F64) -> float:
    eps = 1e-7
    total = 0.0
    for y, prob in zip(labels.tolist(), probs.tolist(), strict=True):
        p = min(max(prob, eps), 1 - eps)
        total -= y * math.log(p) + (1 - y) * math.log(1 - p)
    return total / len(labels)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 80),
    levels=st.sampled_from([2, 3, 10, 1000]),  # few levels: many tied scores
    seed=st.integers(0, 2**32 - 1),
)
def test_auc_matches_pairwise_count_with_ties(n: int, levels: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).astype(np.float64)
    labels[0], labels[1] = 0.0, 1.0  # both classes
    scores = rng.integers(0, levels, n) / levels
    assert auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)


def test_auc_known_values_and_errors() -> None:
    assert auc([0, 1], [0.1, 0.9]) == 1.0
    assert auc([1, 0], [0.1, 0.9]) == 0.0
    assert auc([0, 1, 0, 1], [0.3, 0.3, 0.3, 0.3]) == 0.5
    assert auc([0, 0, 1], [0.2, 0.5, 0.5]) == 0.75  # one win, one tie
    with pytest.raises(ValueError, match="both classes"):
        auc([0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        auc([0, 1], [0.1])
    with pytest.raises(ValueError, match="0 or 1"):
        auc([0, 0.5], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite"):
        auc([0, 1], [0.1, np.nan])


def test_auc_of_a_million_tied_scores_matches_a_histogram_count() -> None:
    rng = np.random.default_rng(0)
    n = 1_000_000
    labels = rng.integers(0, 2, n)
    scores = np.round(labels * 0.3 + rng.random(n), 3)  # informative, with many ties
    value = auc(labels, scores)
    assert 0.6 < value < 0.8
    # The same AUC from a histogram of the 1301 distinct scores (ties count one half).
    keys, inv = np.unique(scores, return_inverse=True)
    pos = np.bincount(inv, weights=labels, minlength=keys.shape[0])
    neg = np.bincount(inv, weights=1 - labels, minlength=keys.shape[0])
    below = np.cumsum(neg) - neg
    want = float((pos * (below + neg / 2)).sum() / (pos.sum() * neg.sum()))
    assert value == pytest.approx(want, rel=1e-12)


def test_logloss_matches_definition_and_clips() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 50).astype(np.float64)
    p = rng.random(50)
    p[:3] = [0.0, 1.0, 1.0]
    assert logloss(y, p) == pytest.approx(brute_logloss(y, p), rel=1e-12)
    assert logloss([1.0], [1.0]) == pytest.approx(-math.log(1 - 1e-7))
    assert logloss([1.0], [0.0]) == pytest.approx(-math.log(1e-7))
    with pytest.raises(ValueError, match="non-empty"):
        logloss([], [])


def expected(labels: F64, probs: F64, seen: int) -> MetricsSnapshot:
    def auc_or_none(y: F64, s: F64) -> float | None:
        return pairwise_auc(y, s) if 0 < y.sum() < len(y) else None

    task_auc = tuple(auc_or_none(labels[:, t], probs[:, t]) for t in range(labels.shape[1]))
    positives = labels[:, 0].mean()
    return MetricsSnapshot(
        samples=seen,
        window_samples=labels.shape[0],
        auc=task_auc[0],
        logloss=brute_logloss(labels[:, 0], probs[:, 0]),
        calibration=probs[:, 0].mean() / positives if positives > 0 else None,
        task_auc=task_auc,
    )


def assert_snapshot(got: MetricsSnapshot, want: MetricsSnapshot) -> None:
    assert (got.samples, got.window_samples) == (want.samples, want.window_samples)
    for name in ("auc", "logloss", "calibration"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:
            assert g == pytest.approx(w, rel=1e-9), name
    assert len(got.task_auc) == len(want.task_auc)
    for g, w in zip(got.task_auc, want.task_auc, strict=True):
        assert g == (None if w is None else pytest.approx(w, rel=1e-9))


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 40),
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_window_holds_the_last_samples(window: int, sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    metrics = ProgressiveMetrics(window=window)
    labels_seen: list[F64] = []
    probs_seen: list[F64] = []
    for n in sizes:
        y = rng.integers(0, 2, (n, 2)).astype(np.float64)
        p = np.round(rng.random((n, 2)), 1)  # ties
        metrics.update(y, p)
        labels_seen.append(y)
        probs_seen.append(p)
        all_y, all_p = np.concatenate(labels_seen), np.concatenate(probs_seen)
        want = expected(all_y[-window:], all_p[-window:], all_y.shape[0])
        assert_snapshot(metrics.snapshot(), want)


def test_old_samples_leave_the_window() -> None:
    metrics = ProgressiveMetrics(window=4)
    metrics.update(np.array([[1.0], [0.0]]), np.array([[0.0], [1.0]]))  # badly wrong
    assert metrics.snapshot().auc == 0.0
    metrics.update(np.array([[1.0], [0.0], [1.0], [0.0]]), np.array([[0.9], [0.1], [0.8], [0.2]]))
    snap = metrics.snapshot()
    assert (snap.samples, snap.window_samples, snap.auc) == (6, 4, 1.0)


def test_calibration_and_one_class_windows() -> None:
    metrics = ProgressiveMetrics(window=10)
    empty = metrics.snapshot()
    assert (empty.samples, empty.window_samples, empty.auc, empty.logloss) == (0, 0, None, None)
    assert empty.calibration is None
    metrics.update(np.zeros((3, 2)), np.full((3, 2), 0.2))
    snap = metrics.snapshot()
    assert snap.auc is None
    assert snap.calibration is None  # no positives: mean(pred)/mean(label) undefined
    assert snap.task_auc == (None, None)
    assert snap.logloss == pytest.approx(-math.log(0.8))
    metrics.update(np.array([[1.0, 0.0]]), np.array([[0.6, 0.5]]))
    snap = metrics.snapshot()
    assert snap.calibration == pytest.approx((0.6 + 3 * 0.2) / 4 / (1 / 4))
    assert snap.auc == 1.0
    assert snap.task_auc == (1.0, None)  # the second task still has one class


def test_update_rejects_bad_input() -> None:
    metrics = ProgressiveMetrics(window=5)
    with pytest.raises(ValueError, match=r"\[batch, tasks\]"):
        metrics.update(np.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match=r"\[batch, tasks\]"):
        metrics.update(np.zeros((3, 1)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="sigmoid"):
        metrics.update(np.zeros((1, 1)), np.array([[1.5]]))
    with pytest.raises(ValueError, match="0 or 1"):
        metrics.update(np.array([[0.3]]), np.array([[0.5]]))
    metrics.update(np.zeros((1, 1)), np.zeros((1, 1)))
    with pytest.raises(ValueError, match="2 tasks, earlier batches had 1"):
        metrics.update(np.zeros((1, 2)), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="window"):
        ProgressiveMetrics(window=0)
    assert metrics.snapshot().samples == 1  # rejected updates left no trace
