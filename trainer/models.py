"""Dense models over dense features and pooled embeddings, chosen by a config's ``kind``.

Every model maps ``forward(dense [B, D], sparse: list of [B, dim_f])`` to
logits ``[B, num_tasks]``, one column per label. ``build_model`` is
deterministic under ``torch.manual_seed``.

>>> import torch
>>> from pydantic import TypeAdapter
>>> config = TypeAdapter(ModelConfig).validate_python({"kind": "dlrm", "bottom": [16], "top": [8]})
>>> _ = torch.manual_seed(0)
>>> model = build_model(config, num_dense=3, field_dims=[4, 4], num_tasks=2)
>>> logits = model(torch.randn(5, 3), [torch.randn(5, 4), torch.randn(5, 4)])
>>> logits.shape
torch.Size([5, 2])
>>> loss_fn(logits, torch.ones(5, 2)).ndim
0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import assert_never

import torch
from torch import Tensor, nn

from connectors.spec import FeatureSpec

# The configs live with the job schema (no torch there); re-exported for callers.
from trainer.config import Activation, DCNv2Config, DLRMConfig, FFNNConfig, ModelConfig

__all__ = [
    "DLRM",
    "FFNN",
    "CrossLayer",
    "DCNv2",
    "DCNv2Config",
    "DLRMConfig",
    "FFNNConfig",
    "ModelConfig",
    "build_model",
    "field_dims",
    "loss_fn",
    "rate_logits",
]

# A label rate is clipped this far from 0 and 1 before its logit becomes an output bias:
# a first batch without a positive must not start the head at -inf.
RATE_CLIP = 1e-4


def _activation(name: Activation) -> nn.Module:
    match name:
        case "relu":
            return nn.ReLU()
        case "gelu":
            return nn.GELU()
        case "silu":
            return nn.SiLU()
        case "tanh":
            return nn.Tanh()
        case _:
            assert_never(name)


def _mlp(width_in: int, widths: Sequence[int], activation: Activation) -> nn.Sequential:
    """Linear layers of ``widths``, each followed by ``activation`` (empty: the identity)."""
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Linear(width_in, w), _activation(activation)]
        width_in = w
    return nn.Sequential(*layers)


class DenseNet(nn.Module):
    """A model's input widths, which every ``forward`` checks first, and its logit layer."""

    head: nn.Linear  # the last layer: one logit per task

    def __init__(self, num_dense: int, field_dims: Sequence[int]) -> None:
        super().__init__()
        self.num_dense = num_dense
        self.field_dims = list(field_dims)

    def set_output_bias(self, logits: Tensor) -> None:
        """Set the bias of the logit layer to ``logits`` (``[num_tasks]``), in place.

        With the weights near zero at init, a task's mean prediction starts near
        ``sigmoid(logit)``: ``rate_logits(rates)`` starts every task at its label rate.
        """
        bias = self.head.bias
        if logits.shape != bias.shape:
            msg = f"output bias of shape {tuple(bias.shape)}, got logits {tuple(logits.shape)}"
            raise ValueError(msg)
        if not bool(torch.isfinite(logits).all()):
            msg = f"output bias logits must be finite, got {logits.tolist()}"
            raise ValueError(msg)
        with torch.no_grad():
            bias.copy_(logits.to(dtype=bias.dtype, device=bias.device))

    def forward(self, dense: Tensor, sparse: Sequence[Tensor]) -> Tensor:
        """Logits ``[B, tasks]`` of dense features ``[B, D]`` and pooled fields ``[B, dim_f]``."""
        dims = [s.shape[1] for s in sparse]
        if dense.shape[1] != self.num_dense or dims != self.field_dims:
            msg = (
                f"expected {self.num_dense} dense features and sparse fields of dims "
                f"{self.field_dims}, got {dense.shape[1]} and {dims}"
            )
            raise ValueError(msg)
        joined = torch.cat(list(sparse), dim=1) if sparse else dense.new_zeros((dense.shape[0], 0))
        return self.forward_joined(dense, joined)

    def forward_joined(self, dense: Tensor, joined: Tensor) -> Tensor:
        """``forward`` with the pooled fields side by side: ``[B, sum(field_dims)]``.

        The trainer's CPU path pools every field into one such matrix
        (``trainer.joined_fields``), which spares a join and its backward.
        """
        if dense.shape[1] != self.num_dense or joined.shape[1] != sum(self.field_dims):
            msg = (
                f"expected {self.num_dense} dense features and {sum(self.field_dims)} "
                f"columns of sparse fields (dims {self.field_dims}), "
                f"got {dense.shape[1]} and {joined.shape[1]}"
            )
            raise ValueError(msg)
        return self._logits(dense, joined)

    def _logits(self, dense: Tensor, joined: Tensor) -> Tensor:
        raise NotImplementedError


class FFNN(DenseNet):
    """MLP over ``concat(dense, *sparse)`` then a linear head, one logit per task."""

    def __init__(
        self, config: FFNNConfig, num_dense: int, field_dims: Sequence[int], num_tasks: int
    ) -> None:
        super().__init__(num_dense, field_dims)
        self.mlp = _mlp(num_dense + sum(field_dims), config.hidden, config.activation)
        width = config.hidden[-1] if config.hidden else num_dense + sum(field_dims)
        self.head = nn.Linear(width, num_tasks)

    def _logits(self, dense: Tensor, joined: Tensor) -> Tensor:
        x: Tensor = self.mlp(torch.cat([dense, joined], dim=1))
        out: Tensor = self.head(x)
        return out


class DLRM(DenseNet):
    """Dot interaction of [bottom_mlp(dense), *sparse] (upper triangle), then the top MLP.

    Without dense features there is no bottom MLP and only the sparse fields
    interact.
    """

    pair_i: Tensor
    pair_j: Tensor

    def __init__(
        self, config: DLRMConfig, num_dense: int, field_dims: Sequence[int], num_tasks: int
    ) -> None:
        super().__init__(num_dense, field_dims)
        dim = field_dims[0]
        self.bottom: nn.Module | None = (
            _mlp(num_dense, [*config.bottom, dim], "relu") if num_dense else None
        )
        n = len(field_dims) + (1 if num_dense else 0)
        pairs = torch.triu_indices(n, n, offset=1)
        # A buffer so that the indices follow the model to its device.
        self.register_buffer("pair_i", pairs[0], persistent=False)
        self.register_buffer("pair_j", pairs[1], persistent=False)
        width_in = n * (n - 1) // 2 + (dim if num_dense else 0)
        self.top = _mlp(width_in, config.top, "relu")
        self.head = nn.Linear(config.top[-1] if config.top else width_in, num_tasks)

    def _logits(self, dense: Tensor, joined: Tensor) -> Tensor:
        stacked = joined.view(joined.shape[0], len(self.field_dims), self.field_dims[0])
        parts: list[Tensor] = []
        if self.bottom is not None:
            bottom_out: Tensor = self.bottom(dense)
            stacked = torch.cat([bottom_out.unsqueeze(1), stacked], dim=1)
            parts.append(bottom_out)
        # stacked: [B, n, dim]
        gram = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, n, n]
        parts.append(gram[:, self.pair_i, self.pair_j])
        x: Tensor = self.top(torch.cat(parts, dim=1))
        out: Tensor = self.head(x)
        return out


class CrossLayer(nn.Module):
    """``x0 * (W x + b) + x``, with ``W = U V^T`` when ``rank`` is set."""

    def __init__(self, width: int, rank: int | None) -> None:
        super().__init__()
        self.project: nn.Module = (
            nn.Linear(width, width)
            if rank is None
            else nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
        )

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        projected: Tensor = self.project(x)
        return x0 * projected + x


class DCNv2(DenseNet):
    """Cross network and deep MLP over ``concat(dense, *sparse)``, stacked or in parallel."""

    def __init__(
        self, config: DCNv2Config, num_dense: int, field_dims: Sequence[int], num_tasks: int
    ) -> None:
        super().__init__(num_dense, field_dims)
        self.parallel = config.structure == "parallel"
        width = num_dense + sum(field_dims)
        self.cross = nn.ModuleList(
            CrossLayer(width, config.low_rank) for _ in range(config.cross_layers)
        )
        self.deep = _mlp(width, config.deep, "relu")
        deep_out = config.deep[-1] if config.deep else width
        self.head = nn.Linear(deep_out + width if self.parallel else deep_out, num_tasks)

    def _logits(self, dense: Tensor, joined: Tensor) -> Tensor:
        x0 = torch.cat([dense, joined], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        if self.parallel:
            deep: Tensor = self.deep(x0)
            x = torch.cat([x, deep], dim=1)
        else:
            x = self.deep(x)
        out: Tensor = self.head(x)
        return out


def build_model(
    config: FFNNConfig | DLRMConfig | DCNv2Config,
    *,
    num_dense: int,
    field_dims: Sequence[int],
    num_tasks: int,
    field_names: Sequence[str] | None = None,
) -> FFNN | DLRM | DCNv2:
    """The dense model ``config`` describes, for these input widths and ``num_tasks`` logits.

    ``field_names`` (one per entry of ``field_dims``) only make error messages
    name the offending sparse fields.

    >>> build_model(DLRMConfig(bottom=[8], top=[8]), num_dense=2, field_dims=[4, 8],
    ...             num_tasks=1, field_names=["user", "item"])
    Traceback (most recent call last):
    ...
    ValueError: dlrm: the dot interaction needs every sparse field to have one dim, got user=4, item=8: give their tables the same dim or use kind ffnn or dcn_v2
    """  # noqa: E501
    names = (
        list(field_names)
        if field_names is not None
        else [f"field{i}" for i in range(len(field_dims))]
    )
    if len(names) != len(field_dims):
        msg = f"{len(names)} field names for {len(field_dims)} field dims"
        raise ValueError(msg)
    if num_dense < 0 or num_tasks < 1 or any(d < 1 for d in field_dims):
        msg = (
            f"need num_dense >= 0, num_tasks >= 1 and field dims >= 1, got num_dense={num_dense}, "
            f"num_tasks={num_tasks}, field_dims={list(field_dims)}"
        )
        raise ValueError(msg)
    if num_dense + len(field_dims) == 0:
        msg = "the model has no input: the feature spec names no dense and no sparse field"
        raise ValueError(msg)
    match config:
        case FFNNConfig():
            return FFNN(config, num_dense, field_dims, num_tasks)
        case DLRMConfig():
            if len(set(field_dims)) > 1:
                listed = ", ".join(f"{n}={d}" for n, d in zip(names, field_dims, strict=True))
                msg = (
                    f"dlrm: the dot interaction needs every sparse field to have one dim, "
                    f"got {listed}: give their tables the same dim or use kind ffnn or dcn_v2"
                )
                raise ValueError(msg)
            if not field_dims:
                msg = "dlrm: needs at least one sparse field (the embedding dim comes from them)"
                raise ValueError(msg)
            return DLRM(config, num_dense, field_dims, num_tasks)
        case DCNv2Config():
            return DCNv2(config, num_dense, field_dims, num_tasks)
        case _:
            assert_never(config)


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Binary cross-entropy with logits, the mean over samples and tasks.

    >>> round(loss_fn(torch.zeros(2, 3), torch.ones(2, 3)).item(), 4)  # log 2
    0.6931
    """
    if logits.shape != labels.shape:
        msg = f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ in shape"
        raise ValueError(msg)
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def rate_logits(rates: Sequence[float] | Tensor) -> Tensor:
    """``logit(rate)`` of each label rate, the rate clipped to ``[RATE_CLIP, 1 - RATE_CLIP]``.

    >>> rate_logits([0.5, 0.0, 0.005]).tolist()  # doctest: +ELLIPSIS
    [0.0, -9.21..., -5.29...]
    """
    p = torch.as_tensor(rates, dtype=torch.float64).clamp(RATE_CLIP, 1.0 - RATE_CLIP)
    return torch.log(p) - torch.log1p(-p)


def field_dims(spec: FeatureSpec, dims: Mapping[str, int]) -> list[int]:
    """The dim of each sparse field (``spec.sparse`` order), from table name -> dim.

    ``dims`` may be ``StoreClient.dims`` or ``{name: cfg.dim for ...}``.

    >>> spec = FeatureSpec.model_validate({"labels": ["y"], "sparse": [
    ...     {"name": "u", "table": "users"}, {"name": "v", "table": "users"}]})
    >>> field_dims(spec, {"users": 8})
    [8, 8]
    """
    out: list[int] = []
    for s in spec.sparse:
        if s.table not in dims:
            msg = f"sparse field {s.name!r} feeds table {s.table!r}, which is not configured"
            raise KeyError(msg)
        out.append(dims[s.table])
    return out
