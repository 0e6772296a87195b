"""The dense network of one rank and its optimizer, built from the job's trainer config."""

from __future__ import annotations

from typing import Any

import torch

from connectors.spec import FeatureSpec
from trainer.config import DenseOptimizerConfig, LabelPrior, TrainerConfig
from trainer.models import build_model, field_dims, rate_logits


def build_optimizer(model: torch.nn.Module, cfg: DenseOptimizerConfig) -> torch.optim.Optimizer:
    """The dense optimizer named by ``cfg``.

    >>> opt = build_optimizer(torch.nn.Linear(2, 1), DenseOptimizerConfig(kind="sgd", lr=0.1))
    >>> type(opt).__name__, opt.defaults["lr"]
    ('SGD', 0.1)
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.kind == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.kind == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.kind == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def configured_rates(prior: LabelPrior, labels: list[str]) -> list[float] | None:
    """The label rates a configured ``label_prior`` gives, one per label; None when the
    prior is ``None`` or ``"first_batch"`` (the loop measures that one).

    >>> configured_rates(0.01, ["click", "buy"]), configured_rates({"y": 0.2}, ["y"])
    ([0.01, 0.01], [0.2])
    >>> configured_rates({"click": 0.1}, ["click", "buy"])
    Traceback (most recent call last):
    ...
    ValueError: trainer.label_prior names no rate for label(s) ['buy'] and one for no label []
    """
    if prior is None or prior == "first_batch":
        return None
    if isinstance(prior, dict):
        missing = [name for name in labels if name not in prior]
        unknown = sorted(set(prior) - set(labels))
        if missing or unknown:
            msg = (
                f"trainer.label_prior names no rate for label(s) {missing} and one for no "
                f"label {unknown}"
            )
            raise ValueError(msg)
        return [prior[name] for name in labels]
    return [float(prior)] * len(labels)


class DenseModel:
    """The dense network of one rank and its optimizer, built from the job.

    A ``label_prior`` given as rates sets the output biases here, the same on every
    rank; ``"first_batch"`` is left to the loop, which sees the first batch.
    """

    def __init__(
        self, config: TrainerConfig, spec: FeatureSpec, dims: dict[str, int], device: torch.device
    ) -> None:
        torch.manual_seed(config.seed)  # every rank starts from the same weights
        self.module = build_model(
            config.model,
            num_dense=len(spec.dense),
            field_dims=field_dims(spec, dims),
            num_tasks=len(spec.labels),
            field_names=[f.name for f in spec.sparse],  # errors name the fields
        ).to(device)
        rates = configured_rates(config.label_prior, list(spec.labels))
        if rates is not None:
            self.module.set_output_bias(rate_logits(rates))
        self.optimizer = build_optimizer(self.module, config.optimizer)

    def state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
