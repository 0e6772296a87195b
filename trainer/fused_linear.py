"""The dense network's linear layers for inference on CPU: oneDNN's matmul, with a
following ReLU done in the same pass, for batches where it beats torch's default.

torch's CPU ``linear`` calls MKL, which on AMD CPUs runs its generic AVX2 kernels
(``mkl_blas_def_sgemm_kernel_0_zen``), while oneDNN picks its kernels by the CPU's
features: it is used from :data:`MIN_ROWS` rows up, where it answers faster, and
torch's own ``linear`` below. Its sums are rounded in another order, well inside
the 1e-5 that serving, scoring and the trainer's forward are held to
(``tests/trainer/test_fused_linear.py``).

Each layer hands oneDNN its weight reordered once into oneDNN's blocked layout
(again after the weight changes in place) rather than the plain matrix, which
saves the reorder on every call with the same sums to the bit.
:class:`LinearChain` runs an MLP's layers as consecutive oneDNN calls, a last
sigmoid included, without a module call between them, because a request that
finds the caches cold pays for every call it makes. ``benchmarks/serve.py``
(its latency phase) measures a server's forward on the machine at hand.

Training keeps ``nn.Linear``: only a module that will answer without autograd
is fused (:func:`fuse_for_inference`), after its weights are loaded; its state
dict keeps its keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__ = [
    "MIN_ROWS",
    "InferenceLinear",
    "LinearChain",
    "fuse_for_inference",
    "onednn_linear_available",
]

MIN_ROWS = 16
"""Batches of fewer rows take torch's ``linear`` (oneDNN is no faster there)."""

# The batch size oneDNN's weight layout is chosen for; every batch runs on it, because
# the layout hardly depends on the size it is chosen for.
_PACK_ROWS = 64


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's fused linear (CPU builds with MKL-DNN)."""
    built = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return bool(built) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class InferenceLinear(nn.Module):
    """An ``nn.Linear``'s parameters (the same tensors, the same state-dict keys) and,
    when ``relu``, the ReLU after it.

    Without autograd, for a contiguous float32 CPU batch of at least
    :data:`MIN_ROWS` rows, the forward is oneDNN's (the ReLU fused); otherwise
    it is torch's ``linear`` (and ``relu``), exactly as the layers it replaces.

    >>> torch.manual_seed(0) and None
    >>> layer = nn.Linear(8, 4)
    >>> fused = InferenceLinear(layer, relu=True)
    >>> x = torch.randn(32, 8)
    >>> with torch.no_grad():
    ...     bool(torch.allclose(fused(x), torch.relu(layer(x)), atol=1e-6))
    True
    >>> sorted(fused.state_dict()) == sorted(layer.state_dict())
    True
    """

    def __init__(self, linear: nn.Linear, *, relu: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias: nn.Parameter | None
        self.register_parameter("bias", linear.bias)
        self.relu = relu
        self._attr = "relu" if relu else "none"
        # (the weight it was made from, that weight's version, oneDNN's layout of it, the
        # oneDNN call)
        self._packed: tuple[Tensor, int, Tensor, Callable[..., Tensor]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[no-untyped-call]
        state["_packed"] = None  # made again where it is used
        return state

    def forward(self, x: Tensor) -> Tensor:
        if _onednn_batch(x):
            _set_omp_team()
            return self.onednn(x, self._attr)
        y = functional.linear(x, self.weight, self.bias)
        return torch.relu(y) if self.relu else y

    def onednn(self, x: Tensor, attr: str) -> Tensor:
        """oneDNN's ``x @ weight.T + bias`` and then ``attr`` ("none", "relu",
        "sigmoid") in the same pass, on the weight in oneDNN's layout."""
        # The parameters from their dict, not through nn.Module's __getattr__: a call of
        # Python each, and a request that finds the caches cold pays for every call.
        params = self._parameters
        weight = params["weight"]
        packed = self._packed
        # A tensor's version counts its in-place changes (load_state_dict copies in).
        if packed is None or packed[0] is not weight or packed[1] != weight._version:
            assert weight is not None  # an nn.Linear's, always set
            with torch.no_grad():
                layout = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
            packed = self._packed = (weight, weight._version, layout, _linear_pointwise())
        out: Tensor = packed[3](x, packed[2], params["bias"], attr, [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"bias={self.bias is not None}, relu={self.relu}"
        )


def _linear_pointwise() -> Callable[..., Tensor]:
    """oneDNN's linear with a fused pointwise op, as its dispatcher's own callable where
    torch has one: the op's overload chosen once, no Python frame per call."""
    overload = torch.ops.mkldnn._linear_pointwise.default
    op: Callable[..., Tensor] = getattr(overload, "_op", overload)
    return op


def _onednn_batch(x: Tensor) -> bool:
    """Whether oneDNN runs this batch: without autograd, a contiguous float32 CPU
    matrix of at least :data:`MIN_ROWS` rows."""
    return (
        x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype == torch.float32
        and x.is_cpu
        and x.is_contiguous()
        and not torch.is_grad_enabled()
    )


def _set_omp_team() -> None:
    # oneDNN runs OpenMP teams of the calling thread's size, which in a thread that has
    # not set it is every core, not torch's setting: a server's loop thread would spin
    # a second thread on every call. torch's setter sets this thread's, and is cheap.
    torch.set_num_threads(torch.get_num_threads())


def _relu_chain(layers: Sequence[InferenceLinear]) -> bool:
    """Whether ``layers`` make a chain: each but the last with its ReLU."""
    return bool(layers) and all(x.relu for x in layers[:-1]) and not layers[-1].relu


class LinearChain:
    """An MLP of :class:`InferenceLinear` layers (each but the last with its ReLU)
    run as consecutive oneDNN calls, the last one's output through ``last``: a
    sigmoid gives probabilities from logits in the same pass. A batch oneDNN does
    not run goes through the layers' own forward (and ``torch.sigmoid``).

    >>> torch.manual_seed(0) and None
    >>> mlp = fuse_for_inference(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)))
    >>> chain = LinearChain.of(mlp)
    >>> x = torch.randn(64, 6)
    >>> with torch.no_grad():
    ...     bool(torch.allclose(chain(x, "sigmoid"), torch.sigmoid(mlp(x)), atol=1e-6))
    True
    >>> LinearChain.of(nn.Sequential(nn.Linear(6, 5), nn.GELU())) is None
    True
    """

    def __init__(self, layers: Sequence[InferenceLinear]) -> None:
        if not _relu_chain(layers):
            msg = "a chain is layers with their ReLU and a last one without"
            raise ValueError(msg)
        self.layers = tuple(layers)

    @classmethod
    def of(cls, modules: Iterable[nn.Module]) -> LinearChain | None:
        """The chain of ``modules`` (fused layers, identities between them), or None
        where they are anything else (another activation, a layer not fused)."""
        layers = [m for m in modules if type(m) is not nn.Identity]
        linear = [m for m in layers if type(m) is InferenceLinear]
        return cls(linear) if len(linear) == len(layers) and _relu_chain(linear) else None

    def __call__(self, x: Tensor, last: Literal["none", "sigmoid"] = "none") -> Tensor:
        """The chain's output for ``x``, through ``last``."""
        if not _onednn_batch(x):
            for layer in self.layers:
                x = layer(x)
            return torch.sigmoid(x) if last == "sigmoid" else x
        _set_omp_team()
        for layer in self.layers[:-1]:
            x = layer.onednn(x, "relu")
        return self.layers[-1].onednn(x, last)


def fuse_for_inference(module: nn.Module) -> nn.Module:
    """Replace, in place, each ``nn.Linear`` of ``module`` with an
    :class:`InferenceLinear` (the ``nn.ReLU`` that follows it in an
    ``nn.Sequential`` fused into it, an ``nn.Identity`` in its place); returns
    ``module``. Its parameters and state dict are unchanged. Without oneDNN it
    is left as it is.

    >>> torch.manual_seed(0) and None
    >>> mlp = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
    >>> x = torch.randn(64, 6)
    >>> with torch.no_grad():
    ...     before = mlp(x)
    ...     fused = fuse_for_inference(mlp)
    ...     after = fused(x)
    >>> [type(m).__name__ for m in fused] if onednn_linear_available() else [
    ...     "InferenceLinear", "Identity", "InferenceLinear"]
    ['InferenceLinear', 'Identity', 'InferenceLinear']
    >>> bool(torch.allclose(before, after, atol=1e-6))
    True
    """
    if not onednn_linear_available():
        return module
    for parent in list(module.modules()):
        children = list(parent.named_children())
        for i, (name, child) in enumerate(children):
            if type(child) is not nn.Linear:
                continue
            relu = (
                isinstance(parent, nn.Sequential)
                and i + 1 < len(children)
                and type(children[i + 1][1]) is nn.ReLU
            )
            setattr(parent, name, InferenceLinear(child, relu=relu))
            if relu:
                setattr(parent, children[i + 1][0], nn.Identity())
    return module
