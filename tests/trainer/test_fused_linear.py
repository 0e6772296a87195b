"""The dense network fused for inference answers as the trainer's forward does, takes
oneDNN's path where it should, and keeps the calling thread's OpenMP team at torch's
setting."""

from __future__ import annotations

import copy
import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.fused_linear import (
    MIN_ROWS,
    InferenceLinear,
    LinearChain,
    fuse_for_inference,
    onednn_linear_available,
)
from trainer.models import FFNN, DCNv2Config, DLRMConfig, FFNNConfig, build_model

CONFIGS: list[FFNNConfig | DLRMConfig | DCNv2Config] = [
    FFNNConfig(hidden=[64, 32]),
    FFNNConfig(hidden=[48, 16], activation="gelu"),
    FFNNConfig(hidden=[]),
    DLRMConfig(bottom=[16], top=[32, 8]),
    DCNv2Config(cross_layers=2, deep=[32]),
    DCNv2Config(cross_layers=2, low_rank=3, deep=[16, 8], structure="parallel"),
]

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(), reason="this torch has no oneDNN fused linear"
)


def _model(config: FFNNConfig | DLRMConfig | DCNv2Config) -> nn.Module:
    torch.manual_seed(0)
    return build_model(config, num_dense=5, field_dims=[8, 8, 8], num_tasks=2).eval()


def _ffnn(config: FFNNConfig, *, fused: bool = True) -> FFNN:
    model = _model(config)
    assert isinstance(model, FFNN)
    return fuse_for_inference(model) if fused else model  # type: ignore[return-value]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("batch", [1, MIN_ROWS - 1, MIN_ROWS, 64, 513])
def test_fused_model_answers_as_the_trainers_forward(
    config: FFNNConfig | DLRMConfig | DCNv2Config, batch: int
) -> None:
    model = _model(config)
    fused = fuse_for_inference(copy.deepcopy(model))
    gen = torch.Generator().manual_seed(batch)
    dense, joined = torch.randn(batch, 5, generator=gen), torch.randn(batch, 24, generator=gen)
    with torch.no_grad():
        want = model.forward_joined(dense, joined)  # type: ignore[operator]
        got = fused.forward_joined(dense, joined)  # type: ignore[operator]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The same parameters under the same keys: a published state dict loads either way.
    assert list(fused.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    linears = sum(type(m) is nn.Linear for m in model.modules())
    if onednn_linear_available():
        assert sum(type(m) is InferenceLinear for m in fused.modules()) == linears
        assert not any(type(m) is nn.Linear for m in fused.modules())


@needs_onednn
def test_relu_after_a_linear_is_fused_and_other_activations_stay() -> None:
    relu = _ffnn(FFNNConfig(hidden=[16, 8]))
    assert [type(m).__name__ for m in relu.mlp] == [
        "InferenceLinear", "Identity", "InferenceLinear", "Identity",
    ]  # fmt: skip
    assert all(m.relu for m in relu.mlp if isinstance(m, InferenceLinear))
    assert not relu.head.relu
    gelu = _ffnn(FFNNConfig(hidden=[16], activation="gelu"))
    assert [type(m).__name__ for m in gelu.mlp] == ["InferenceLinear", "GELU"]
    assert not gelu.mlp[0].relu


def _ops(layer: Callable[[torch.Tensor], object], x: torch.Tensor, *, grad: bool) -> list[str]:
    """The ops ``layer(x)`` ran, in order."""
    with (
        torch.set_grad_enabled(grad),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        layer(x)
    return [e.name for e in prof.events()]


@needs_onednn
def test_onednn_runs_from_min_rows_without_autograd_only() -> None:
    torch.manual_seed(0)
    layer = InferenceLinear(nn.Linear(12, 6), relu=True)
    assert "mkldnn::_linear_pointwise" in _ops(layer, torch.randn(MIN_ROWS, 12), grad=False)
    small = _ops(layer, torch.randn(MIN_ROWS - 1, 12), grad=False)
    assert "mkldnn::_linear_pointwise" not in small
    assert "aten::linear" in small
    # With autograd (a module someone trains after all) torch's own ops, which have a backward.
    x = torch.randn(64, 12, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in _ops(layer, x, grad=True)
    layer(x).sum().backward()
    assert x.grad is not None
    # Not contiguous: torch's linear too, with the same answer.
    wide = torch.randn(64, 24)[:, ::2]
    with torch.no_grad():
        torch.testing.assert_close(layer(wide), torch.relu(nn.functional.linear(
            wide, layer.weight, layer.bias)))  # fmt: skip


def _omp_max_threads() -> int:
    """This thread's OpenMP team size, from the libgomp torch runs on."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    gomp = ctypes.CDLL(str(lib) if lib.exists() else "libgomp.so.1")
    return int(gomp.omp_get_max_threads())


@needs_onednn
def test_a_fresh_thread_runs_onednn_on_torchs_thread_count() -> None:
    """A thread that never set its OpenMP team (a server's loop thread) would run oneDNN
    on every core, a second thread spinning after each call: 10 ms of CPU per paced
    batch of 64 instead of 0.4 ms."""
    torch.manual_seed(0)
    layer = InferenceLinear(nn.Linear(32, 16), relu=False)
    x = torch.randn(64, 32)
    before = torch.get_num_threads()
    seen: list[int] = []

    def score() -> None:
        with torch.no_grad():
            layer(x)
        seen.append(_omp_max_threads())

    torch.set_num_threads(1)
    try:
        thread = threading.Thread(target=score)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


@needs_onednn
def test_a_weight_changed_in_place_or_replaced_is_laid_out_again() -> None:
    """The layer keeps its weight in oneDNN's layout; a state dict loaded into it (an
    in-place copy) or a new weight must be what it answers with, not the old layout."""
    torch.manual_seed(0)
    layer = InferenceLinear(nn.Linear(12, 6), relu=True)
    x = torch.randn(64, 12)
    other = nn.Linear(12, 6)
    with torch.no_grad():
        layer(x)  # laid out once
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), torch.relu(other(x)), rtol=1e-6, atol=1e-6)
        layer.weight = nn.Parameter(torch.randn(6, 12))
        want = torch.relu(nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
    # A copy (pickled to a worker, deep-copied) answers alike, its layout made again.
    torch.testing.assert_close(copy.deepcopy(layer)(x), layer(x))


@needs_onednn
@pytest.mark.parametrize("hidden", [[64, 32], [16], []], ids=repr)
@pytest.mark.parametrize("batch", [1, MIN_ROWS - 1, MIN_ROWS, 64, 513])
def test_an_ffnns_chain_answers_as_its_forward(hidden: list[int], batch: int) -> None:
    model = _ffnn(FFNNConfig(hidden=hidden), fused=False)
    fused = _ffnn(FFNNConfig(hidden=hidden))
    chain = LinearChain.of([*fused.mlp, fused.head])
    assert chain is not None
    assert len(chain.layers) == len(hidden) + 1
    gen = torch.Generator().manual_seed(batch)
    dense, joined = torch.randn(batch, 5, generator=gen), torch.randn(batch, 24, generator=gen)
    with torch.no_grad():
        logits = model.forward_joined(dense, joined)
        x = torch.cat([dense, joined], dim=1)
        torch.testing.assert_close(chain(x), logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chain(x, "sigmoid"), torch.sigmoid(logits), rtol=1e-5, atol=1e-5)
        ops = _ops(lambda v: chain(v, "sigmoid"), x, grad=False)
    if batch >= MIN_ROWS:  # one oneDNN call per layer, the sigmoid in the last
        assert ops.count("mkldnn::_linear_pointwise") == len(hidden) + 1
        assert "aten::sigmoid" not in ops
        assert "aten::linear" not in ops
    else:
        assert "mkldnn::_linear_pointwise" not in ops
        assert "aten::sigmoid" in ops


def test_only_relu_mlps_of_fused_layers_make_a_chain() -> None:
    gelu = _ffnn(FFNNConfig(hidden=[16], activation="gelu"))
    assert LinearChain.of([*gelu.mlp, gelu.head]) is None
    plain = _ffnn(FFNNConfig(hidden=[16]), fused=False)
    assert LinearChain.of([*plain.mlp, plain.head]) is None
    with pytest.raises(ValueError, match="a last one without"):
        LinearChain([InferenceLinear(nn.Linear(4, 4), relu=True)])
