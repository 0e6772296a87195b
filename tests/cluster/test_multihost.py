"""A job on seven "hosts" of one machine, as a user runs it on a cluster, with hosts lost.

Every host is its own loopback address, working directory and processes
(:mod:`tests.cluster.hosts`): two store shard hosts (``streamrec store serve
--snapshots s3://...``), a scheduler host (``dask scheduler``), two worker
hosts (``dask worker``), a rendezvous host (``streamrec rendezvous``) and two
trainer hosts, each running ``streamrec torchrun`` with one rank and
``--max-restarts``. Nothing is shared but the network, the Kafka broker and the
S3 server: job checkpoints and shard snapshots live in S3.

The fault test kills a trainer host and a store shard host with ``kill -9``
at random points. The other trainer host keeps its torchrun: its rank names
the lost peer and ends, torchrun starts it again and waits in the rendezvous,
and a replacement host on a new address joins it; the world re-forms and the
ranks resume from the newest manifest in S3. The shard host restarts from a
new, empty working directory with the same command: it restores its snapshot
from S3, and the job rolls back to the newest checkpoint by itself.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.kafka import KafkaSource, KafkaSourceConfig
from connectors.kafka_produce import produce
from connectors.synthetic import (
    SyntheticConfig,
    iter_json_lines,
    synthetic_feature_spec,
    synthetic_store_section,
)
from deploy.local.objectstore import LocalS3
from embedding_store.location import Location
from embedding_store.mirror import fetch_chain
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from tests.cluster.hosts import (
    Host,
    dask_scheduler,
    dask_worker,
    rendezvous,
    store_serve,
    torchrun,
)
from tests.support.jobs import write_job_yaml
from tests.support.kafka import KafkaForTests
from tests.support.ports import free_port
from tests.support.processes import start_job
from tests.support.waits import wait_until
from trainer.checkpoint import CheckpointBook, JobManifest
from trainer.ledger import learned_ranges

pytestmark = pytest.mark.processes

PARTITIONS = 3
EVENTS = 1_600  # per partition
# The sync test compares two runs bit for bit: half the events still give each rank
# 16 steps and several checkpoints, at half of its two trainings' time.
SYNC_EVENTS = 800
BATCH = 100
TOKEN = "cluster-test-token"


def produce_topic(kafka: KafkaForTests, topic: str, events: int = EVENTS) -> None:
    lines = list(iter_json_lines(SyntheticConfig(seed=11), events * PARTITIONS))
    for p in range(PARTITIONS):
        produce(
            kafka.bootstrap,
            topic,
            lines[p * events : (p + 1) * events],
            api_version=kafka.api_version,
            partition=p,
        )


def job_doc(
    kafka: KafkaForTests,
    topic: str,
    *,
    mode: str,
    checkpoints: str | None,
    optimizer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "mode": mode,
        "batch_size": BATCH,
        "model": {"kind": "ffnn", "hidden": [16]},
        "torch_threads": 1,
        "log_every_s": 0.5,
        "checkpoint": {"dir": checkpoints, "every_steps": 5, "every_s": 2.0},
    }
    if mode == "hybrid":
        trainer["staleness"] = 2
    if optimizer is not None:
        trainer["optimizer"] = optimizer
    return {
        "store": synthetic_store_section(dim=4, row_dtype="float32"),
        "features": synthetic_feature_spec().model_dump(),
        "source": {
            "kind": "kafka",
            "bootstrap_servers": kafka.bootstrap,
            "topics": [topic],
            "group_id": f"{topic}-trainer",
            "api_version": ".".join(map(str, kafka.api_version)),
            "deadletter": "file",
        },
        "trainer": trainer,
        "run_dir": "run",
    }


@dataclass
class Cluster:
    """The hosts of one job and the commands that (re)start each role."""

    job: dict[str, Any]
    s3: LocalS3
    prefix: str
    shards: list[Host]
    shard_ports: list[int]
    scheduler: Host
    workers: list[Host]
    trainers: list[Host]
    rendezvous: Host
    rdzv: str
    run_id: str
    new_host: Callable[[str], Host]
    retired: list[Host] = field(default_factory=list)  # trainer hosts that were replaced

    @property
    def checkpoints(self) -> CheckpointBook:
        return CheckpointBook(self.job["trainer"]["checkpoint"]["dir"])

    def snapshots(self, i: int) -> str:
        return self.s3.url(f"{self.prefix}/store/shard-{i:03d}")

    def write_job(self, host: Host) -> str:
        """The job YAML, as each host has its own copy of it."""
        return str(write_job_yaml(host.workdir / "job.yaml", **self.job))

    def start_shard(self, i: int, *, wait: bool = True) -> None:
        host = self.shards[i]
        host.start(
            "shard", store_serve(self.write_job(host), host, self.shard_ports[i], self.snapshots(i))
        )
        if wait:
            self.wait_shard(i)

    def wait_shard(self, i: int) -> None:
        self.shards[i].wait_log("shard", r"streamrec store: serving")

    def start_trainer(self, i: int) -> None:
        host = self.trainers[i]
        argv = torchrun(
            self.write_job(host), host, nnodes=len(self.trainers), endpoint=self.rdzv,
            run_id=self.run_id,
        )  # fmt: skip
        host.start("trainer", argv)

    def replace_trainer(self, i: int, host: Host) -> None:
        """``host`` (a new machine: another address, an empty disk) takes trainer ``i``'s
        place, with the same command."""
        self.retired.append(self.trainers[i])
        self.trainers[i] = host
        self.start_trainer(i)

    def all_hosts(self) -> list[Host]:
        hosts = [*self.shards, self.scheduler, *self.workers, self.rendezvous]
        return [*hosts, *self.trainers, *self.retired]

    def logs(self) -> str:
        out = []
        for host in self.all_hosts():
            for d in host.dirs:
                for log in sorted(d.glob("*.log")):
                    out.append(
                        f"--- {d.name}/{log.name}\n{log.read_text(errors='replace')[-3000:]}"
                    )
        return "\n".join(out)


@pytest.fixture
def make_cluster(
    tmp_path: Path, kafka: KafkaForTests, s3: LocalS3, s3_prefix: str
) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        topic: str, *, mode: str, name: str = "c", optimizer: dict[str, Any] | None = None
    ) -> Cluster:
        env = {**os.environ, **s3.env(), "STREAMREC_STORE_TOKEN": TOKEN}
        env["OMP_NUM_THREADS"] = "1"
        prefix = f"{s3_prefix}/{name}"
        hosts = iter(range(2, 250))

        def host(role: str) -> Host:
            return Host(role, f"127.0.0.{next(hosts)}", tmp_path / name, env)

        shards = [host(f"shard{i}") for i in range(2)]
        scheduler = host("scheduler")
        workers = [host(f"worker{i}") for i in range(2)]
        trainers = [host(f"trainer{i}") for i in range(2)]
        ports = [free_port() for _ in shards]
        sched_port = free_port()
        checkpoints = s3.url(f"{prefix}/checkpoints")
        job = job_doc(kafka, topic, mode=mode, checkpoints=checkpoints, optimizer=optimizer)
        job["cluster"] = {
            "scheduler": f"tcp://{scheduler.address}:{sched_port}",
            "store": "grpc://"
            + ",".join(f"{h.address}:{p}" for h, p in zip(shards, ports, strict=True)),
        }
        rdzv_host = host("rendezvous")
        rdzv = f"{rdzv_host.address}:{free_port()}"
        cluster = Cluster(
            job, s3, prefix, shards, ports, scheduler, workers, trainers, rdzv_host, rdzv,
            f"{s3_prefix}{name}", host,
        )  # fmt: skip
        made.append(cluster)
        # The hosts come up side by side, as a cluster's do, each then waited for (the
        # workers started once the scheduler listens): their start-ups overlap.
        rdzv_host.start("rendezvous", rendezvous(rdzv_host, int(rdzv.rsplit(":", 1)[1])))
        for i in range(len(shards)):
            cluster.start_shard(i, wait=False)
        scheduler.start("scheduler", dask_scheduler(scheduler, sched_port))
        scheduler.wait_log("scheduler", r"Scheduler at:")
        for w in workers:
            w.start("worker", dask_worker(w, job["cluster"]["scheduler"]))
        rdzv_host.wait_log("rendezvous", r"torchrun's c10d store on")
        for i in range(len(shards)):
            cluster.wait_shard(i)
        for w in workers:
            w.wait_log("worker", r"Registered to:")
        return cluster

    yield make
    for cluster in made:
        for host in cluster.all_hosts():
            host.crash()


def wait_for(
    cluster: Cluster, what: str, ok: Callable[[JobManifest | None], bool], timeout_s: float = 240
) -> JobManifest | None:
    found: list[JobManifest | None] = []  # the manifest that was ok (None can be)

    def reached() -> bool:
        latest = cluster.checkpoints.latest()
        found[:] = [latest]
        return ok(latest)

    def torchruns() -> list[subprocess.Popen[bytes]]:
        return [h.procs["trainer"] for h in cluster.trainers if "trainer" in h.procs]

    wait_until(reached, what, timeout_s=timeout_s, interval_s=0.3, procs=torchruns,
               details=cluster.logs)  # fmt: skip
    return found[0]


def ends(topic: str, events: int = EVENTS) -> dict[str, int]:
    return {f"{topic}/{p}": events for p in range(PARTITIONS)}


def finish(cluster: Cluster, topic: str, events: int = EVENTS) -> JobManifest:
    """Wait until the checkpoints cover the whole topic, then stop the trainers (SIGTERM).

    All at once, as an orchestrator stops a group: torchrun forwards the signal to
    its rank, which takes a last checkpoint and exits 0; torchrun itself then exits
    1 ("Received 15 death signal"), as it does for any signal, so its own code is
    not what the test checks. (Stopped one by one, the last one's rank ends with
    its peer, and its torchrun waits at the exit barrier for the agent that was
    signalled: up to 5 minutes, with the rendezvous store on a host of its own.)
    """
    wait_for(
        cluster,
        "every offset checkpointed",
        lambda m: m is not None and m.positions == ends(topic, events),
    )
    for host in cluster.trainers:
        host.signal("trainer", signal.SIGTERM)
    for host in cluster.trainers:
        host.wait("trainer")
    for host in cluster.trainers:
        out = host.log("trainer")
        last_run = out.rsplit("store: grpc://", 1)[-1]
        assert re.search(r"stopped by (signal|another rank)", last_run), cluster.logs()
    final = cluster.checkpoints.latest()
    assert final is not None
    return final


def assert_learned_once(cluster: Cluster, topic: str) -> None:
    hosts = [*cluster.trainers, *cluster.retired]
    ledgers = [p for h in hosts for d in h.dirs for p in d.glob("run/learned-rank*.log")]
    ranges = learned_ranges(*ledgers)
    assert sorted(ranges) == sorted(ends(topic))
    for partition, spans in ranges.items():
        covered = np.zeros(EVENTS, dtype=np.int64)
        for s, e in spans:
            covered[s:e] += 1
        assert covered.min() == 1, f"{partition}: an offset was never learned"
        assert covered.max() == 1, f"{partition}: an offset was learned twice"


def committed(cluster: Cluster, topic: str) -> dict[str, int | None]:
    cfg = {k: v for k, v in cluster.job["source"].items() if k in KafkaSourceConfig.model_fields}
    src = KafkaSource(KafkaSourceConfig(**cfg))
    try:
        return {p: src.committed(p) for p in ends(topic)}
    finally:
        src.close()


def dense_states(book: CheckpointBook, manifest: JobManifest) -> list[dict[str, torch.Tensor]]:
    return [r["model"] for r in book.load_dense(manifest)["ranks"]]


def test_a_job_on_many_hosts_heals_lost_hosts_and_learns_every_offset_once(
    make_cluster: Callable[..., Cluster], kafka: KafkaForTests, kafka_topic: Any
) -> None:
    rng = random.Random(7)
    topic = kafka_topic(partitions=PARTITIONS)
    produce_topic(kafka, topic)
    cluster = make_cluster(topic, mode="hybrid")
    for i in range(len(cluster.trainers)):
        cluster.start_trainer(i)

    # A trainer host dies at a random point. The other one keeps its torchrun: its rank
    # names the lost peer and ends, torchrun starts it again and waits in the rendezvous
    # until a new host (another address, an empty disk) takes the lost one's place.
    first = wait_for(cluster, "a first checkpoint", lambda m: m is not None and m.step >= 5)
    assert first is not None
    time.sleep(rng.uniform(0, 1.5))
    survivor = cluster.trainers[0]
    torchrun_before = survivor.procs["trainer"]
    cluster.trainers[1].crash()
    survivor.wait_log("trainer", r"another rank of the torchrun world is gone")
    # The new world resumes from the newest checkpoint; only it writes past it. (Waiting
    # for first.step + 5 was met by a checkpoint of the first world: the shard host
    # then died while the trainers were still starting, and they refused to start.)
    resumed = cluster.checkpoints.latest()
    assert resumed is not None
    cluster.replace_trainer(1, cluster.new_host("trainer1-new"))
    after = wait_for(
        cluster,
        "a checkpoint after the trainer hosts came back",
        lambda m: m is not None and m.step > resumed.step + 5,
    )
    assert after is not None
    assert survivor.procs["trainer"] is torchrun_before
    assert torchrun_before.poll() is None, "the surviving host's torchrun kept running"

    # A store shard host dies; its replacement has an empty disk.
    time.sleep(rng.uniform(0, 1.5))
    shard_host = cluster.shards[1]
    shard_host.crash()
    time.sleep(rng.uniform(1, 3))
    shard_host.replace()
    cluster.start_shard(1)

    final = finish(cluster, topic)
    assert "rolling back to the newest checkpoint" in cluster.logs(), "the job healed the store"

    assert_learned_once(cluster, topic)
    assert final.samples == EVENTS * PARTITIONS
    assert committed(cluster, topic) == final.positions
    ranks = dense_states(cluster.checkpoints, final)
    assert len(ranks) == 2
    for k, v in ranks[0].items():
        assert torch.equal(v, ranks[1][k]), f"the ranks' dense weights differ at {k}"


def store_rows(config: StoreConfig, dirs: list[Path], seqs: list[int]) -> dict[str, dict[str, Any]]:
    """Every table's rows (sorted by id) of the shards checkpointed in ``dirs`` at ``seqs``."""
    out: dict[str, dict[str, list[np.ndarray]]] = {}
    for d, seq in zip(dirs, seqs, strict=True):
        shard = StoreShard(config, data_dir=d)
        shard.restore(upto_seq=seq)
        for name, table in shard.tables.items():
            rows, _, _ = table.export(False, mark_clean=False)
            parts = out.setdefault(name, {"ids": [], "weights": [], "state": []})
            for part in parts:
                parts[part].append(getattr(rows, part))
    result: dict[str, dict[str, Any]] = {}
    for name, parts in out.items():
        ids = np.concatenate(parts["ids"])
        order = np.argsort(ids)
        result[name] = {k: np.concatenate(v)[order] for k, v in parts.items()}
    return result


# Its own waits (240 s for the one-host job's last checkpoint, 240 s for its stop under
# the suite's load) are longer than the suite's 300 s per test.
@pytest.mark.timeout(900)
def test_a_sync_job_on_many_hosts_learns_the_same_model_as_on_one_host(
    make_cluster: Callable[..., Cluster],
    kafka: KafkaForTests,
    kafka_topic: Any,
    tmp_path: Path,
) -> None:
    """`mode: sync` across hosts (S3 checkpoints, torchrun) equals the same job on one host,
    bit for bit: the same batches, steps, dense weights and embedding rows.

    (It did not, on one host either, until the ranks' pushes were applied in rank
    order: Adagrad's update of a row depends on the pushes it saw before.)
    """
    topic = kafka_topic(partitions=PARTITIONS)
    produce_topic(kafka, topic, SYNC_EVENTS)
    cluster = make_cluster(topic, mode="sync", name="sync")
    for i in range(len(cluster.trainers)):
        cluster.start_trainer(i)
    many = finish(cluster, topic, SYNC_EVENTS)
    many_book = cluster.checkpoints

    # The same job on one host: `trainer.ranks: 2`, local shards, workers and checkpoints.
    local = job_doc(kafka, topic, mode="sync", checkpoints=None)
    local["source"]["group_id"] = f"{topic}-one-host"
    local["trainer"]["ranks"] = 2
    local["run_dir"] = str(tmp_path / "one-host" / "run")
    local["cluster"] = {"workers": 2, "store_shards": 2, "dashboard_address": ":0"}
    proc = start_job(write_job_yaml(tmp_path / "one-host.yaml", **local))
    one_book = CheckpointBook(tmp_path / "one-host" / "run" / "checkpoints")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            latest = one_book.latest()
            if latest is not None and latest.positions == ends(topic, SYNC_EVENTS):
                break
            time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)
        # Under the full suite's load on 2 cores, a nanny may restart a worker that the
        # group's SIGTERM reached before the job stopped it: the stop can take minutes.
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    one = one_book.latest()
    assert one is not None
    assert (one.step, one.samples, one.positions) == (many.step, many.samples, many.positions)

    for a, b in zip(dense_states(many_book, many), dense_states(one_book, one), strict=True):
        for k, v in a.items():
            diff = float((v - b[k]).abs().max())
            torch.testing.assert_close(v, b[k], rtol=0, atol=0, msg=f"{k}: max diff {diff}")
    config = StoreConfig.model_validate(local["store"])
    fetched = []
    for i in range(2):
        d = tmp_path / "fetched" / f"shard-{i:03d}"
        fetch_chain(Location.parse(cluster.snapshots(i)), d, many.shard_seqs[i])
        fetched.append(d)
    rows_many = store_rows(config, fetched, many.shard_seqs)
    local_dirs = [tmp_path / "one-host" / "run" / "store" / f"shard-{i:03d}" for i in range(2)]
    rows_one = store_rows(config, local_dirs, one.shard_seqs)
    assert sorted(rows_many) == sorted(rows_one)
    for name in rows_many:
        for part in ("ids", "weights", "state"):
            np.testing.assert_array_equal(
                rows_many[name][part], rows_one[name][part], err_msg=f"{name}.{part}"
            )
