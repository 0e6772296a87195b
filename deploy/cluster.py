"""Running one job across hosts: torchrun's environment, and checks of the named services.

On many hosts every role is started by a stock command (``streamrec store
serve``, ``dask scheduler``, ``dask worker``, ``torchrun ... streamrec run``);
the job YAML names where the services are (``cluster.scheduler``,
``cluster.store``). This module reads what ``torchrun`` tells a rank
(:class:`TorchrunRank`) and checks, before any training, that the named
services answer and serve what the job expects (:func:`check_services`), so a
wrong address or a store of another job is one clear line, not a hang.

>>> TorchrunRank.from_env({}) is None
True
>>> r = TorchrunRank.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
...                            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.2",
...                            "MASTER_PORT": "29500"})
>>> r.rank, r.world, r.local_rank, r.nodes_may_differ
(1, 2, 0, True)
>>> TorchrunRank.from_env({"RANK": "2", "WORLD_SIZE": "2"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
deploy.cluster.ClusterError: RANK=2 is not below WORLD_SIZE=2 ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.config import JobConfig

TOKEN_ENV = "STREAMREC_STORE_TOKEN"


class ClusterError(RuntimeError):
    """The job cannot run across hosts as configured (the message says what to change)."""


class NotAnswering(ClusterError):
    """A service the job names does not answer (yet): it may be starting or restoring."""


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            msg = f"{name} is not set, but RANK is: is this process started by torchrun?"
            raise ClusterError(msg)
        return default
    try:
        value = int(raw)
    except ValueError:
        msg = f"{name}={raw!r} is not an integer"
        raise ClusterError(msg) from None
    if value < 0:
        msg = f"{name}={value} is negative"
        raise ClusterError(msg)
    return value


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place in a ``torchrun`` world (its environment variables)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master: str  # MASTER_ADDR:MASTER_PORT, for messages; init uses env://

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TorchrunRank | None:
        """The rank torchrun started, or None when ``RANK`` is not set (no torchrun)."""
        if "RANK" not in env:
            return None
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE")
        if world < 1 or rank >= world:
            msg = f"RANK={rank} is not below WORLD_SIZE={world} (torchrun sets both)"
            raise ClusterError(msg)
        local_rank = _int(env, "LOCAL_RANK", 0)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        master = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        return cls(rank, world, local_rank, local_world, master)

    @property
    def nodes_may_differ(self) -> bool:
        """Whether some rank of the world runs on another host (so nothing local is shared)."""
        return self.world > self.local_world


def store_token(job: JobConfig, env: Mapping[str, str]) -> str | None:
    """The store's token: ``cluster.token_file``, else ``$STREAMREC_STORE_TOKEN``, else None."""
    path = job.cluster.token_file
    if path is not None:
        return read_token_file(path, "cluster.token_file")
    return env.get(TOKEN_ENV) or None


def read_token_file(path: Path, what: str) -> str:
    """The token in ``path`` (whitespace stripped); :class:`ClusterError` naming ``what``
    (the option or field that named the file) when it cannot be read or is empty.
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        msg = f"{what} {path}: cannot read it ({exc.strerror})"
        raise ClusterError(msg) from exc
    if not token:
        msg = f"{what} {path}: the file is empty"
        raise ClusterError(msg)
    return token


def check_torchrun_job(job: JobConfig, launch: TorchrunRank) -> None:
    """Refuse a job that cannot run as one rank of a torchrun world, saying what to set."""
    missing = [
        name
        for name, value in (
            ("cluster.scheduler", job.cluster.scheduler),
            ("cluster.store", job.cluster.store),
        )
        if value is None
    ]
    if missing:
        msg = (
            f"started by torchrun (RANK={launch.rank}, WORLD_SIZE={launch.world}), every rank "
            f"joins services that already run: set {' and '.join(missing)} in the job YAML "
            "(see docs/cluster.md, 'Running on a cluster')"
        )
        raise ClusterError(msg)
    if launch.nodes_may_differ and job.trainer.checkpoint.dir is None:
        msg = (
            f"the torchrun world spans hosts (WORLD_SIZE={launch.world}, LOCAL_WORLD_SIZE="
            f"{launch.local_world}), so its checkpoints must be where every host reads them: "
            "set trainer.checkpoint.dir to an object-store URL (s3://bucket/prefix?...) or a "
            "shared mount"
        )
        raise ClusterError(msg)
    if job.trainer.ranks not in (1, launch.world):
        msg = (
            f"trainer.ranks: {job.trainer.ranks}, but torchrun started WORLD_SIZE="
            f"{launch.world} ranks; under torchrun the world size comes from torchrun "
            "(leave trainer.ranks at 1 or set it to the world size)"
        )
        raise ClusterError(msg)


def check_scheduler(address: str, timeout_s: float = 10.0) -> None:
    """Raise :class:`ClusterError` unless a Dask scheduler answers at ``address``."""
    scheduler_id(address, timeout_s)


def scheduler_id(address: str, timeout_s: float = 10.0) -> str:
    """The id of the Dask scheduler that answers at ``address`` (a restarted one has a new
    one); :class:`NotAnswering` when none does."""
    from distributed import Client

    try:
        with Client(address, timeout=timeout_s, set_as_default=False) as client:  # type: ignore[no-untyped-call]
            return str(client.scheduler_info()["id"])
    except (OSError, TimeoutError, ValueError) as exc:
        msg = f"cluster.scheduler {address}: no Dask scheduler answers there ({exc})"
        raise NotAnswering(msg) from exc


def check_store(job: JobConfig, address: str, token: str | None, timeout_s: float = 10.0) -> None:
    """Raise :class:`ClusterError` unless every shard answers, accepts the token and serves
    the job's tables with the job's dims (and, if ``cluster.store_shards`` is set, that many).
    """
    import grpc

    from embedding_store.proto import embedding_store_pb2 as pb
    from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc

    hosts = [h.strip() for h in address.removeprefix("grpc://").split(",") if h.strip()]
    if not address.startswith("grpc://") or not hosts:
        msg = f"cluster.store {address!r}: expected grpc://host:port[,host:port...]"
        raise ClusterError(msg)
    if "store_shards" in job.cluster.model_fields_set and job.cluster.store_shards != len(hosts):
        msg = (
            f"cluster.store names {len(hosts)} shard(s), cluster.store_shards says "
            f"{job.cluster.store_shards}: give every shard's address, in shard order"
        )
        raise ClusterError(msg)
    want = {name: t.dim for name, t in job.store.tables.items()}
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    for i, host in enumerate(hosts):
        with grpc.insecure_channel(host) as channel:
            stub = pb_grpc.EmbeddingStoreStub(channel)  # type: ignore[no-untyped-call]
            try:
                reply = stub.Health(pb.HealthRequest(), metadata=metadata, timeout=timeout_s)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    why = "it refuses the job's token (cluster.token_file or $" + TOKEN_ENV + ")"
                else:
                    why = f"{code.name}: {exc.details()}"
                msg = f"cluster.store shard {i} at {host}: {why}"
                waiting = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                raise (NotAnswering if waiting else ClusterError)(msg) from None
        served = dict(reply.dims)
        if served != want:
            diff = sorted(
                f"{n}: job {want.get(n, 'absent')}, shard {served.get(n, 'absent')}"
                for n in set(want) | set(served)
                if want.get(n) != served.get(n)
            )
            msg = (
                f"cluster.store shard {i} at {host} serves other tables than store.tables "
                f"({'; '.join(diff)}): is it another job's store?"
            )
            raise ClusterError(msg)


def local_device_index(launch: TorchrunRank | None) -> int:
    """The GPU a rank uses: ``LOCAL_RANK`` under torchrun, else 0."""
    return launch.local_rank if launch is not None else 0


def environment() -> Mapping[str, str]:
    """The process environment, read when a command runs (never at import)."""
    return os.environ
