"""Chaos benchmark: a continuous Kafka job survives SIGKILLs of its parts and loses nothing.

    python benchmarks/chaos.py --minutes 10 --kill-every-s 30 --json bench-results/chaos.json

A real local broker (2 partitions: Kafka 0.9, or with ``--broker tansu`` Tansu,
the modern protocol, its log kept in a local S3 server), a producer thread writing the
synthetic stream at ``--rate`` events/s, and ``streamrec run`` (hybrid mode,
2 store shards, 2 Dask workers, ``--ranks`` trainer ranks, 1 by default) as a
user runs it. Every
``--kill-every-s`` seconds one component is killed with SIGKILL, in a random
order that takes each kind in turn (a shuffled bag; ``--victims`` picks the
kinds): a store shard (the job
restarts it and rolls back to its newest checkpoint), a Dask worker (its Nanny
starts a new one, the task is retried) or the broker (the benchmark plays its
supervisor: it brings it back on the same port after ``--outage-s``), or, with
``--ranks 2`` or more, a trainer rank's process (rank 0 is the job's own: the
job starts every rank again from its newest checkpoint), or, with ``--scheduler
external``, the Dask scheduler (the benchmark's own ``dask scheduler`` and
``dask worker`` processes, named in the job's ``cluster.scheduler``: the
benchmark starts them again on the same address after ``--outage-s``, and the
job waits for it and starts its ranks again from the newest checkpoint). The
job is never restarted by hand.

With ``--serve`` the job is also served as a user would serve it: one
serving replica per store shard (``streamrec store replica``), a prediction
server over them, and a client sending ``--requests-per-s`` requests of 8
records; replicas join the victims (the benchmark plays their supervisor: it
starts a killed one again after ``--outage-s``, and it has recovered once it
has caught up with its training shard again). Every request is counted by its
answer, and the dense version in the answers must never go backwards.

At the end (after ``--minutes``, or once the last of ``--kills`` has recovered:
the producer writes on until then) the producer stops, the job catches up with the topic's end, gets
Ctrl-C (SIGINT: last checkpoint, offsets committed) and the offsets are
counted from the ledger (``learned-rank0.log``, rollbacks applied) and the
consumer group: each offset of the topic must be learned exactly once.

A kill's recovery time runs from the kill until the job has learned more
than it had when it was killed: for a shard, after the job rolled back (so
it first learns again what the rollback took back); for the broker, more
than it had when the broker was back (batches prepared before the kill may
still be learned during the outage).

JSON keys: produced, learned_once, learned_twice, never_learned, kills,
kills_by_kind, recoveries, recovery_s_p50, recovery_s_max, job_rollbacks,
rank_restarts, ledger_rollbacks,
committed_equals_end, manual_restarts (always 0), stop_reason, exit_code,
and the list of kills with their times; with ``--serve`` also serve_requests,
serve_ok, serve_failed, serve_failed_by_status, dense_versions_served and
dense_version_backwards.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from common import print_figures, write_json  # noqa: E402

KINDS = ("shard", "worker", "broker")
SERVE_KINDS = (*KINDS, "replica")
ALL_KINDS = (*SERVE_KINDS, "trainer", "scheduler")
# Kills the job recovers from by rolling back to its newest checkpoint (a ledger
# "rollback" line): their recovery counts only from that rollback on.
ROLLBACK_KINDS = ("shard", "trainer", "scheduler")


@dataclass
class Kill:
    kind: str
    at_s: float  # seconds since the job started
    pid: int
    learned_at_kill: int
    recovery_s: float | None = None
    # The broker: its recovery counts from the moment it is back, until the job learns more.
    ready: bool = True
    rollbacks_at_kill: int = 0  # a shard's kill is over only after the job rolled back


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="SIGKILL a running streamrec job's parts and count what it learned."
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to keep killing")
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--kills", type=int, default=None, help="stop after this many kills")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s produced")
    parser.add_argument("--outage-s", type=float, default=3.0, help="broker down this long")
    parser.add_argument(
        "--broker",
        choices=("kafka09", "tansu"),
        default="kafka09",
        help=(
            "kafka09: Apache Kafka 0.9 (legacy message sets); tansu: the modern protocol "
            "(record batches), its log in a local S3 server so that it survives the kills"
        ),
    )
    parser.add_argument(
        "--victims",
        nargs="+",
        choices=ALL_KINDS,
        default=None,
        help=(
            "the kinds to kill (default: every kind; replicas only with --serve, trainer "
            "ranks only with --ranks 2 or more)"
        ),
    )
    parser.add_argument("--ranks", type=int, default=1, help="the job's trainer.ranks")
    parser.add_argument(
        "--scheduler",
        choices=("local", "external"),
        default="local",
        help=(
            "local: the job's own Dask cluster; external: `dask scheduler` and `dask worker` "
            "processes of the benchmark's, named in cluster.scheduler, and the scheduler "
            "joins the victims (it and its workers start again after --outage-s)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--catch-up-s", type=float, default=300.0, help="max wait at the end")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument(
        "--serve", action="store_true", help="serve the job too, and kill serving replicas"
    )
    parser.add_argument("--requests-per-s", type=float, default=20.0, help="with --serve")
    return parser.parse_args(argv)


class Serving:
    """Replicas of the job's shards, a prediction server over them, and a client."""

    def __init__(self, job_path: Path, store: str, token_file: Path, work: Path, rate: float):
        from deploy.cli.serve import ServingStack
        from deploy.config import load_config
        from deploy.local.shards import ShardProcess
        from deploy.store_server import read_token

        self.replicas = [
            ShardProcess.start(job_path, work / f"replica-{i}", token_file=token_file, follow=a)
            for i, a in enumerate(store.removeprefix("grpc://").split(","))
        ]
        job = load_config(job_path)
        addresses = "grpc://" + ",".join(r.address for r in self.replicas)
        self.stack = ServingStack(job, addresses, read_token(token_file), host="127.0.0.1", port=0)
        self.rate = rate
        self.statuses: dict[int, int] = {}
        self.versions: list[int] = []
        self.backwards = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._requests, name="chaos-client", daemon=True)
        self.thread.start()

    def _requests(self) -> None:
        import json
        import urllib.error
        import urllib.request

        from connectors.synthetic import SyntheticConfig, iter_json_lines

        lines = iter_json_lines(SyntheticConfig(seed=99), 1 << 40)
        url = f"{self.stack.url}/v2/models/streamrec/infer"
        t0, sent = time.monotonic(), 0
        while not self.stopped.is_set():
            records = [next(lines).decode() for _ in range(8)]
            body = json.dumps(
                {
                    "inputs": [
                        {"name": "records", "datatype": "BYTES", "shape": [8], "data": records}
                    ]
                }
            ).encode()
            try:
                with urllib.request.urlopen(url, body, timeout=30) as reply:
                    status, doc = reply.status, json.loads(reply.read())
                version = int(doc["parameters"]["dense_version"])
                if self.versions and version < self.versions[-1]:
                    self.backwards += 1
                self.versions.append(version)
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError:
                status = 0  # no answer at all
            self.statuses[status] = self.statuses.get(status, 0) + 1
            sent += 1
            ahead = t0 + sent / self.rate - time.monotonic()
            if ahead > 0:
                self.stopped.wait(ahead)

    def kill_replica(self, kill: Kill, outage_s: float, started: float) -> None:
        i = random.randrange(len(self.replicas))
        victim = self.replicas[i]
        caught_up = victim.log().count("caught up with")
        kill.pid = int(victim.proc.pid)
        victim.kill()

        def bring_back() -> None:
            time.sleep(outage_s)
            fresh = victim.restart()
            self.replicas[i] = fresh
            while fresh.log().count("caught up with") <= caught_up:
                time.sleep(0.1)
            kill.recovery_s = time.monotonic() - started - kill.at_s

        threading.Thread(target=bring_back, name="replica-supervisor", daemon=True).start()

    def figures(self) -> dict[str, Any]:
        ok = self.statuses.get(200, 0)
        total = sum(self.statuses.values())
        return {
            "serve_requests": total,
            "serve_ok": ok,
            "serve_failed": total - ok,
            "serve_failed_by_status": {str(k): v for k, v in self.statuses.items() if k != 200},
            "dense_versions_served": len(set(self.versions)),
            "dense_version_backwards": self.backwards,
        }

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=60)
        self.stack.close()
        for r in self.replicas:
            r.kill()


def write_job(
    work: Path,
    bootstrap: str,
    topic: str,
    batch_size: int,
    api_version: tuple[int, ...],
    ranks: int = 1,
    scheduler: str | None = None,
) -> Path:
    import yaml

    from connectors.synthetic import synthetic_feature_spec, synthetic_store_section

    job = {
        "run_dir": str(work / "run"),
        "features": synthetic_feature_spec().model_dump(mode="json"),
        "store": synthetic_store_section(dim=8),
        "source": {
            "kind": "kafka",
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": "chaos",
            "api_version": list(api_version),
            "deadletter": "file",
        },
        "trainer": {
            "mode": "hybrid",
            "staleness": 4,
            "ranks": ranks,
            "batch_size": batch_size,
            "model": {"kind": "ffnn", "hidden": [64, 32]},
            "torch_threads": 1,
            "log_every_s": 1.0,
            "checkpoint": {"every_steps": 20, "every_s": 10.0},
            # Every offset is counted from the ledger: keep all of it.
            "run_files": {"max_mb": None},
        },
        "cluster": {"workers": 2, "store_shards": 2, "dashboard_address": ":0"},
    }
    if scheduler is not None:
        job["cluster"] = {"scheduler": scheduler, "store_shards": 2}
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


class Producer(threading.Thread):
    """Writes the synthetic stream in blocks, alternating partitions, retrying through outages.

    ``pool``: events written in turn, over and over, instead of generating new ones.
    Generating an event (Arrow, then JSON) costs about as much CPU as the Kafka client
    writing it: on a small machine a generating producer takes a core from the job
    it feeds, and writes below its rate once the job is busy.
    """

    def __init__(
        self,
        broker: Broker,
        topic: str,
        rate: float,
        seed: int,
        pool: Sequence[bytes] | None = None,
    ) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.bootstrap, self.topic, self.rate, self.seed = broker.bootstrap, topic, rate, seed
        self.api_version = broker.api_version
        self.pool = pool
        self.block = max(1, int(rate / 4))  # what one write holds
        self.stopped = threading.Event()
        self.blocks = 0
        self.errors = 0

    def run(self) -> None:
        from connectors.kafka_produce import produce
        from connectors.synthetic import SyntheticConfig, iter_json_lines

        block = self.block
        lines: Iterator[bytes] = (
            itertools.cycle(self.pool)
            if self.pool
            else iter_json_lines(SyntheticConfig(seed=self.seed), 1 << 40)
        )
        t0 = time.monotonic()
        while not self.stopped.is_set():
            payloads = [next(lines) for _ in range(block)]
            while not self.stopped.is_set():
                try:
                    produce(
                        self.bootstrap,
                        self.topic,
                        payloads,
                        api_version=self.api_version,
                        partition=self.blocks % 2,
                        timeout_s=10.0,
                    )
                    break
                except Exception:  # the broker is down: the same block again
                    self.errors += 1
                    time.sleep(0.5)
            self.blocks += 1
            ahead = t0 + self.blocks * block / self.rate - time.monotonic()
            if ahead > 0:
                self.stopped.wait(ahead)


class Broker:
    """The broker the job reads, as the benchmark plays its supervisor: Kafka 0.9 (its
    log on disk) or Tansu (its log in a local S3 server), killed and started again
    on the same port."""

    def __init__(self, kind: str, work: Path, *, fixed_heap: bool = False) -> None:
        """``fixed_heap``: a Kafka broker holds its whole heap from the start (see
        ``LocalKafka.start``)."""
        from deploy.local.kafka import API_VERSION, LocalKafka
        from deploy.local.objectstore import LocalS3
        from deploy.local.tansu import API_VERSION as TANSU_VERSION
        from deploy.local.tansu import LocalTansu, s3_storage

        self.kind = kind
        self.s3: LocalS3 | None = None
        self.kafka: LocalKafka | None = None
        self.tansu: LocalTansu | None = None
        if kind == "kafka09":
            self.kafka = LocalKafka.start(work / "kafka", fixed_heap=fixed_heap)
            self.bootstrap, self.api_version = self.kafka.bootstrap, API_VERSION
        else:
            self.s3 = LocalS3.start(work / "s3")
            storage, env = s3_storage(self.s3)
            self.tansu = LocalTansu.start(work / "tansu", storage=storage, env=env)
            self.bootstrap, self.api_version = self.tansu.bootstrap, TANSU_VERSION

    def create_topic(self, topic: str, partitions: int) -> None:
        if self.kafka is not None:
            self.kafka.create_topic(topic, partitions=partitions)
            return
        from deploy.local.kafka import make_topic

        make_topic(self.bootstrap, topic, partitions, api_version=self.api_version)

    @property
    def pid(self) -> int:
        process = self.kafka.broker_process if self.kafka else self.tansu and self.tansu.process
        assert process is not None
        return int(process.pid)

    def kill(self) -> None:
        if self.kafka is not None:
            self.kafka.kill_broker()
        elif self.tansu is not None:
            self.tansu.kill()

    def start(self) -> None:
        if self.kafka is not None:
            self.kafka.start_broker()
        elif self.tansu is not None:
            self.tansu.start_broker()

    def stop(self) -> None:
        if self.kafka is not None:
            self.kafka.stop()
        if self.tansu is not None:
            self.tansu.stop()
        if self.s3 is not None:
            self.s3.stop()


def rollback_count(run_dir: Path) -> int:
    # Every rank rolls back together; rank 0's ledger records each rollback.
    path = run_dir / "learned-rank0.log"
    if not path.exists():
        return 0
    return sum(line.startswith("rollback") for line in path.read_text().splitlines())


def learned_count(run_dir: Path) -> int:
    from trainer.ledger import learned_ranges

    paths = sorted(run_dir.glob("learned-rank*.log"))
    if not paths:
        return 0
    return sum(e - s for spans in learned_ranges(*paths).values() for s, e in spans)


def rank_processes(job: subprocess.Popen[bytes]) -> list[Any]:
    """The job's spawned trainer rank processes (ranks 1..): each writes its ledger."""
    import psutil

    found = []
    for c in psutil.Process(job.pid).children():
        with contextlib.suppress(psutil.Error):
            ledgers = [f.path for f in c.open_files() if "learned-rank" in f.path]
            if ledgers and not any(p.endswith("learned-rank0.log") for p in ledgers):
                found.append(c)
    return found


def job_children(job: subprocess.Popen[bytes], marker: str) -> list[Any]:
    import psutil

    found = []
    for c in psutil.Process(job.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(c.cmdline()) and not any(
                f.path.endswith(".log") and "learned-rank" in f.path for f in c.open_files()
            ):
                found.append(c)
    return found


class ExternalDask:
    """A Dask scheduler and workers of their own (``--scheduler external``), named in the
    job's ``cluster.scheduler``, as the benchmark plays their supervisor: Dask workers
    exit when their scheduler goes, so both start again, on the same address."""

    def __init__(self, work: Path, workers: int) -> None:
        from deploy.local.kafka import free_port

        self.work, self.workers = work, workers
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lives = 0
        self.start()

    def _spawn(self, name: str, args: list[str], ready: str) -> None:
        log = self.work / f"dask-{name}-{self.lives}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dask", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                msg = f"dask {name} did not start; see {log}"
                raise RuntimeError(msg)
            time.sleep(0.1)

    def start(self) -> None:
        self.lives += 1
        args = ["scheduler", "--host", "127.0.0.1", "--port", str(self.port)]
        self._spawn("scheduler", [*args, "--dashboard-address", ":0"], "Scheduler at:")
        for i in range(self.workers):
            args = ["worker", self.address, "--nthreads", "1", "--name", f"w{i}"]
            self._spawn(f"worker{i}", [*args, "--no-dashboard"], "Registered to:")

    @property
    def scheduler_pid(self) -> int:
        return int(self.procs[-1 - self.workers].pid)

    def worker_processes(self) -> list[Any]:
        """The workers under their nannies (a killed one is started again by its nanny)."""
        import psutil

        found = []
        for proc in self.procs[-self.workers :]:
            with contextlib.suppress(psutil.Error):
                found += psutil.Process(proc.pid).children()
        return found

    def kill(self) -> None:
        """``kill -9`` of the scheduler and every worker, as when their host dies."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


def kill_one(
    kill: Kill,
    job: subprocess.Popen[bytes],
    broker: Broker,
    outage_s: float,
    run_dir: Path,
    dask: ExternalDask | None = None,
) -> None:
    """SIGKILL one component of ``kill.kind``; sets ``kill.pid``."""
    if kill.kind == "scheduler":
        assert dask is not None
        kill.pid = dask.scheduler_pid
        dask.kill()

        def start_again() -> None:
            time.sleep(outage_s)
            dask.start()

        threading.Thread(target=start_again, name="dask-supervisor", daemon=True).start()
        return
    if kill.kind == "broker":
        kill.pid = broker.pid
        kill.ready = False
        broker.kill()

        def bring_back() -> None:
            time.sleep(outage_s)
            broker.start()
            # Batches prepared before the kill may still be learned meanwhile: the job
            # has resumed once it learns more than it had when the broker was back.
            kill.learned_at_kill = learned_count(run_dir)
            kill.ready = True

        threading.Thread(target=bring_back, name="broker-supervisor", daemon=True).start()
        return
    if kill.kind == "trainer":
        victims = rank_processes(job)
    elif kill.kind == "worker" and dask is not None:
        victims = dask.worker_processes()
    else:
        victims = job_children(job, "store serve" if kill.kind == "shard" else "spawn_main")
    if not victims:
        msg = f"no {kill.kind} process to kill"
        raise RuntimeError(msg)
    victim = random.choice(victims)
    victim.kill()
    kill.pid = int(victim.pid)


def start_job(job: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``streamrec run JOB`` in a session of its own, its output in ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "run", str(job)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def group_source(broker: Broker, topic: str) -> Any:
    """A source on ``topic`` in the job's consumer group (its committed offsets)."""
    from connectors.kafka import KafkaSource, KafkaSourceConfig

    return KafkaSource(
        KafkaSourceConfig(
            bootstrap_servers=broker.bootstrap,
            topics=[topic],
            group_id="chaos",
            api_version=broker.api_version,
        )
    )


def catch_up(
    job: subprocess.Popen[bytes], run_dir: Path, ends: dict[str, int], timeout_s: float
) -> None:
    """Until the job has learned up to ``ends`` (or exited, or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.poll() is None:
        if learned_count(run_dir) >= sum(ends.values()):
            return
        time.sleep(0.5)


def interrupt(job: subprocess.Popen[bytes]) -> int:
    """Ctrl-C (SIGINT: a last checkpoint, offsets committed); its exit code."""
    if job.poll() is None:
        job.send_signal(signal.SIGINT)
    try:
        return job.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.wait()


def count_offsets(run_dir: Path, ends: dict[str, int]) -> dict[str, int]:
    import numpy as np

    from trainer.ledger import learned_ranges

    ranges = learned_ranges(*sorted(run_dir.glob("learned-rank*.log")))
    once = twice = never = 0
    for partition, end in ends.items():
        covered = np.zeros(end, dtype=np.int64)
        for s, e in ranges.get(partition, []):
            covered[s:e] += 1
        once += int((covered == 1).sum())
        twice += int((covered >= 2).sum())
        never += int((covered == 0).sum())
    return {"learned_once": once, "learned_twice": twice, "never_learned": never}


@dataclass
class Chaos:
    """One run: its options, the processes it plays the supervisor of, the kills so far."""

    args: argparse.Namespace
    work: Path
    kafka: Broker
    topic: str = "chaos"
    job: Path | None = None  # the job file
    job_proc: subprocess.Popen[bytes] | None = None
    producer: Producer | None = None
    serving: Serving | None = None
    dask: ExternalDask | None = None
    started: float = 0.0  # when the job started (time.monotonic())
    kinds: tuple[str, ...] = ()
    kills: list[Kill] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    @property
    def log_path(self) -> Path:
        return self.work / "job.log"

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.job_proc is not None
        return self.job_proc


def start_all(c: Chaos) -> None:
    """The topic, the producer, the Dask cluster (``--scheduler external``) and the job,
    until the job trains; then the serving side (``--serve``)."""
    args = c.args
    c.kafka.create_topic(c.topic, partitions=2)
    c.producer = Producer(c.kafka, c.topic, args.rate, args.seed)
    c.producer.start()
    if args.scheduler == "external":
        c.dask = ExternalDask(c.work, workers=2)
    c.job = write_job(
        c.work,
        c.kafka.bootstrap,
        c.topic,
        args.batch_size,
        c.kafka.api_version,
        args.ranks,
        c.dask.address if c.dask is not None else None,
    )
    c.job_proc = start_job(c.job, c.log_path)
    c.started = time.monotonic()
    while learned_count(c.run_dir) == 0:  # until the job trains
        if c.job_proc.poll() is not None or time.monotonic() - c.started > 300:
            msg = f"the job did not start training; see {c.log_path}"
            raise RuntimeError(msg)
        time.sleep(0.5)
    if args.serve:
        found = re.search(r"store: (grpc://\S+)", c.log_path.read_text(errors="replace"))
        if found is None:
            msg = f"the job printed no store address; see {c.log_path}"
            raise RuntimeError(msg)
        c.serving = Serving(
            c.job, found.group(1), c.run_dir / "store.token", c.work, args.requests_per_s
        )


def victim_kinds(c: Chaos) -> tuple[str, ...]:
    """What may be killed: ``--victims``, else every kind this run has."""
    args = c.args
    default = (*KINDS, *(("replica",) if args.serve else ()))
    default += ("trainer",) if args.ranks > 1 else ()
    default += ("scheduler",) if c.dask is not None else ()
    kinds = tuple(args.victims or default)
    if "replica" in kinds and not args.serve:
        msg = "--victims replica needs --serve (there are no replicas otherwise)"
        raise SystemExit(msg)
    if "scheduler" in kinds and c.dask is None:
        msg = "--victims scheduler needs --scheduler external (the job's own dies with it)"
        raise SystemExit(msg)
    if "trainer" in kinds and args.ranks < 2:
        msg = "--victims trainer needs --ranks 2 or more (rank 0 is the job itself)"
        raise SystemExit(msg)
    return kinds


def note_recoveries(c: Chaos, pending: list[Kill], now: float, learned: int) -> None:
    """A pending kill is over once the job learns more after it (and, for the kinds that
    roll back, after its rollback)."""
    rollbacks = rollback_count(c.run_dir)
    for k in pending:
        if k.kind == "replica":
            continue  # its supervisor times it: until it has caught up again
        if k.kind in ROLLBACK_KINDS and rollbacks > k.rollbacks_at_kill:
            k.ready = True
        if k.ready and learned > k.learned_at_kill:
            k.recovery_s = now - c.started - k.at_s
            print(f"  {k.kind} kill at {k.at_s:.0f}s: recovered in {k.recovery_s:.1f}s")


def kill_next(c: Chaos, bag: list[str], learned: int) -> None:
    """Kill one component of the next kind in ``bag`` (refilled, shuffled, when empty)."""
    if not bag:
        bag.extend(random.sample(c.kinds, len(c.kinds)))
    kill = Kill(bag.pop(), time.monotonic() - c.started, 0, learned)
    kill.rollbacks_at_kill = rollback_count(c.run_dir)
    # Steps already under way may still be learned before the job notices
    # the lost shard; they are rolled back and do not count as recovery.
    kill.ready = kill.kind not in ROLLBACK_KINDS
    if kill.kind == "replica":
        assert c.serving is not None
        c.serving.kill_replica(kill, c.args.outage_s, c.started)
    else:
        kill_one(kill, c.proc, c.kafka, c.args.outage_s, c.run_dir, c.dask)
    c.kills.append(kill)
    print(f"killed the {kill.kind} (pid {kill.pid}) at {kill.at_s:.0f}s")


def kill_phase(c: Chaos) -> None:
    """A kill every ``--kill-every-s``, one component down at a time, for ``--minutes``
    (or until ``--kills`` kills have all recovered)."""
    args = c.args
    bag: list[str] = []
    until = time.monotonic() + args.minutes * 60
    next_kill = time.monotonic() + args.kill_every_s
    # After the last kill too, the producer writes on until the job has recovered
    # from it: stopped at once, a job that had learned every record so far had
    # nothing left to learn, and its last recovery went uncounted.
    while time.monotonic() < until and (
        args.kills is None
        or len(c.kills) < args.kills
        or any(k.recovery_s is None for k in c.kills)
    ):
        if c.proc.poll() is not None:
            break  # the job died: a failure the figures show (manual_restarts stays 0)
        now = time.monotonic()
        pending = [k for k in c.kills if k.recovery_s is None]
        learned = learned_count(c.run_dir)
        note_recoveries(c, pending, now, learned)
        # One component down at a time: the next kill waits for the last recovery.
        more = args.kills is None or len(c.kills) < args.kills
        if now >= next_kill and not pending and more:
            kill_next(c, bag, learned)
            next_kill = time.monotonic() + args.kill_every_s
        time.sleep(0.25)


def end_phase(c: Chaos) -> dict[str, Any]:
    """The producer stopped, the job caught up and interrupted; every figure."""
    assert c.producer is not None
    c.producer.stopped.set()
    c.producer.join(timeout=60)
    # Let the last recovery finish and the job catch up with the topic's end.
    src = group_source(c.kafka, c.topic)
    ends = {p: src.end_position(p) for p in src.partitions()}
    catch_up(c.proc, c.run_dir, ends, c.args.catch_up_s)
    now = time.monotonic()
    for k in c.kills:
        if k.kind == "replica":
            continue
        if k.recovery_s is None and k.ready and learned_count(c.run_dir) > k.learned_at_kill:
            k.recovery_s = now - c.started - k.at_s
    serve_figures = {}
    if c.serving is not None:
        c.serving.close()
        serve_figures = c.serving.figures()
        c.serving = None
    exit_code = interrupt(c.proc)
    committed = {p: src.committed(p) for p in ends}
    src.close()
    return {
        **figures_of(c, ends, committed, exit_code),
        "kill_log": [asdict(k) for k in c.kills],
        **serve_figures,
    }


def figures_of(
    c: Chaos, ends: dict[str, int], committed: dict[str, int | None], exit_code: int
) -> dict[str, Any]:
    """The run's figures from the ledgers, the job's output and the kills."""
    args = c.args
    output = c.log_path.read_text(errors="replace")
    stop = re.findall(r"stopped by (\S+)", output)
    rollbacks = re.findall(r"recovered (\d+) time\(s\)", output)
    restarts = re.findall(r"started the trainer ranks again (\d+) time\(s\)", output)
    recovered = [k.recovery_s for k in c.kills if k.recovery_s is not None]
    assert c.producer is not None
    return {
        "produced": sum(ends.values()),
        **count_offsets(c.run_dir, ends),
        "kills": len(c.kills),
        "kills_by_kind": {kind: sum(k.kind == kind for k in c.kills) for kind in c.kinds},
        "recoveries": len(recovered),
        "recovery_s_p50": round(statistics.median(recovered), 2) if recovered else None,
        "recovery_s_max": round(max(recovered), 2) if recovered else None,
        "job_rollbacks": int(rollbacks[-1]) if rollbacks else 0,
        "rank_restarts": int(restarts[-1]) if restarts else 0,
        # Every start from a checkpoint after the first: rollbacks and rank restarts.
        "ledger_rollbacks": max(0, rollback_count(c.run_dir) - 1),
        "ranks": args.ranks,
        "scheduler": args.scheduler,
        "committed_equals_end": committed == ends,
        "manual_restarts": 0,
        "stop_reason": stop[-1] if stop else None,
        "exit_code": exit_code,
        "producer_retries": c.producer.errors,
        "minutes": args.minutes,
        "kill_every_s": args.kill_every_s,
        "broker": args.broker,
        "work_dir": str(c.work),
    }


def stop_all(c: Chaos) -> None:
    """Whatever is still running, however the run ended."""
    if c.serving is not None:
        c.serving.close()
    if c.producer is not None:
        c.producer.stopped.set()
    if c.job_proc is not None:
        # Orphaned Dask workers of a job that was killed keep its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.job_proc.pid, signal.SIGKILL)
    if c.dask is not None:
        c.dask.kill()
    c.kafka.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(args.seed)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="streamrec-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    c = Chaos(args, work, Broker(args.broker, work))
    try:
        start_all(c)
        c.kinds = victim_kinds(c)
        kill_phase(c)
        figures = end_phase(c)
        print_figures({k: v for k, v in figures.items() if k != "kill_log"}, str)
        if args.json is not None:
            write_json(args.json, figures, announce=True)
        return 0
    finally:
        stop_all(c)


if __name__ == "__main__":
    sys.exit(main())
