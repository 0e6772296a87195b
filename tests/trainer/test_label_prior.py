"""``trainer.label_prior``: each head's output bias starts at logit(label rate).

- Every model kind takes ``set_output_bias``: its bias becomes the logits and a
  fresh model's mean prediction is near the rate; a configured rate (one for all
  labels or one per label) is set when the ``DenseModel`` is built.
- The proof, through the real ``TrainLoop``: on a synthetic stream with
  a 0.5% click rate, the progressive logloss after the first 10% of the stream
  beats the running click rate (the rate of the labels seen before each batch)
  with ``label_prior: first_batch``, and does not without a prior.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from pydantic import ValidationError

from connectors.spec import FeatureSpec
from connectors.synthetic import SyntheticConfig, SyntheticSource
from embedding_store.client import StoreClient
from embedding_store.types import StoreConfig, TableConfig
from pipeline.prepare import prepare
from pipeline.types import PreparedBatch
from trainer.config import CheckpointConfig, DenseOptimizerConfig, TrainerConfig
from trainer.dense_model import DenseModel
from trainer.loop import TrainLoop
from trainer.metrics import ProgressiveMetrics, logloss
from trainer.models import (
    DCNv2Config,
    DLRMConfig,
    FFNNConfig,
    build_model,
    rate_logits,
)

KINDS: list[FFNNConfig | DLRMConfig | DCNv2Config] = [
    FFNNConfig(hidden=[16, 8]),
    FFNNConfig(hidden=[]),
    DLRMConfig(bottom=[8], top=[16, 4]),
    DCNv2Config(cross_layers=2, deep=[8]),
    DCNv2Config(cross_layers=1, low_rank=2, deep=[8], structure="parallel"),
]


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


# --- 1. the models ------------------------------------------------------------------------


@pytest.mark.parametrize("config", KINDS, ids=repr)
def test_every_model_kind_starts_at_the_rates_it_is_given(
    config: FFNNConfig | DLRMConfig | DCNv2Config,
) -> None:
    torch.manual_seed(0)
    model = build_model(config, num_dense=3, field_dims=[4, 4], num_tasks=2)
    rates = [0.005, 0.2]
    model.set_output_bias(rate_logits(rates))
    torch.testing.assert_close(
        model.head.bias.detach(), torch.tensor([logit(0.005), logit(0.2)]), rtol=1e-6, atol=1e-6
    )
    # Near-zero inputs: the hidden layers add little, the bias decides the prediction.
    gen = torch.Generator().manual_seed(1)
    dense = 1e-3 * torch.randn(256, 3, generator=gen)
    sparse = [1e-3 * torch.randn(256, 4, generator=gen) for _ in range(2)]
    with torch.no_grad():
        mean = torch.sigmoid(model(dense, sparse)).mean(dim=0)
    for got, want in zip(mean.tolist(), rates, strict=True):
        assert want / 2 < got < want * 2


def test_rate_logits_clip_and_set_output_bias_checks_its_input() -> None:
    torch.testing.assert_close(
        rate_logits([0.0, 1.0]), torch.tensor([logit(1e-4), logit(1 - 1e-4)], dtype=torch.float64)
    )
    model = build_model(FFNNConfig(hidden=[4]), num_dense=2, field_dims=[], num_tasks=2)
    with pytest.raises(ValueError, match="output bias of shape"):
        model.set_output_bias(torch.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        model.set_output_bias(torch.tensor([0.0, math.inf]))


SPEC = FeatureSpec.model_validate(
    {
        "labels": ["click"],
        "dense": [{"name": f"I{i}", "transform": "log1p", "min_value": 0} for i in (1, 2, 3, 4)],
        "sparse": [{"name": f"C{i}", "table": "t"} for i in range(1, 27)],
    }
)
STORE = StoreConfig(
    tables={
        "t": TableConfig(
            dim=4,
            optimizer={"kind": "adagrad", "lr": 0.05},
            initializer={"kind": "normal", "std": 0.01},
        )
    },
    row_dtype="float32",
)
EVENTS = 100_000
BATCH = 500
CTR = 0.005


def trainer_config(**kw: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "mode": "sync",
        "batch_size": BATCH,
        "model": FFNNConfig(hidden=[16]),
        "optimizer": DenseOptimizerConfig(kind="adam", lr=1e-3),
        "device": "cpu",
        "log_every_s": 3600.0,
        "checkpoint": CheckpointConfig(enabled=False),
    }
    return TrainerConfig(**{**base, **kw})


def test_a_configured_rate_is_set_when_the_dense_model_is_built() -> None:
    two = SPEC.model_copy(update={"labels": ["click", "buy"]})
    dims = {"t": 4}
    dense = DenseModel(trainer_config(label_prior=0.01), two, dims, torch.device("cpu"))
    torch.testing.assert_close(dense.module.head.bias.detach(), torch.full((2,), logit(0.01)))
    per_label = trainer_config(label_prior={"buy": 0.001, "click": 0.02})
    dense = DenseModel(per_label, two, dims, torch.device("cpu"))
    want = torch.tensor([logit(0.02), logit(0.001)])
    torch.testing.assert_close(dense.module.head.bias.detach(), want)
    with pytest.raises(ValueError, match=r"no rate for label\(s\) \['buy'\]"):
        DenseModel(trainer_config(label_prior={"click": 0.02}), two, dims, torch.device("cpu"))
    # None keeps torch's init: the same bias as a model built without the option.
    torch.manual_seed(0)
    plain = build_model(FFNNConfig(hidden=[16]), num_dense=4, field_dims=[4] * 26, num_tasks=2)
    dense = DenseModel(trainer_config(label_prior=None), two, dims, torch.device("cpu"))
    torch.testing.assert_close(dense.module.head.bias, plain.head.bias)
    for bad in (0.0, 1.0, -0.1, "first", {"click": 1.5}):
        with pytest.raises(ValidationError):
            trainer_config(label_prior=bad)


# --- 2. the proof: an imbalanced stream --------------------------------------------------


class Recorded(ProgressiveMetrics):
    """Progressive metrics that also keep every scored batch, in order."""

    def __init__(self) -> None:
        super().__init__(window=100)
        self.labels: list[npt.NDArray[np.float64]] = []
        self.probs: list[npt.NDArray[np.float64]] = []

    def update(self, labels: npt.ArrayLike, probs: npt.ArrayLike) -> None:
        super().update(labels, probs)
        self.labels.append(np.asarray(labels, dtype=np.float64)[:, 0])
        self.probs.append(np.asarray(probs, dtype=np.float64)[:, 0])


def stream() -> SyntheticSource:
    # Small vocabularies and a strong signal: 500 positives are enough to learn from.
    config = SyntheticConfig(
        seed=3, base_ctr=CTR, signal=2.0, events=EVENTS, chunk_size=BATCH, cardinalities=(30,) * 26
    )
    return SyntheticSource(config)


def batches(src: SyntheticSource, store: StoreClient) -> Iterator[PreparedBatch]:
    pos = 0
    while (chunk := src.plan("synthetic/0", pos, BATCH)) is not None:
        batch, bad = prepare(chunk, src, SPEC, None, store=store)
        assert not bad
        yield batch
        pos = chunk.end


def train(label_prior: Any) -> Recorded:
    """Every batch's labels and predictions, scored before it was learned by the real loop."""
    cfg = trainer_config(label_prior=label_prior)
    with StoreClient.connect("inproc://1", config=STORE) as store:
        loop = TrainLoop(cfg, SPEC, store, DenseModel(cfg, SPEC, store.dims, torch.device("cpu")))
        recorded = Recorded()
        loop.metrics = recorded
        stats = loop.run(batches(stream(), store))
    assert stats.samples == EVENTS
    return recorded


def running_rate(labels: list[npt.NDArray[np.float64]]) -> npt.NDArray[np.float64]:
    """Per sample, the rate of the labels of the batches before its own (0.5 before any)."""
    sizes = [len(y) for y in labels]
    seen = np.cumsum([0.0, *(float(y.sum()) for y in labels[:-1])])
    counted = np.cumsum([0, *sizes[:-1]])
    rate = np.where(counted > 0, seen / np.maximum(counted, 1), 0.5)
    return np.repeat(rate, sizes)


def test_first_batch_prior_beats_the_running_click_rate_and_no_prior_does_not() -> None:
    primed, plain = train("first_batch"), train(None)
    labels = np.concatenate(primed.labels)
    np.testing.assert_array_equal(labels, np.concatenate(plain.labels))  # the same stream
    assert abs(labels.mean() - CTR) < 0.2 * CTR
    skip = len(labels) // 10  # the first 10% of the stream
    constant = logloss(labels[skip:], running_rate(primed.labels)[skip:])
    with_prior = logloss(labels[skip:], np.concatenate(primed.probs)[skip:])
    without = logloss(labels[skip:], np.concatenate(plain.probs)[skip:])
    print(f"logloss after 10%: prior {with_prior:.5f}, none {without:.5f}, rate {constant:.5f}")
    assert with_prior < constant
    # Without the prior the model starts near 0.5 and is still far above the rate after
    # the first 10%: the prior is what makes the difference.
    assert without > constant
    assert np.concatenate(plain.probs)[skip:].mean() > 1.5 * CTR
