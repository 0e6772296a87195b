"""The ``trainer`` section of a job: mode, staleness, the dense model and its optimizer.

``mode: sync`` means ``staleness: 0`` (a batch's lookup happens only after
the previous batch's push is applied); asking for both a sync mode and a
positive staleness is an error, not a silent override.

>>> TrainerConfig().mode, TrainerConfig().staleness, TrainerConfig().model.kind
('hybrid', 4, 'ffnn')
>>> TrainerConfig(mode="sync").staleness
0
>>> TrainerConfig(mode="sync", staleness=2)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for TrainerConfig
  Value error, mode 'sync' trains with staleness 0, got staleness=2 ...
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- dense models (built by trainer.models.build_model) ---------------------------

Activation = Literal["relu", "gelu", "silu", "tanh"]
Width = Annotated[int, Field(ge=1, le=1 << 16)]


class FFNNConfig(_Strict):
    """The Persia paper's feed-forward net over concat(dense features, pooled embeddings).

    ``hidden`` are the widths of the hidden layers (none: a logistic regression).
    """

    kind: Literal["ffnn"] = Field("ffnn", description="a feed-forward net (Persia's)")
    hidden: list[Width] = Field(
        default_factory=lambda: [4096, 2048, 1024, 512, 256],
        description="widths of the hidden layers; []: a logistic regression",
    )
    activation: Activation = Field("relu", description="after each hidden layer")


class DLRMConfig(_Strict):
    """DLRM (Naumov et al. 2019): bottom MLP, pairwise dot interaction, top MLP.

    The bottom MLP has hidden widths ``bottom`` and then projects the dense
    features to the embedding dim; the top MLP has hidden widths ``top`` and
    then one logit per task. All sparse fields must share one dim.
    """

    kind: Literal["dlrm"] = Field("dlrm", description="DLRM: MLPs around a dot interaction")
    bottom: list[Width] = Field(
        default_factory=lambda: [512, 256], description="hidden widths of the dense features' MLP"
    )
    top: list[Width] = Field(
        default_factory=lambda: [1024, 1024, 512, 256],
        description="hidden widths of the MLP over the interactions",
    )


class DCNv2Config(_Strict):
    """DCN-v2 (Wang et al. 2021): ``cross_layers`` of ``x0 * (W x_l + b) + x_l`` and a deep MLP.

    ``low_rank=r`` factors each ``W`` as ``U V^T`` with rank ``r``. ``stacked``
    feeds the cross network's output to the deep MLP; ``parallel`` runs both on
    the input and concatenates their outputs.
    """

    kind: Literal["dcn_v2"] = Field("dcn_v2", description="DCN-v2: a cross network and an MLP")
    cross_layers: int = Field(3, ge=0, le=64, description="cross layers")
    low_rank: int | None = Field(
        None, ge=1, le=1 << 16, description="rank of each cross weight; None: full"
    )
    deep: list[Width] = Field(
        default_factory=lambda: [1024, 512, 256], description="hidden widths of the deep MLP"
    )
    structure: Literal["stacked", "parallel"] = Field(
        "stacked", description="cross then deep, or both on the input side by side"
    )


ModelConfig = Annotated[FFNNConfig | DLRMConfig | DCNv2Config, Field(discriminator="kind")]

# A label's rate as a prior for its head's output bias: a probability strictly inside (0, 1).
Rate = Annotated[float, Field(gt=0.0, lt=1.0)]
LabelPrior = Literal["first_batch"] | Rate | dict[str, Rate] | None


class DenseOptimizerConfig(_Strict):
    """The optimizer of the dense network (torch.optim), the same on every rank."""

    kind: Literal["adam", "adamw", "sgd", "adagrad"] = Field(
        "adam", description="the torch.optim optimizer"
    )
    lr: float = Field(1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay (AdamW's: decoupled)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam and adamw only")
    eps: float = Field(1e-8, gt=0, description="adam, adamw and adagrad")
    momentum: float = Field(0.0, ge=0, description="sgd only")


class CheckpointConfig(_Strict):
    """When the job checkpoints: every N steps, every T seconds, and on exit."""

    dir: str | None = Field(
        None,
        description=(
            "a path or a URL (s3://bucket/prefix?endpoint_override=HOST:PORT&scheme=http, "
            "file:///...) that every trainer host reaches; None: the run directory's checkpoints/"
        ),
    )
    every_steps: int | None = Field(1000, ge=1, description="a checkpoint every N steps")
    every_s: float | None = Field(300.0, gt=0, description="a checkpoint every T seconds")
    keep: int = Field(3, ge=1, description="job manifests (and dense states) kept")
    on_exit: bool = Field(True, description="a checkpoint when the job ends")
    enabled: bool = Field(True, description="false: no checkpoints (nothing to resume from)")


class RecoveryConfig(_Strict):
    """What the job does when a store shard loses its rows (it died and was restarted),
    or a trainer rank process is killed.

    Every rank rolls back to the newest job checkpoint (store, dense state, source
    positions) and goes on, so nothing is lost and nothing learned twice; a killed
    rank is started again with the others first.
    """

    enabled: bool = Field(True, description="false: such a failure ends the job")
    timeout_s: float = Field(
        300.0, gt=0, description="how long one recovery waits for every shard to answer"
    )
    max_in_a_row: int = Field(
        5,
        ge=1,
        description=(
            "recoveries (or restarts of the trainer ranks) without a new checkpoint in "
            "between before giving up"
        ),
    )


class RunFilesConfig(_Strict):
    """How much of a rank's progress lines (``metrics-rank<R>.jsonl``) and ledger of
    learned offsets (``learned-rank<R>.log``) its run directory keeps.

    Each is rotated past ``max_mb`` (``<file>.1``, ``.2``, ...) and the oldest part
    beyond ``keep`` is deleted: on a busy job the ledger and the progress lines each
    grow by tens of MB a day. ``streamrec report`` and the ledger's audit read every part
    kept. ``max_mb: null`` never rotates (an audit of a whole long run).
    """

    max_mb: float | None = Field(64.0, gt=0, description="rotate a file past this size (MB)")
    keep: int = Field(4, ge=0, description="rotated parts kept of each file")

    @property
    def max_bytes(self) -> int | None:
        return None if self.max_mb is None else max(1, int(self.max_mb * 1e6))


class TrainerConfig(_Strict):
    """How the trainer ranks learn from the prepared batches."""

    mode: Literal["hybrid", "sync", "async"] = Field(
        "hybrid",
        description="hybrid: rows up to staleness pushes old, dense synchronous; sync: "
        "staleness 0; async: dense nets averaged every average_every steps",
    )
    staleness: int = Field(4, ge=0, description="batches a lookup may miss the pushes of")
    batch_size: int = Field(4096, ge=1, description="records per chunk, i.e. per step")
    push_queue: int = Field(
        1, ge=0, description="pushes left in flight while training on (counts in staleness)"
    )
    fresh_rows: Literal["bounded", "exact", "off"] = Field(
        "bounded",
        description=(
            "hybrid and async: each push brings back the rows it changed, and the next steps "
            "train those instead of their staler looked-up copies, whichever rank pushed "
            "them (the ranks tell each other their pushes at each step); the pushes not yet "
            "answered are predicted with the store's arithmetic for rows pushed lately. "
            "'bounded': a row no rank pushed lately misses at most those pushes (never "
            "waits); 'exact': this rank's own are waited for, so on one rank a row pushed at "
            "step t is what step t+1 trains; 'off': rows as looked up (up to staleness "
            "pushes old)"
        ),
    )
    average_every: int = Field(50, ge=1, description="async mode: steps between dense averages")
    ranks: int = Field(1, ge=1, le=256, description="trainer ranks (one process each)")
    model: ModelConfig = Field(default_factory=FFNNConfig, description="the dense network")
    optimizer: DenseOptimizerConfig = Field(
        default_factory=DenseOptimizerConfig, description="the dense network's optimizer"
    )
    seed: int = Field(0, ge=0, description="of the dense network's initial weights")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda:LOCAL_RANK when every local rank has a GPU, else the CPU",
    )
    bf16_autocast: bool = Field(
        False,
        description=(
            "the dense network's matmuls in bfloat16 (torch.autocast), on a GPU or on a CPU "
            "with bfloat16 units (AMX, AVX512-BF16): several times faster there, slower "
            "on CPUs without them; the embedding rows stay float32"
        ),
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "intra-op threads of each rank; unset: the cores left by the Dask workers and "
            "store shards this job starts on the same host, shared between its local ranks"
        ),
    )
    step_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "on a CPU, threads each step's batch is split over (in chunks they take in "
            "turn, each thread running torch's ops on one intra-op thread): the trainer "
            "keeps both cores busy where other processes pre-empt it, which torch's "
            "intra-op threads do not; unset: 2 where the job's own workers and store "
            "shards share the host's cores and leave one intra-op thread (torch_threads "
            "unset), else 1 (no split)"
        ),
    )
    metrics_window: int = Field(100_000, ge=100, description="samples in the sliding window")
    label_prior: LabelPrior = Field(
        "first_batch",
        description=(
            "the starting output bias of each label's head, logit(rate), so a fresh model "
            "predicts the label rate instead of about 0.5: 'first_batch' takes each label's "
            "rate in the first batch (summed over ranks, clipped to [1e-4, 1 - 1e-4]); a "
            "float in (0, 1) is the rate of every label; a mapping label -> rate names each "
            "label; null keeps torch's default init. Not applied to a job resumed from a "
            "checkpoint taken after step 0 (its dense state is restored)"
        ),
    )
    log_every_s: float = Field(
        2.0, gt=0, description="seconds between progress reports (metrics files, live line)"
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "how long a rank waits for the others in a collective before it gives up (a rank "
            "on a dead host); longer than the slowest checkpoint"
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="when the job checkpoints"
    )
    recovery: RecoveryConfig = Field(
        default_factory=RecoveryConfig, description="what a lost store shard does to the job"
    )
    run_files: RunFilesConfig = Field(
        default_factory=RunFilesConfig, description="rotation of the run directory's files"
    )

    @model_validator(mode="before")
    @classmethod
    def _sync_means_staleness_zero(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") == "sync":
            given = data.get("staleness", 0)
            if given != 0:
                msg = f"mode 'sync' trains with staleness 0, got staleness={given!r}"
                raise ValueError(msg)
            data = {**data, "staleness": 0, "push_queue": 0}
        return data

    @property
    def prefetch(self) -> int:
        """Batches the runner keeps in flight; with the push queue they make the staleness."""
        return max(0, self.staleness - self.effective_push_queue)

    @property
    def effective_push_queue(self) -> int:
        return min(self.push_queue, self.staleness)
