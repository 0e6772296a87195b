"""The job configuration: one schema, loaded from one YAML file.

Every section rejects unknown keys, and a validation error names the field
path and the offending value.

>>> cfg = JobConfig.model_validate({"store": {"tables": {"user": {"dim": 8}}}})
>>> cfg.store.tables["user"].dim
8
>>> JobConfig.model_validate({"store": {"tables": {"user": {"dim": 0}}}})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for JobConfig
store.tables.user.dim
  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, ...
...
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors.kafka import KafkaSourceConfig
from connectors.spec import FeatureSpec
from connectors.synthetic import SyntheticConfig
from embedding_store.follow import FOLLOW_POLL_S
from embedding_store.types import StoreConfig
from trainer.config import TrainerConfig


class ConfigError(ValueError):
    """A job YAML file that cannot be read or does not validate."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaJobSource(KafkaSourceConfig):
    """Train from Kafka topics (``streamrec run``)."""

    kind: Literal["kafka"] = Field("kafka", description="train from Kafka topics")
    codec: Literal["json", "criteo_tsv", "arrow"] = Field(
        "json", description="how a record's bytes decode: JSON lines, Criteo TSV, Arrow IPC"
    )
    deadletter: Literal["kafka", "file", "none"] = Field(
        "file",
        description="where bad records go; kafka: <topic>.deadletter; "
        "file: <run_dir>/deadletter-rank<R>.jsonl; none: counted only",
    )


class ParquetJobSource(_Strict):
    """Train over Parquet history (``streamrec backfill``)."""

    kind: Literal["parquet"] = Field("parquet", description="train over Parquet files")
    paths: list[str] = Field(min_length=1, description="files, folders or globs")
    columns: list[str] | None = Field(
        None, description="the columns to read; None: those the features name"
    )
    name: str = Field("parquet", description="the source's name in offsets and metrics")
    deadletter: Literal["file", "none"] = Field(
        "file",
        description="where bad records go; file: <run_dir>/deadletter-rank<R>.jsonl; "
        "none: counted only",
    )


class SyntheticJobSource(SyntheticConfig):
    """The synthetic Criteo-like stream with a known best AUC (``streamrec demo``)."""

    kind: Literal["synthetic"] = Field("synthetic", description="the synthetic Criteo-like stream")
    deadletter: Literal["file", "none"] = Field(
        "file",
        description="where bad records go; file: <run_dir>/deadletter-rank<R>.jsonl; "
        "none: counted only",
    )


SourceConfig = Annotated[
    KafkaJobSource | ParquetJobSource | SyntheticJobSource, Field(discriminator="kind")
]


class ClusterConfig(_Strict):
    """Where the job runs; the defaults start everything locally, on loopback."""

    scheduler: str | None = Field(
        None, description="a running Dask scheduler (tcp://host:8786); None: a local one"
    )
    workers: int = Field(2, ge=1, description="local Dask worker processes")
    threads_per_worker: int = Field(1, ge=1, description="threads of each local Dask worker")
    dashboard_address: str = Field(":8787", description="local scheduler's dashboard")
    scheduler_process: bool = Field(
        True,
        description=(
            "the local Dask scheduler in a process of its own, so its work never takes "
            "the trainer's GIL; false: in the trainer's process (LocalCluster)"
        ),
    )
    direct_to_workers: bool = Field(
        True,
        description=(
            "the trainer fetches prepared batches straight from the Dask workers; false: "
            "through the scheduler, which pickles every batch again (in-band, protocol 4)"
        ),
    )
    store: str | None = Field(None, description="grpc://host:port,... of running shards")
    store_shards: int = Field(2, ge=1, le=1024, description="local shard processes")
    token_file: Path | None = Field(
        None,
        description=(
            "the store's token; local shards: generated; named shards: this file, else "
            "$STREAMREC_STORE_TOKEN"
        ),
    )
    store_metrics: bool = Field(
        True,
        description="local store shards serve Prometheus /metrics, each on a free port",
    )
    store_latency_ms: float = Field(
        0.0, ge=0, description="benchmarking aid: ms added to every store call (trainer, workers)"
    )
    wait_for_services_s: float = Field(
        300.0,
        ge=0,
        description=(
            "how long a job waits at start for the scheduler and store shards it names "
            "(cluster.scheduler, cluster.store) to answer, showing what it waits for: in "
            "Kubernetes the trainers may start before the stores have restored; 0: fail at "
            "once. A service that answers but does not fit the job fails at once"
        ),
    )


class ServingConfig(_Strict):
    """What the job publishes for prediction servers."""

    publish_every_s: float | None = Field(
        1.0,
        gt=0,
        description="rank 0 publishes the dense weights this often (None: never)",
    )
    dir: str | None = Field(
        None,
        description="where the dense weights are published (a path or URL every server "
        "reaches); None: the checkpoint location's serving/",
    )
    keep: int = Field(3, ge=1, description="published versions kept")
    store: str | None = Field(
        None,
        description="grpc://host:port,... of the serving replicas (`streamrec store replica`), "
        "one per training shard in shard order, that `streamrec serve` reads rows from; None: "
        "cluster.store (the training shards themselves)",
    )
    model_name: str = Field("streamrec", pattern=r"^[A-Za-z0-9_.-]+$", description="in URLs")
    host: str = Field("127.0.0.1", description="the address `streamrec serve` binds")
    port: int = Field(8000, ge=0, le=65535, description="its HTTP port (0: any free one)")
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve the Open Inference Protocol over gRPC (KServe v2's "
        "GRPCInferenceService, as Triton's port 8001) on this port, through the same limits "
        "and batching (0: any free one; None: HTTP only)",
    )
    token_file: Path | None = Field(
        None, description="requests must carry `Authorization: Bearer <this file's token>`"
    )
    max_request_bytes: int = Field(16 << 20, ge=1024, description="larger requests get 413")
    max_batch_records: int = Field(
        4096,
        ge=1,
        description="requests that wait while the model runs are scored together in one call "
        "of up to this many records (dynamic batching); 1: each request alone",
    )
    max_request_records: int | None = Field(
        65536,
        ge=1,
        description="a request of more records gets 413, from its shape, before any is "
        "decoded (None: no limit but max_request_bytes)",
    )
    max_queued_records: int | None = Field(
        None,
        ge=1,
        description="records that may wait to be scored; a request that would pass it is "
        "shed with 503 and Retry-After (None: 16 x max_batch_records)",
    )
    request_timeout_s: float | None = Field(
        10.0,
        gt=0,
        description="a request not answered this long after the server read its headers gets "
        "504, checked "
        "while it waits and between the model's stages (decoding, reading rows, the forward "
        "pass); a stage's compiled kernel runs to its end once called, so a request is late "
        "by at most one stage, bounded by its size. A request's own Triton `timeout` "
        "parameter can only shorten it. None: no limit",
    )
    max_connections: int | None = Field(
        1024, ge=1, description="connections past this are answered 503 and closed"
    )
    idle_timeout_s: float | None = Field(
        120.0,
        gt=0,
        description="a connection that waits this long for its next request is closed (keep "
        "it above a load balancer's idle timeout)",
    )
    read_timeout_s: float | None = Field(
        30.0,
        gt=0,
        description="a request not received whole this long after its first byte gets 408 "
        "and its connection is closed",
    )
    poll_s: float = Field(0.2, gt=0, description="how often a server looks for new weights")
    follow_poll_s: float = Field(
        FOLLOW_POLL_S,
        gt=0,
        description="with `streamrec serve --follow`: seconds between two rounds of its "
        "replicas asking each training shard what changed; rows are served about this "
        "much after training changed them, and each round costs the shard and the server",
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="`streamrec serve`'s intra-op threads for the forward pass (None: torch's "
        "default, every core): one request's small matmuls gain nothing from more, and each "
        "extra thread wakes and spins on cores the replicas and clients need",
    )


class JobConfig(_Strict):
    """A streamrec job: one YAML file, every section validated, unknown keys are errors."""

    store: StoreConfig = Field(description="the embedding tables and the store's service")
    features: FeatureSpec | None = Field(
        None, description="the records' labels, dense and sparse fields (training needs them)"
    )
    source: SourceConfig | None = Field(
        None, description="where records come from (backfill --from gives Parquet files instead)"
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="the mode, the dense model, checkpoints"
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="where the job's parts run"
    )
    serving: ServingConfig = Field(
        default_factory=ServingConfig, description="publishing the model to prediction servers"
    )
    run_dir: Path = Field(Path("runs/job"), description="metrics, checkpoints, dead letters")


def load_config(path: Path | str) -> JobConfig:
    """Read and validate a job YAML file; errors name the file, the field and the value."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        msg = f"{p}: cannot read the job config ({exc.strerror})"
        raise ConfigError(msg) from exc
    except yaml.YAMLError as exc:
        msg = f"{p}: not valid YAML ({exc})"
        raise ConfigError(msg) from exc
    if not isinstance(raw, dict):
        msg = f"{p}: expected a mapping at the top level, got {type(raw).__name__}"
        raise ConfigError(msg)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(explain(exc, f"{p}: invalid job config")) from exc


def explain(exc: ValidationError, title: str) -> str:
    """One line per error: the field's path, what is wrong, the value (short), a suggestion.

    >>> try:
    ...     JobConfig.model_validate({"store": {"tables": {"u": {"dim": 4}}}, "trainr": {}})
    ... except ValidationError as e:
    ...     print(explain(e, "job.yaml: invalid job config"))
    job.yaml: invalid job config
      trainr: unknown key (did you mean `trainer`?)
    """
    lines = [title]
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(x) for x in loc)
        if err["type"] == "extra_forbidden":
            known = _fields_at(JobConfig, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            if not close and known:
                hint = f" (known here: {', '.join(sorted(known))})"
            lines.append(f"  {where}: unknown key{hint}")
            continue
        lines.append(f"  {where}: {err['msg']} (got {_short(err.get('input'))})")
    return "\n".join(lines)


def _short(value: object, limit: int = 80) -> str:
    """The value as the user wrote it, cut short: a whole section is not worth a screen."""
    if isinstance(value, dict):
        return f"a mapping with keys {sorted(map(str, value))[:8]}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fields_at(model: object, loc: tuple[int | str, ...]) -> list[str]:
    """The keys the schema accepts at ``loc`` (walking models, unions, dicts and lists)."""
    node: object = model
    for part in loc:
        node = _step(node, part)
        if node is None:
            return []
    node = _unwrap(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def _unwrap(tp: object) -> object:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _step(node: object, part: int | str) -> object:
    node = _unwrap(node)
    origin = typing.get_origin(node)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(node):
            member = _unwrap(option)
            if typing.get_origin(member) in (typing.Union, types.UnionType):
                found = _step(member, part)  # `X | None` around a discriminated union
                if found is not None:
                    return found
                continue
            if not (isinstance(member, type) and issubclass(member, BaseModel)):
                continue
            kind = member.model_fields.get("kind")
            if kind is not None and kind.default == part:
                return member  # a discriminated union's tag
            if part in member.model_fields:
                return _step(member, part)
        return None
    if origin is dict:
        return typing.get_args(node)[1]
    if origin is list or origin is tuple:
        return typing.get_args(node)[0]
    if isinstance(node, type) and issubclass(node, BaseModel):
        field = node.model_fields.get(str(part))
        return field.annotation if field is not None else None
    return None
