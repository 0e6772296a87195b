"""Sparse row optimizers against references: torch.optim per row, numpy for the rest.

Lazy semantics: a row is stepped only when it receives a gradient, so the torch
reference keeps one parameter and one optimizer per row and steps only the rows
named in each push.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import numpy.typing as npt
import pytest
import torch
from pydantic import BaseModel, TypeAdapter

from embedding_store.optim import FTRL, SGD, Adagrad, Adam, RowOptimizer, make_optimizer
from embedding_store.types import (
    AdagradConfig,
    AdamConfig,
    FTRLConfig,
    OptimizerConfig,
    SGDConfig,
)

ROWS, DIM, STEPS = 6, 5, 8

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
Push = tuple[I64, F32]


def _pushes(seed: int = 0, scale: float = 1.0, skipped: bool = True) -> list[Push]:
    """Pushes to random subsets of rows in random order, some with a skipped NaN entry."""
    rng = np.random.default_rng(seed)
    out: list[Push] = []
    for _ in range(STEPS):
        rows = rng.permutation(ROWS)[: rng.integers(1, ROWS + 1)].astype(np.int64)
        grads = (scale * rng.normal(size=(rows.shape[0], DIM))).astype(np.float32)
        if skipped and rng.random() < 0.5:
            at = int(rng.integers(0, rows.shape[0] + 1))
            rows = np.insert(rows, at, -1)
            grads = np.insert(grads, at, np.nan, axis=0)
        out.append((rows, grads))
    return out


def _initial_weights(rows: int = ROWS) -> F32:
    return np.random.default_rng(1).normal(size=(rows, DIM)).astype(np.float32)


@dataclass
class Run:
    weights: F32
    state: F32
    row_step: I64
    history: list[F32] = field(default_factory=list)


def _run(config: OptimizerConfig, pushes: Iterable[Push], init: F32 | None = None) -> Run:
    opt = make_optimizer(config)
    w = (_initial_weights() if init is None else init).copy()
    s = np.full((w.shape[0], opt.state_width(DIM)), np.nan, np.float32)
    opt.initialize(w, s, np.arange(w.shape[0], dtype=np.int64))
    run = Run(w, s, np.zeros(w.shape[0], np.int64))
    for rows, g in pushes:
        opt.apply(w, s, run.row_step, rows, g)
        run.history.append(w.copy())
    return run


def _applied_counts(pushes: Iterable[Push]) -> I64:
    counts = np.zeros(ROWS, np.int64)
    for rows, _ in pushes:
        counts[rows[rows >= 0]] += 1
    return counts


# --- against torch.optim ---------------------------------------------------------

MakeTorch = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _torch_history(make: MakeTorch, pushes: Iterable[Push]) -> list[F32]:
    init = _initial_weights()
    params = [torch.nn.Parameter(torch.tensor(init[r])) for r in range(ROWS)]
    opts = [make([p]) for p in params]
    history = []
    for rows, g in pushes:
        for k, r in enumerate(rows.tolist()):
            if r < 0:
                continue
            params[r].grad = torch.tensor(g[k])
            opts[r].step()
        history.append(np.stack([p.detach().numpy() for p in params]))
    return history


# Cases ending in "-small-grads" push gradients scaled by 1e-3, so eps is not
# negligible next to the root of the accumulator and where it is added matters.
TORCH_CASES: dict[str, tuple[OptimizerConfig, MakeTorch]] = {
    "sgd": (SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1, foreach=False)),
    "sgd-weight-decay": (
        SGDConfig(lr=0.1, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05, foreach=False),
    ),
    "sgd-momentum": (
        SGDConfig(lr=0.05, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    ),
    "sgd-momentum-dampening": (
        SGDConfig(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
        lambda p: torch.optim.SGD(
            p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, foreach=False
        ),
    ),
    "sgd-nesterov": (
        SGDConfig(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
        lambda p: torch.optim.SGD(
            p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02, foreach=False
        ),
    ),
    "adagrad": (AdagradConfig(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=False)),
    "adagrad-all-options": (
        AdagradConfig(
            lr=0.2, lr_decay=0.1, weight_decay=0.05, initial_accumulator_value=0.3, eps=1e-6
        ),
        lambda p: torch.optim.Adagrad(
            p,
            lr=0.2,
            lr_decay=0.1,
            weight_decay=0.05,
            initial_accumulator_value=0.3,
            eps=1e-6,
            foreach=False,
        ),
    ),
    "adagrad-eps-small-grads": (
        AdagradConfig(lr=0.1, eps=1e-3),
        lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-3, foreach=False),
    ),
    "adam": (AdamConfig(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01, foreach=False)),
    "adam-all-options": (
        AdamConfig(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(
            p, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False
        ),
    ),
    "adam-eps-small-grads": (
        AdamConfig(lr=0.01, eps=1e-3),
        lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-3, foreach=False),
    ),
    "adamw": (
        AdamConfig(lr=0.02, beta1=0.85, beta2=0.995, weight_decay=0.1, decoupled_weight_decay=True),
        lambda p: torch.optim.AdamW(
            p, lr=0.02, betas=(0.85, 0.995), weight_decay=0.1, foreach=False
        ),
    ),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_matches_torch_optim_per_row(case: str) -> None:
    config, make = TORCH_CASES[case]
    pushes = _pushes(scale=1e-3 if case.endswith("-small-grads") else 1.0)
    ours = _run(config, pushes)
    theirs = _torch_history(make, pushes)
    for step, (a, b) in enumerate(zip(ours.history, theirs, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"after push {step}")
    np.testing.assert_array_equal(ours.row_step, _applied_counts(pushes))


# --- against numpy references ----------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        AdagradConfig(lr=0.3, rowwise=True),
        AdagradConfig(
            lr=0.3,
            rowwise=True,
            weight_decay=0.02,
            initial_accumulator_value=0.1,
            lr_decay=0.2,
            eps=1e-3,
        ),
    ],
)
def test_rowwise_adagrad_matches_numpy_reference(config: AdagradConfig) -> None:
    pushes = _pushes(3)
    ours = _run(config, pushes)
    w = _initial_weights().astype(np.float64)
    acc = np.full(ROWS, config.initial_accumulator_value)
    step = np.zeros(ROWS)
    for (rows, g), got in zip(pushes, ours.history, strict=True):
        for k, r in enumerate(rows):
            if r < 0:
                continue
            step[r] += 1
            clr = config.lr / (1 + (step[r] - 1) * config.lr_decay)
            gw = g[k] + config.weight_decay * w[r]
            acc[r] += np.mean(gw * gw)
            w[r] -= clr * gw / (np.sqrt(acc[r]) + config.eps)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.state[:, 0], acc, rtol=1e-5)


def _ftrl_closed_form(z: Any, n: Any, c: FTRLConfig) -> Any:
    return np.where(
        np.abs(z) <= c.l1,
        0.0,
        -(z - np.sign(z) * c.l1) / ((c.beta + np.sqrt(n)) / c.alpha + c.l2),
    )


@pytest.mark.parametrize(
    "config",
    [
        FTRLConfig(),
        FTRLConfig(alpha=0.1, beta=0.5, l2=0.01, initial_accumulator_value=0.2),
        FTRLConfig(alpha=0.1, beta=0.5, l1=0.05, l2=0.01, initial_accumulator_value=0.2),
    ],
)
def test_ftrl_matches_numpy_reference(config: FTRLConfig) -> None:
    """Algorithm 1 of McMahan et al. (2013) per coordinate, weights computed lazily from z, n."""
    pushes = _pushes(4)
    ours = _run(config, pushes)
    init = _initial_weights().astype(np.float64)
    n = np.full((ROWS, DIM), config.initial_accumulator_value)
    z = -init * ((config.beta + np.sqrt(n)) / config.alpha + config.l2)
    updated = np.zeros(ROWS, bool)

    def weights() -> Any:
        return np.where(updated[:, None], _ftrl_closed_form(z, n, config), init)

    for (rows, g), got in zip(pushes, ours.history, strict=True):
        for k, r in enumerate(rows):
            if r < 0:
                continue
            w = weights()[r]
            sigma = (np.sqrt(n[r] + g[k] ** 2) - np.sqrt(n[r])) / config.alpha
            z[r] += g[k] - sigma * w
            n[r] += g[k] ** 2
            updated[r] = True
        np.testing.assert_allclose(got, weights(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.state[:, :DIM], z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.state[:, DIM:], n, rtol=1e-5)


def test_ftrl_fresh_rows_keep_their_initial_weights() -> None:
    config = FTRLConfig(alpha=0.2, beta=0.5, l2=0.3, initial_accumulator_value=0.4)
    init = _initial_weights()
    fresh = _run(config, [], init=init)
    np.testing.assert_array_equal(fresh.weights, init)
    np.testing.assert_allclose(
        _ftrl_closed_form(fresh.state[:, :DIM], fresh.state[:, DIM:], config), init, rtol=1e-6
    )
    zero_grads = [(np.arange(ROWS, dtype=np.int64), np.zeros((ROWS, DIM), np.float32))]
    np.testing.assert_allclose(_run(config, zero_grads, init=init).weights, init, rtol=1e-6)


def test_ftrl_l1_gives_exact_zeros() -> None:
    init = np.zeros((ROWS, DIM), np.float32)
    pushes = _pushes(6, skipped=False)
    touched = _applied_counts(pushes) > 0
    assert touched.sum() >= 2

    dense = _run(FTRLConfig(), pushes, init=init).weights[touched]
    assert np.count_nonzero(dense) == dense.size

    sparse = _run(FTRLConfig(l1=100.0), pushes, init=init)
    assert np.all(sparse.weights == 0.0)
    assert np.count_nonzero(sparse.state[touched, :DIM]) > 0

    some = _run(FTRLConfig(l1=1.5), pushes, init=init).weights[touched]
    zeros = np.count_nonzero(some == 0.0)
    assert 0 < zeros < some.size
    assert np.all(np.abs(some[some != 0.0]) > 1e-6)


# --- sparse semantics ------------------------------------------------------------

ALL_KINDS: dict[str, OptimizerConfig] = {
    "sgd": SGDConfig(),
    "sgd-momentum": SGDConfig(momentum=0.9),
    "adagrad": AdagradConfig(initial_accumulator_value=0.1),
    "adagrad-rowwise": AdagradConfig(rowwise=True, initial_accumulator_value=0.1),
    "adam": AdamConfig(),
    "adamw": AdamConfig(weight_decay=0.1, decoupled_weight_decay=True),
    "ftrl": FTRLConfig(l1=0.01, initial_accumulator_value=0.1),
}


def _bits(a: F32) -> npt.NDArray[np.uint32]:
    return a.view(np.uint32)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_skipped_and_unnamed_rows_are_untouched(kind: str) -> None:
    opt = make_optimizer(ALL_KINDS[kind])
    n_rows = 8
    rng = np.random.default_rng(0)
    w = rng.normal(size=(n_rows, DIM)).astype(np.float32)
    s = np.zeros((n_rows, opt.state_width(DIM)), np.float32)
    opt.initialize(w, s, np.arange(n_rows, dtype=np.int64))
    s += rng.uniform(0.0, 1.0, size=s.shape).astype(np.float32)
    steps = np.arange(n_rows, dtype=np.int64) * 3
    w0, s0, steps0 = w.copy(), s.copy(), steps.copy()

    rows = np.array([5, -1, 2, 0, -1], np.int64)
    grads = rng.normal(size=(rows.shape[0], DIM)).astype(np.float32)
    grads[rows < 0] = np.nan
    opt.apply(w, s, steps, rows, grads)

    named = [0, 2, 5]
    others = [1, 3, 4, 6, 7]
    np.testing.assert_array_equal(_bits(w[others]), _bits(w0[others]))
    np.testing.assert_array_equal(_bits(s[others]), _bits(s0[others]))
    assert np.all(np.isfinite(w))
    assert np.all(np.isfinite(s))
    assert all(not np.array_equal(w[r], w0[r]) for r in named)
    np.testing.assert_array_equal(steps - steps0, [1, 0, 1, 0, 0, 1, 0, 0])

    opt.apply(w, s, steps, rows[[0]], grads[[0]])
    np.testing.assert_array_equal(steps - steps0, [1, 0, 1, 0, 0, 2, 0, 0])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_initialize_sets_only_the_rows_named(kind: str) -> None:
    opt = make_optimizer(ALL_KINDS[kind])
    w = _initial_weights()
    s = np.full((ROWS, opt.state_width(DIM)), 7.0, np.float32)
    opt.initialize(w, s, np.array([1, -1, 3], np.int64))
    untouched = [0, 2, 4, 5]
    np.testing.assert_array_equal(s[untouched], 7.0)
    np.testing.assert_array_equal(w, _initial_weights())
    if s.shape[1]:
        assert not np.any(s[[1, 3]] == 7.0)


def test_make_optimizer_dispatches_on_kind() -> None:
    cases: list[tuple[dict[str, Any], type, int]] = [
        ({"kind": "sgd"}, SGD, 0),
        ({"kind": "sgd", "momentum": 0.5}, SGD, DIM),
        ({"kind": "adagrad"}, Adagrad, DIM),
        ({"kind": "adagrad", "rowwise": True}, Adagrad, 1),
        ({"kind": "adam"}, Adam, 2 * DIM),
        ({"kind": "ftrl"}, FTRL, 2 * DIM),
    ]
    for raw, cls, width in cases:
        config = TypeAdapter(OptimizerConfig).validate_python(raw)
        opt: RowOptimizer = make_optimizer(config)
        assert isinstance(opt, cls)
        assert opt.state_width(DIM) == width


# --- every option matters --------------------------------------------------------


@dataclass(frozen=True)
class OptionCase:
    base: dict[str, Any]
    changed: dict[str, Any]
    grad_scale: float = 1.0


# A tiny gradient scale keeps the accumulators small, so that eps matters.
OPTION_CASES: dict[tuple[str, str], OptionCase] = {
    ("SGDConfig", "lr"): OptionCase({}, {"lr": 0.05}),
    ("SGDConfig", "momentum"): OptionCase({}, {"momentum": 0.9}),
    ("SGDConfig", "dampening"): OptionCase({"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.5}),
    ("SGDConfig", "nesterov"): OptionCase({"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}),
    ("SGDConfig", "weight_decay"): OptionCase({}, {"weight_decay": 0.5}),
    ("AdagradConfig", "lr"): OptionCase({}, {"lr": 0.2}),
    ("AdagradConfig", "eps"): OptionCase({}, {"eps": 1e-4}, grad_scale=1e-4),
    ("AdagradConfig", "initial_accumulator_value"): OptionCase(
        {}, {"initial_accumulator_value": 1.0}
    ),
    ("AdagradConfig", "weight_decay"): OptionCase({}, {"weight_decay": 0.5}),
    ("AdagradConfig", "lr_decay"): OptionCase({}, {"lr_decay": 0.5}),
    ("AdagradConfig", "rowwise"): OptionCase({}, {"rowwise": True}),
    ("AdamConfig", "lr"): OptionCase({}, {"lr": 0.01}),
    ("AdamConfig", "beta1"): OptionCase({}, {"beta1": 0.5}),
    ("AdamConfig", "beta2"): OptionCase({}, {"beta2": 0.9}),
    ("AdamConfig", "eps"): OptionCase({}, {"eps": 1e-4}, grad_scale=1e-4),
    ("AdamConfig", "weight_decay"): OptionCase({}, {"weight_decay": 0.5}),
    ("AdamConfig", "decoupled_weight_decay"): OptionCase(
        {"weight_decay": 0.5}, {"weight_decay": 0.5, "decoupled_weight_decay": True}
    ),
    ("FTRLConfig", "alpha"): OptionCase({}, {"alpha": 0.5}),
    ("FTRLConfig", "beta"): OptionCase({}, {"beta": 0.1}),
    ("FTRLConfig", "l1"): OptionCase({}, {"l1": 0.5}),
    ("FTRLConfig", "l2"): OptionCase({}, {"l2": 1.0}),
    ("FTRLConfig", "initial_accumulator_value"): OptionCase({}, {"initial_accumulator_value": 1.0}),
}

# Derived from the config union itself, so a new optimizer or option without a
# case above is a failing test rather than an untested setting.
CONFIG_CLASSES: tuple[type[BaseModel], ...] = get_args(get_args(OptimizerConfig)[0])
OPTIONS = [(cls, name) for cls in CONFIG_CLASSES for name in cls.model_fields if name != "kind"]


def test_option_cases_name_real_options() -> None:
    assert {SGDConfig, AdagradConfig, AdamConfig, FTRLConfig} <= set(CONFIG_CLASSES)
    known = {(cls.__name__, name) for cls, name in OPTIONS}
    assert set(OPTION_CASES) <= known, set(OPTION_CASES) - known


@pytest.mark.parametrize(("cls", "option"), OPTIONS, ids=[f"{c.__name__}.{o}" for c, o in OPTIONS])
def test_every_option_changes_behaviour(cls: type[BaseModel], option: str) -> None:
    case = OPTION_CASES.get((cls.__name__, option))
    if case is None:
        pytest.fail(f"{cls.__name__}.{option} has no case in OPTION_CASES")
    base: Any = cls(**case.base)
    changed: Any = cls(**case.changed)
    a, b = base.model_dump(), changed.model_dump()
    assert {k for k in a if a[k] != b[k]} == {option}, "a case must change only its option"

    pushes = _pushes(5, scale=case.grad_scale)
    before = _run(base, pushes).weights
    after = _run(changed, pushes).weights
    assert not np.allclose(before, after, rtol=1e-5, atol=1e-6), f"{option} had no effect"
