"""Sparse optimizers against references: torch.optim per row, numpy for the rest.

Lazy semantics: a row is stepped only when it receives a gradient, so the torch
reference keeps one parameter and one optimizer per row and steps only those
named in each push.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from embedding_store.optim import make_optimizer
from embedding_store.types import AdagradConfig, AdamConfig, FTRLConfig, SGDConfig

ROWS, DIM, STEPS = 6, 5, 8


def _pushes(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        rows = np.sort(rng.choice(ROWS, size=rng.integers(1, ROWS + 1), replace=False))
        out.append(
            (rows.astype(np.int64), rng.normal(size=(rows.shape[0], DIM)).astype(np.float32))
        )
    return out


def _run(config: Any, pushes: list[tuple[np.ndarray, np.ndarray]], init: np.ndarray | None = None):
    opt = make_optimizer(config)
    w = (init if init is not None else np.random.default_rng(1).normal(size=(ROWS, DIM))).astype(
        np.float32
    )
    s = np.zeros((ROWS, opt.state_width(DIM)), np.float32)
    opt.initialize(w, s, np.arange(ROWS))
    steps = np.zeros(ROWS, np.int64)
    history = []
    for rows, g in pushes:
        opt.apply(w, s, steps, rows, g)
        history.append(w.copy())
    return w, s, steps, history


def _torch_reference(make: Any, pushes: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    init = np.random.default_rng(1).normal(size=(ROWS, DIM)).astype(np.float32)
    params = [torch.nn.Parameter(torch.tensor(init[r])) for r in range(ROWS)]
    opts = [make([p]) for p in params]
    history = []
    for rows, g in pushes:
        for k, r in enumerate(rows):
            params[r].grad = torch.tensor(g[k])
            opts[r].step()
        history.append(np.stack([p.detach().numpy() for p in params]))
    return history


TORCH_CASES = [
    (SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (
        SGDConfig(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
    ),
    (
        SGDConfig(lr=0.05, momentum=0.8, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    ),
    (AdagradConfig(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    (
        AdagradConfig(
            lr=0.2, lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.3, eps=1e-6
        ),
        lambda p: torch.optim.Adagrad(
            p, lr=0.2, lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.3, eps=1e-6
        ),
    ),
    (AdamConfig(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (
        AdamConfig(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    (
        AdamConfig(lr=0.02, weight_decay=0.1, decoupled_weight_decay=True),
        lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1),
    ),
]


@pytest.mark.parametrize(("config", "make"), TORCH_CASES, ids=lambda c: getattr(c, "kind", ""))
def test_matches_torch_optim_per_row(config: Any, make: Any) -> None:
    pushes = _pushes()
    _, _, steps, ours = _run(config, pushes)
    theirs = _torch_reference(make, pushes)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"after push {step}")
    expected_steps = np.zeros(ROWS, np.int64)
    for rows, _ in pushes:
        expected_steps[rows] += 1
    np.testing.assert_array_equal(steps, expected_steps)


def test_rowwise_adagrad_matches_numpy_reference() -> None:
    cfg = AdagradConfig(lr=0.3, rowwise=True, weight_decay=0.02, initial_accumulator_value=0.1)
    pushes = _pushes(3)
    ours = _run(cfg, pushes)[3]
    w = np.random.default_rng(1).normal(size=(ROWS, DIM)).astype(np.float64)
    acc = np.full(ROWS, 0.1)
    for (rows, g), got in zip(pushes, ours, strict=True):
        for k, r in enumerate(rows):
            gg = g[k] + 0.02 * w[r]
            acc[r] += np.mean(gg * gg)
            w[r] -= 0.3 * gg / (np.sqrt(acc[r]) + cfg.eps)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_ftrl_matches_numpy_reference() -> None:
    cfg = FTRLConfig(alpha=0.1, beta=0.5, l1=0.05, l2=0.01, initial_accumulator_value=0.2)
    pushes = _pushes(4)
    ours = _run(cfg, pushes)[3]
    w = np.random.default_rng(1).normal(size=(ROWS, DIM))
    n = np.full((ROWS, DIM), 0.2)
    z = -w * ((0.5 + np.sqrt(n)) / 0.1 + 0.01)
    for (rows, g), got in zip(pushes, ours, strict=True):
        for k, r in enumerate(rows):
            sigma = (np.sqrt(n[r] + g[k] ** 2) - np.sqrt(n[r])) / 0.1
            z[r] += g[k] - sigma * w[r]
            n[r] += g[k] ** 2
            w[r] = np.where(
                np.abs(z[r]) <= 0.05,
                0.0,
                -(z[r] - np.sign(z[r]) * 0.05) / ((0.5 + np.sqrt(n[r])) / 0.1 + 0.01),
            )
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


def test_ftrl_new_rows_keep_their_initial_value_and_l1_gives_exact_zeros() -> None:
    init = np.random.default_rng(1).normal(scale=0.01, size=(ROWS, DIM)).astype(np.float32)
    w, _, _, _ = _run(FTRLConfig(), [], init=init.copy())
    np.testing.assert_allclose(w, init, rtol=1e-6)
    w, _, _, _ = _run(FTRLConfig(l1=5.0), _pushes(), init=init.copy())
    touched = np.unique(np.concatenate([r for r, _ in _pushes()]))
    assert np.count_nonzero(w[touched]) == 0


@pytest.mark.parametrize(
    "config",
    [
        SGDConfig(momentum=0.9),
        AdagradConfig(),
        AdagradConfig(rowwise=True),
        AdamConfig(),
        FTRLConfig(),
    ],
    ids=lambda c: c.kind,
)
def test_skipped_and_unnamed_rows_are_untouched(config: Any) -> None:
    opt = make_optimizer(config)
    w = np.random.default_rng(0).normal(size=(4, DIM)).astype(np.float32)
    s = np.zeros((4, opt.state_width(DIM)), np.float32)
    opt.initialize(w, s, np.arange(4))
    w0, s0 = w.copy(), s.copy()
    steps = np.zeros(4, np.int64)
    opt.apply(w, s, steps, np.array([2, -1], np.int64), np.ones((2, DIM), np.float32))
    np.testing.assert_array_equal(w[[0, 1, 3]], w0[[0, 1, 3]])
    np.testing.assert_array_equal(s[[0, 1, 3]], s0[[0, 1, 3]])
    assert not np.array_equal(w[2], w0[2])
    assert steps.tolist() == [0, 0, 1, 0]


# Every option of every optimizer must change the result: a new option without a
# case here fails the completeness check below.
CHANGED: dict[type, dict[str, Any]] = {
    SGDConfig: {
        "lr": ({}, {"lr": 0.02}),
        "momentum": ({}, {"momentum": 0.5}),
        "dampening": ({"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.5}),
        "nesterov": ({"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}),
        "weight_decay": ({}, {"weight_decay": 0.1}),
    },
    AdagradConfig: {
        "lr": ({}, {"lr": 0.02}),
        "eps": ({}, {"eps": 1.0}),
        "initial_accumulator_value": ({}, {"initial_accumulator_value": 1.0}),
        "weight_decay": ({}, {"weight_decay": 0.1}),
        "lr_decay": ({}, {"lr_decay": 0.5}),
        "rowwise": ({}, {"rowwise": True}),
    },
    AdamConfig: {
        "lr": ({}, {"lr": 0.01}),
        "beta1": ({}, {"beta1": 0.5}),
        "beta2": ({}, {"beta2": 0.9}),
        "eps": ({}, {"eps": 1.0}),
        "weight_decay": ({}, {"weight_decay": 0.1}),
        "decoupled_weight_decay": (
            {"weight_decay": 0.1},
            {"weight_decay": 0.1, "decoupled_weight_decay": True},
        ),
    },
    FTRLConfig: {
        "alpha": ({}, {"alpha": 0.5}),
        "beta": ({}, {"beta": 0.1}),
        "l1": ({}, {"l1": 0.5}),
        "l2": ({}, {"l2": 1.0}),
        "initial_accumulator_value": ({}, {"initial_accumulator_value": 1.0}),
    },
}


def test_every_option_has_a_behaviour_case() -> None:
    for cls, cases in CHANGED.items():
        options = set(cls.model_fields) - {"kind"}
        assert options == set(cases), (
            f"{cls.__name__}: options without a case {options - set(cases)}"
        )


@pytest.mark.parametrize(
    ("cls", "option"), [(cls, opt) for cls, cases in CHANGED.items() for opt in cases]
)
def test_every_option_changes_behaviour(cls: type, option: str) -> None:
    base, changed = CHANGED[cls][option]
    pushes = _pushes(5)
    a = _run(cls(**base), pushes)[0]
    b = _run(cls(**changed), pushes)[0]
    assert not np.allclose(a, b, rtol=1e-6, atol=1e-7), f"{cls.__name__}.{option} had no effect"
