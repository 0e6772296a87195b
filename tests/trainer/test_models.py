"""Dense models: shapes, determinism, configs, and each architecture against its formula."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from torch import Tensor, nn

from connectors.spec import FeatureSpec
from trainer.models import (
    DLRM,
    FFNN,
    CrossLayer,
    DCNv2,
    DCNv2Config,
    DLRMConfig,
    FFNNConfig,
    ModelConfig,
    build_model,
    field_dims,
    loss_fn,
)

ADAPTER: TypeAdapter[FFNNConfig | DLRMConfig | DCNv2Config] = TypeAdapter(ModelConfig)

SMALL: list[FFNNConfig | DLRMConfig | DCNv2Config] = [
    FFNNConfig(hidden=[16, 8]),
    FFNNConfig(hidden=[]),
    DLRMConfig(bottom=[8], top=[16, 4]),
    DLRMConfig(bottom=[], top=[]),
    DCNv2Config(cross_layers=2, deep=[8]),
    DCNv2Config(cross_layers=2, low_rank=2, deep=[8, 4], structure="parallel"),
    DCNv2Config(cross_layers=0, deep=[]),
]


def inputs(
    batch: int, num_dense: int, dims: list[int], seed: int = 0
) -> tuple[Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, num_dense, generator=gen)
    sparse = [torch.randn(batch, d, generator=gen, requires_grad=True) for d in dims]
    return dense, sparse


def build(config: FFNNConfig | DLRMConfig | DCNv2Config, seed: int = 0, **kw: int) -> nn.Module:
    torch.manual_seed(seed)
    num_dense = kw.get("num_dense", 3)
    num_tasks = kw.get("num_tasks", 2)
    return build_model(config, num_dense=num_dense, field_dims=[4, 4, 4], num_tasks=num_tasks)


@pytest.mark.parametrize("config", SMALL, ids=repr)
@pytest.mark.parametrize("num_tasks", [1, 3])
def test_logits_shape_and_gradients_reach_every_input(
    config: FFNNConfig | DLRMConfig | DCNv2Config, num_tasks: int
) -> None:
    model = build(config, num_tasks=num_tasks)
    dense, sparse = inputs(5, 3, [4, 4, 4])
    logits = model(dense, sparse)
    assert logits.shape == (5, num_tasks)
    assert logits.dtype == torch.float32
    torch.autograd.backward(loss_fn(logits, torch.ones(5, num_tasks)))
    for s in sparse:
        assert s.grad is not None
        assert s.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("config", SMALL, ids=repr)
def test_deterministic_under_manual_seed(config: FFNNConfig | DLRMConfig | DCNv2Config) -> None:
    a, b, c = build(config, seed=1), build(config, seed=1), build(config, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    dense, sparse = inputs(4, 3, [4, 4, 4])
    assert torch.equal(a(dense, sparse), b(dense, sparse))


def test_configs_parse_by_kind_reject_unknown_keys_and_are_frozen() -> None:
    assert isinstance(ADAPTER.validate_python({"kind": "ffnn"}), FFNNConfig)
    assert FFNNConfig().hidden == [4096, 2048, 1024, 512, 256]
    dcn = ADAPTER.validate_python({"kind": "dcn_v2", "low_rank": 4, "structure": "parallel"})
    assert isinstance(dcn, DCNv2Config)
    assert (dcn.cross_layers, dcn.low_rank, dcn.structure) == (3, 4, "parallel")
    with pytest.raises(ValidationError, match="hiden"):
        ADAPTER.validate_python({"kind": "ffnn", "hiden": [4]})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        ADAPTER.validate_python({"kind": "wide_and_deep"})
    with pytest.raises(ValidationError, match="structure"):
        ADAPTER.validate_python({"kind": "dcn_v2", "structure": "sideways"})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ADAPTER.validate_python({"kind": "dlrm", "top": [0]})
    with pytest.raises(ValidationError, match="frozen"):
        dcn.low_rank = 2  # type: ignore[misc]


def test_ffnn_without_hidden_layers_is_a_logistic_regression() -> None:
    model = build(FFNNConfig(hidden=[]), num_tasks=1)
    dense, sparse = inputs(6, 3, [4, 4, 4])
    head = model.head
    assert isinstance(head, nn.Linear)
    want = torch.cat([dense, *sparse], 1) @ head.weight.T + head.bias
    torch.testing.assert_close(model(dense, sparse), want)


def test_ffnn_activation_changes_the_output() -> None:
    dense, sparse = inputs(6, 3, [4, 4, 4])
    outs = [build(FFNNConfig(hidden=[8], activation=a))(dense, sparse) for a in ("relu", "tanh")]
    assert not torch.allclose(outs[0], outs[1])
    relu = build(FFNNConfig(hidden=[8], activation="relu"))
    assert isinstance(relu, FFNN)
    first = relu.mlp[0]
    assert isinstance(first, nn.Linear)
    hidden = torch.relu(first(torch.cat([dense, *sparse], 1)))
    torch.testing.assert_close(relu(dense, sparse), relu.head(hidden))


@pytest.mark.parametrize("num_dense", [3, 0])
def test_dlrm_is_the_dot_interaction_of_its_formula(num_dense: int) -> None:
    model = build(DLRMConfig(bottom=[8], top=[6]), num_dense=num_dense, num_tasks=2)
    assert isinstance(model, DLRM)
    assert (model.bottom is not None) == (num_dense > 0)
    dense, sparse = inputs(5, num_dense, [4, 4, 4])
    vectors = ([model.bottom(dense)] if model.bottom is not None else []) + sparse
    pairs = [
        (vectors[i] * vectors[j]).sum(1)
        for i in range(len(vectors))
        for j in range(i + 1, len(vectors))
    ]
    assert len(pairs) == math.comb(len(vectors), 2)
    features = torch.cat(([vectors[0]] if num_dense else []) + [torch.stack(pairs, 1)], 1)
    want = model.head(model.top(features))
    torch.testing.assert_close(model(dense, sparse), want)
    if model.bottom is not None:
        assert model.bottom(dense).shape == (5, 4)  # projected to the embedding dim
        assert (model.bottom(dense) >= 0).all()  # ends in a ReLU, as in DLRM


def test_dlrm_names_fields_whose_dims_differ() -> None:
    with pytest.raises(ValueError, match=r"got user=8, item=8, tags=4"):
        build_model(
            DLRMConfig(),
            num_dense=1,
            field_dims=[8, 8, 4],
            num_tasks=1,
            field_names=["user", "item", "tags"],
        )
    with pytest.raises(ValueError, match=r"field0=8, field1=4"):
        build_model(DLRMConfig(), num_dense=1, field_dims=[8, 4], num_tasks=1)
    with pytest.raises(ValueError, match="at least one sparse field"):
        build_model(DLRMConfig(), num_dense=1, field_dims=[], num_tasks=1)


def _cross_matrix(layer: nn.Module) -> tuple[Tensor, Tensor]:
    """(W, b) of a cross layer, multiplying out U V^T when it is low-rank."""
    assert isinstance(layer, CrossLayer)
    project = layer.project
    if isinstance(project, nn.Linear):
        return project.weight, project.bias
    assert isinstance(project, nn.Sequential)
    v, u = project[0], project[1]
    assert isinstance(v, nn.Linear)
    assert isinstance(u, nn.Linear)
    return u.weight @ v.weight, u.bias


@pytest.mark.parametrize("low_rank", [None, 3])
@pytest.mark.parametrize("structure", ["stacked", "parallel"])
def test_dcn_v2_is_its_formula(
    low_rank: int | None, structure: Literal["stacked", "parallel"]
) -> None:
    config = DCNv2Config(cross_layers=3, low_rank=low_rank, deep=[8], structure=structure)
    model = build(config, num_tasks=2)
    assert isinstance(model, DCNv2)
    dense, sparse = inputs(5, 3, [4, 4, 4])
    x0 = torch.cat([dense, *sparse], 1)
    x = x0
    for layer in model.cross:
        w, b = _cross_matrix(layer)
        if low_rank is not None:
            assert torch.linalg.matrix_rank(w.detach()) <= low_rank
        x = x0 * (x @ w.T + b) + x
    deep = model.deep(x0 if structure == "parallel" else x)
    want = model.head(torch.cat([x, deep], 1) if structure == "parallel" else deep)
    torch.testing.assert_close(model(dense, sparse), want)


def test_dcn_v2_low_rank_has_fewer_parameters() -> None:
    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    full = build(DCNv2Config(cross_layers=2, deep=[]))
    low = build(DCNv2Config(cross_layers=2, low_rank=2, deep=[]))
    width = 3 + 12
    assert count(full) - count(low) == 2 * (width * width - 2 * width * 2)


def test_wrong_input_widths_and_models_without_input_are_rejected() -> None:
    model = build(FFNNConfig(hidden=[4]))
    dense, sparse = inputs(2, 3, [4, 4, 5])
    with pytest.raises(ValueError, match="dims"):
        model(dense, sparse)
    with pytest.raises(ValueError, match="no input"):
        build_model(FFNNConfig(), num_dense=0, field_dims=[], num_tasks=1)
    with pytest.raises(ValueError, match="num_tasks"):
        build_model(FFNNConfig(), num_dense=1, field_dims=[], num_tasks=0)


def test_loss_is_the_mean_bce_over_samples_and_tasks() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.0], [0.5, 3.0, -2.0]])
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    p = torch.sigmoid(logits)
    want = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean()
    torch.testing.assert_close(loss_fn(logits, labels), want)
    with pytest.raises(ValueError, match="differ in shape"):
        loss_fn(logits, labels[:, :1])


def test_field_dims_follow_spec_order() -> None:
    spec = FeatureSpec.model_validate(
        {
            "labels": ["y"],
            "sparse": [
                {"name": "u", "table": "users"},
                {"name": "i", "table": "items"},
                {"name": "v", "table": "users"},
            ],
        }
    )
    assert field_dims(spec, {"items": 4, "users": 8}) == [8, 4, 8]
    with pytest.raises(KeyError, match="'items'"):
        field_dims(spec, {"users": 8})
