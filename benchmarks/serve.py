"""Serving: `streamrec serve`'s latency, throughput and freshness, and what it costs training.

    python benchmarks/serve.py --json bench-results/serve.json     # the full run (~8 minutes)
    python benchmarks/serve.py --smoke --json /tmp/serve.json      # every figure, tiny sizes

Real processes throughout, on loopback, as a user deploys them: ``--shards``
training store shards (``streamrec store serve``), one serving replica per
shard following it (``streamrec store replica --follow``, polling every 0.5 s),
``streamrec serve JOB --store grpc://REPLICAS --port 0`` as a subprocess (with
``--rows follow``: no replica processes, ``streamrec serve JOB --follow
grpc://SHARDS``, replicas in the server's process), and
the hybrid job on the synthetic Criteo-like stream (``streamrec run`` of a job
with ``source: {kind: synthetic}``, ``cluster.store`` naming the training
shards, checkpoints off, ``serving.dir`` where the server reads; the demo's
model: 26 tables of dim 16, FFNN 512-256, batch 4096). The client is the real
one, ``tritonclient.http`` (one ``InferenceServerClient`` per thread), with its
default binary tensor extension for every figure (``tensor_encoding`` in the
JSON); ``json_mode`` holds batch-64 latencies with JSON tensors for comparison.
Requests carry the stream's own records (their labels dropped).

In the order they run:

1. **While training** (``*_while_training``): the job trains the endless stream
   at full speed (its first steps are also what trains the served model); once
   it reports samples, the figures of 2 and 3 below are taken with it running.
   For the sparse stamp, records whose sparse values are strings the stream
   never generates, so that training never moves those rows; as the job
   publishes dense weights every second, a response on another dense version
   than the one before the push is compared with this process's own forward of
   that version over the rows as they were before the push (the server's
   forward agrees with it to 1e-5). Dense freshness is taken on the job's own
   publishes (rank 0's ``DensePublisher``, every second): from each publish to
   the first response naming that version. (A second publisher into the job's
   location would write version numbers that rank 0 writes again after it: each
   counts on from what it found when it started.) The job is then stopped.
2. **Server alone** (no training): batch 1, 64 and 512 records per request,
   sequential requests for ``--seconds`` each: p50/p99 latency and requests/s;
   batch 512 again from 2 and 4 client threads; then a sweep at batch 1 with
   1, 2, 4 and 8 client threads. ``requests_per_s_batch1`` and
   ``samples_per_s_batch512`` are the best levels of their sweeps (a lone
   client alternates with the server and keeps about one core busy). Then
   the ceiling (``ceiling`` in the JSON): the same batch-1 figures against the
   same server code with a model that costs nothing (``--constant-server``, a
   process of its own), what HTTP and the client leave of this machine;
   ``requests_per_s_batch1_vs_ceiling`` is the model's share of it.
3. **Sparse freshness**: for each of ``--sparse-repeats`` records, its ids as
   the training path hashes them (the job's codec and ``build_batch``) are
   looked up on the training shards with ``train=True`` (the rows exist), the
   server's answer is taken, then a gradient of 50 is pushed on every row of
   the record; ``t0`` is when the push is acknowledged, ``t1`` when a response
   of the server to that record first differs. **Dense freshness**: for each of
   ``--dense-repeats``, the served weights scaled by 1.01 (or back) are
   published with ``DensePublisher`` into the job's serving location; from the
   publish call's start to the first response naming the new ``dense_version``.
4. **Training slowdown**: the same job on the same ``--samples`` events, with
   and without 100 requests/s of batch 64 sent through the server on a fixed
   schedule (four client threads, so that the rate holds while a request takes
   longer than 10 ms; ``load_requests_per_s_achieved`` says what was sent; the
   requests are tritonclient's bodies encoded once, sent over kept-alive sockets,
   so that the client takes little of the cores it shares with the job:
   ``load_client_cores``),
   alternated over ``--repeat`` rounds (the order flips each round);
   ``training_slowdown`` is the median samples/s with load over the median
   without. Samples/s as ``benchmarks/e2e.py`` reads it from the job's metrics
   file: from its first progress report to its last (start-up left out). The
   control, ``training_slowdown_burner``: the same job beside a process that
   only spins, for the CPU time the load cost the server
   (``serving_load_cores``: the server's cores with load less its cores
   without) every 10 ms (``burner_cores``: what it took), which tells the
   cost of that CPU share from the rest of what serving does to the job.

Per-core figures divide by ``os.cpu_count()`` (``cpus`` in the JSON). On a
2-core machine every process above shares the same two cores: the client too.
So ``*_per_server_core`` divides instead by the cores the server's own processes
(``streamrec serve``, and its replicas with ``--rows replicas``) kept busy at
the sweep's best level, from their CPU time: what a core gives a server whose
clients run elsewhere, as they do in a deployment (each sweep level's
``server_cores`` is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_figures, shared_dask, wait_all, write_json, write_token
from e2e import load, measured_rate, read_metrics

from deploy.local.parent_death import with_parent_death
from trainer.run_files import read_lines

if TYPE_CHECKING:
    from deploy.config import JobConfig
    from embedding_store.client import StoreClient
    from serving.model import ServingModel

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "streamrec"  # serving.model_name's default
HEAD = "click"
SEED = 0
PARTITIONS = 2
DIM = 16
HIDDEN = [512, 256]
BATCH = 4096
BATCH_SIZES = (1, 64, 512)
SWEEP = (1, 2, 4, 8)
# Batch-512 throughput also from concurrent clients: one client alternates with the
# server, so it keeps about one core busy, and samples/s per core needs them all.
SWEEP_512 = (2, 4)
LOAD_RPS = 100.0
LOAD_BATCH = 64
PUSH_GRAD = 50.0
STAMP_STEP = 1_000_000_000  # the step our own dense publishes carry, to tell them apart
TENSOR_ENCODING = "binary (tritonclient.http binary_data=True, its default)"

# key -> (comparison, bound). Per-core figures divide by os.cpu_count().
TARGETS: dict[str, tuple[str, float]] = {
    "p99_ms_batch1": ("<=", 5.0),
    "requests_per_s_batch1_per_core": (">=", 1000.0),
    "samples_per_s_batch512_per_core": (">=", 25_000.0),
    "sparse_freshness_s_p99": ("<=", 2.0),
    "dense_freshness_s_p99": ("<=", 5.0),
    "sparse_freshness_s_p99_while_training": ("<=", 2.0),
    "dense_freshness_s_p99_while_training": ("<=", 5.0),
    "training_slowdown": (">=", 0.9),
}

_URL = re.compile(r"on http://(?P<host>[\d.]+):(?P<port>\d+) ")
_SUMMARY = re.compile(r"trained ([\d,]+) samples in \d+ steps, [\d.]+s \(([\d,]+) samples/s")


def say(text: str) -> None:
    print(text, flush=True)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            msg = f"{what}: not within {timeout_s:.0f}s"
            raise TimeoutError(msg)
        time.sleep(0.05)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# --- the job and its processes ---------------------------------------------------------


def write_job(
    tmp: Path,
    name: str,
    *,
    store: str,
    shards: int,
    token_file: Path,
    events: int | None,
    hidden: list[int],
    scheduler: str | None = None,
) -> Path:
    """``tmp/<name>.yaml``: the demo's hybrid job over the shards at ``store``.

    Every job of the run shares the serving location (``tmp/serving``) and the
    checkpoint folder (checkpoints are off); each has a run directory of its own
    (metrics files are appended to). ``events``: in all (None: endless).
    ``scheduler``: a Dask cluster the job names instead of starting its own.
    """
    import yaml

    from deploy.cli.train import demo_job
    from deploy.config import JobConfig

    raw = demo_job(
        tmp / "runs" / name, events=events or 1, partitions=PARTITIONS, seed=SEED, dim=DIM
    ).model_dump(mode="json")
    raw["source"] = {
        **raw["source"],
        "events": None if events is None else -(-events // PARTITIONS),
        "deadletter": "none",
    }
    raw["trainer"] = {
        **raw["trainer"],
        "mode": "hybrid",
        "batch_size": BATCH,
        "log_every_s": 1.0,
        "model": {"kind": "ffnn", "hidden": hidden},
        "checkpoint": {"enabled": False, "on_exit": False, "dir": str(tmp / "checkpoints")},
    }
    raw["cluster"] = {
        **raw["cluster"],
        "store": store,
        "store_shards": shards,
        "token_file": str(token_file),
        "dashboard_address": ":0",
    }
    if scheduler is not None:
        raw["cluster"]["scheduler"] = scheduler
    raw["serving"] = {**raw["serving"], "publish_every_s": 1.0, "dir": str(tmp / "serving")}
    JobConfig.model_validate(raw)  # refuse here, not in a subprocess
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class Server:
    """A running ``streamrec serve`` and its log."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                with_parent_death(argv, signal.SIGTERM),
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for(
            lambda: _URL.search(self.log()) is not None or self.proc.poll() is not None,
            "streamrec serve printing its URL",
        )
        m = _URL.search(self.log())
        if m is None:
            msg = f"streamrec serve exited ({self.proc.returncode}):\n{self.log()[-3000:]}"
            raise RuntimeError(msg)
        self.address = f"{m.group('host')}:{m.group('port')}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class TrainingRun:
    """``streamrec run JOB`` in a subprocess; its rate read from its metrics file."""

    def __init__(self, job_file: Path, max_events: int | None) -> None:
        import yaml

        run_dir = Path(yaml.safe_load(job_file.read_text())["run_dir"])
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.with_name(run_dir.name + ".log")
        argv = [sys.executable, "-m", "deploy.cli", "run", str(job_file)]
        if max_events is not None:
            argv += ["--max-events", str(max_events)]
        self.started = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                with_parent_death(argv, signal.SIGTERM),
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def reports(self) -> list[dict[str, Any]]:
        """Rank 0's progress reports so far (a line being written is left out)."""
        path = self.run_dir / "metrics-rank0.jsonl"
        out = []
        for line in read_lines(path):
            try:
                out.append(json.loads(line))
            except ValueError:
                break
        return out

    def training(self, reports: int = 2) -> bool:
        """True once ``reports`` progress reports with samples have come (it trains)."""
        if self.proc.poll() is not None:
            msg = f"streamrec run exited ({self.proc.returncode}):\n{self.log()[-3000:]}"
            raise RuntimeError(msg)
        return sum(1 for r in self.reports() if r["samples"] > 0) >= reports

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM: the job finishes its step and exits (checkpoints are off)."""
        from deploy.local.shards import terminate

        return terminate(self.proc, timeout_s)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            msg = f"streamrec run did not end within {timeout_s:.0f}s"
            raise TimeoutError(msg) from None
        if code != 0:
            msg = f"streamrec run exited ({code}):\n{self.log()[-3000:]}"
            raise RuntimeError(msg)
        return code

    def rate(self) -> dict[str, Any]:
        """samples/s: the metrics file's (first report to last), else the summary's overall."""
        m = _SUMMARY.search(self.log())
        overall = float(m.group(2).replace(",", "")) if m else 0.0
        return rate_of(self.run_dir, overall)


class InProcessRun:
    """The same job run by ``deploy.job.run_job`` in this process (``--in-process-jobs``):
    no interpreter to start and no imports to make, which take longer than a short run's
    training. ``wait`` runs it; ``rate`` reads its metrics file as :class:`TrainingRun`
    does."""

    def __init__(self, job_file: Path, max_events: int | None) -> None:
        from deploy.config import load_config

        self.job = load_config(job_file)
        self.run_dir = Path(self.job.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.max_events = max_events
        self.overall = 0.0

    def wait(self, timeout_s: float) -> int:
        """Run the job to its end (``timeout_s`` is the subprocess's; unused here)."""
        from deploy.job import run_job

        stats, _ = run_job(self.job, max_events=self.max_events)
        elapsed = stats.elapsed()
        self.overall = stats.samples / elapsed if elapsed > 0 else 0.0
        return 0

    def rate(self) -> dict[str, Any]:
        """samples/s: the metrics file's (first report to last), else the run's overall."""
        return rate_of(self.run_dir, self.overall)


def rate_of(run_dir: Path, overall: float) -> dict[str, Any]:
    """A job's samples/s from its metrics files (first report to last); ``overall``, the
    whole run's, where it made fewer than two reports."""
    lines = read_metrics(run_dir)
    out: dict[str, Any] = {"overall_samples_per_s": overall}
    if 0 in lines:
        rate, median, timed_samples, timed_s, total = measured_rate(lines)
        out |= {
            "metrics_samples_per_s": round(rate, 1),
            "median_interval_samples_per_s": round(median, 1),
            "timed_samples": timed_samples,
            "timed_s": round(timed_s, 2),
            "samples": total,
        }
    # Too short a run for two reports (the smoke test): the summary's overall rate.
    out["samples_per_s"] = out.get("metrics_samples_per_s") or overall
    out["from"] = "metrics" if out.get("metrics_samples_per_s") else "summary"
    return out


# --- requests ---------------------------------------------------------------------------


def stream_records(n: int, partition: int = 1) -> list[bytes]:
    """``n`` records of the job's stream (the same world of ids), labels dropped."""
    from connectors.synthetic import SyntheticConfig, iter_json_lines

    out = []
    config = SyntheticConfig(seed=SEED, partitions=PARTITIONS)
    for line in iter_json_lines(config, n, partition=partition):
        record = json.loads(line)
        record.pop(HEAD)
        out.append(json.dumps(record).encode())
    return out


def stamp_records(n: int) -> list[bytes]:
    """Records whose every sparse value is a string the stream never generates (it
    generates 8 hex digits): rows no training step touches."""
    from connectors.synthetic import synthetic_feature_spec

    sparse = [f.name for f in synthetic_feature_spec().sparse]
    out = []
    for i, line in enumerate(stream_records(n, partition=0)):
        record = json.loads(line)
        for name in sparse:
            record[name] = f"serve-bench-{os.getpid()}-{i}-{name}"
        out.append(json.dumps(record).encode())
    return out


@dataclass
class Request:
    """One prepared infer request (its tensors are reused)."""

    records: list[bytes]
    inputs: list[Any]
    outputs: list[Any]


def make_request(records: list[bytes], binary: bool = True) -> Request:
    import tritonclient.http as triton

    inp = triton.InferInput("records", [len(records)], "BYTES")
    inp.set_data_from_numpy(np.array(records, dtype=np.object_), binary_data=binary)
    return Request(records, [inp], [triton.InferRequestedOutput(HEAD, binary_data=binary)])


def requests_of(records: list[bytes], batch: int, count: int, binary: bool = True) -> list[Request]:
    """``count`` requests of ``batch`` records each, taken in turn from ``records``."""
    out = []
    for i in range(count):
        start = (i * batch) % max(1, len(records) - batch + 1)
        out.append(make_request(records[start : start + batch], binary))
    return out


def client_for(address: str) -> Any:
    """A ``tritonclient.http.InferenceServerClient`` (one per thread)."""
    import tritonclient.http as triton

    return triton.InferenceServerClient(address, connection_timeout=30.0, network_timeout=60.0)


def infer(client: Any, req: Request) -> tuple[np.ndarray, dict[str, Any]]:
    result = client.infer(MODEL, req.inputs, outputs=req.outputs)
    return result.as_numpy(HEAD), result.get_response().get("parameters", {})


def sequential(
    address: str, reqs: list[Request], seconds: float, warmup: int = 5
) -> dict[str, Any]:
    """Requests one after the other for ``seconds``: latencies (ms) and requests/s."""
    client = client_for(address)
    try:
        for i in range(warmup):
            infer(client, reqs[i % len(reqs)])
        lat = []
        t0 = time.perf_counter()
        end = t0 + seconds
        i = 0
        while True:
            ta = time.perf_counter()
            if ta >= end and i >= 3:
                break
            client.infer(MODEL, reqs[i % len(reqs)].inputs, outputs=reqs[i % len(reqs)].outputs)
            lat.append(time.perf_counter() - ta)
            i += 1
        elapsed = time.perf_counter() - t0
    finally:
        client.close()
    ms = [x * 1000 for x in lat]
    return {
        "requests": len(lat),
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        "mean_ms": statistics.fmean(ms),
        "requests_per_s": len(lat) / elapsed,
    }


def cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user and system, every thread) the processes ``pids`` used so far."""
    import psutil

    total = 0.0
    for pid in pids:
        with suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def concurrent(
    address: str,
    reqs: list[Request],
    threads: int,
    seconds: float,
    server_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """``threads`` client threads, each with its own client, for ``seconds``.

    ``server_cores``: the cores the processes ``server_pids`` (the server, its replicas)
    kept busy meanwhile; the rest of the machine went to the clients."""
    barrier = threading.Barrier(threads + 1)
    lat: list[list[float]] = [[] for _ in range(threads)]
    ends = [0.0] * threads
    errors: list[BaseException] = []

    def work(k: int) -> None:
        client = client_for(address)
        try:
            for i in range(3):
                infer(client, reqs[(k + i) % len(reqs)])
            barrier.wait()
            end = time.perf_counter() + seconds
            i = k
            mine = lat[k]
            while True:
                ta = time.perf_counter()
                if ta >= end and len(mine) >= 3:
                    break
                req = reqs[i % len(reqs)]
                client.infer(MODEL, req.inputs, outputs=req.outputs)
                mine.append(time.perf_counter() - ta)
                i += 1
            ends[k] = time.perf_counter()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            client.close()

    pool = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    with suppress(threading.BrokenBarrierError):
        barrier.wait()
    t0 = time.perf_counter()
    cpu0 = cpu_s(server_pids)
    for t in pool:
        t.join()
    cpu1 = cpu_s(server_pids)
    if errors:
        raise errors[0]
    elapsed = max(ends) - t0
    ms = [x * 1000 for per in lat for x in per]
    return {
        "threads": threads,
        "requests_per_s": len(ms) / elapsed,
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        # the last thread's end is where both reads were taken, near enough
        "server_cores": (cpu1 - cpu0) / (time.perf_counter() - t0) if server_pids else None,
    }


class Load:
    """Sends ``rate`` requests/s until stopped: an open schedule (a request every
    ``1 / rate`` seconds, never bursting to catch up) served by ``senders`` threads,
    each with its own connection, so that the rate holds while a request takes longer
    than the period (one sequential client sent 46 of 100 requests/s of batch 64
    beside training, where a request took 22 ms).

    The requests are tritonclient's own bodies (``generate_request_body`` of each
    ``Request``), encoded once and sent over kept-alive sockets, the answer's status
    and length checked: the load shares this machine's cores with the job it is
    measured against, where a deployment's clients would not, and tritonclient
    encoding and decoding every request took 0.05 of a core beside training (a
    quarter of what the server took). A sender reads a request's answer when its next
    turn comes, before sending again (a thread's turns are ``senders`` periods apart),
    so that it wakes once per request, not twice; the latency is from before the send
    to when the kernel received the answer (``SO_TIMESTAMPNS``), with no wake-up of
    the client in it. ``client_cores`` in the result: the senders' own CPU time over
    the run.
    """

    def __init__(self, address: str, reqs: list[Request], rate: float, senders: int = 4) -> None:
        import tritonclient.http as triton

        self.address, self.rate = address, rate
        self.wire: list[bytes] = []
        for req in reqs:
            body, json_size = triton.InferenceServerClient.generate_request_body(
                req.inputs, outputs=req.outputs
            )
            head = (
                f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: {address}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
            )
            if json_size is not None:
                head += f"Inference-Header-Content-Length: {json_size}\r\n"
            self.wire.append(head.encode() + b"\r\n" + body)
        self.stop_event = threading.Event()
        self.lat: list[float] = []
        self.errors = 0
        self.elapsed = 0.0
        self.cpu_s = 0.0
        self._lock = threading.Lock()
        self._t0 = self._next = 0.0  # set when started
        self._sent = 0
        self._threads = [
            threading.Thread(target=self._send, name=f"serve-load-{k}", daemon=True)
            for k in range(senders)
        ]

    def start(self) -> None:
        self._t0 = self._next = time.perf_counter()
        for t in self._threads:
            t.start()

    def _slot(self) -> tuple[float, int]:
        """The next send time and request; a slot more than a period late is dropped."""
        period = 1.0 / self.rate
        with self._lock:
            slot = max(self._next, time.perf_counter() - period)
            self._next = slot + period
            self._sent += 1
            return slot, self._sent

    def _send(self) -> None:
        cpu0 = time.thread_time()
        sock = self._connect()
        buffer = bytearray(1 << 16)
        sent: float | None = None  # when the request not yet read back was sent (epoch s)
        try:
            while not self.stop_event.is_set():
                slot, i = self._slot()
                wait = slot - time.perf_counter()
                if wait > 0:
                    # A plain sleep: an Event's wait runs a Condition's Python on every
                    # request, on the cores the job trains on.
                    time.sleep(wait)
                    if self.stop_event.is_set():
                        break
                try:
                    if sent is not None:
                        # The last answer, read at this send rather than when it came:
                        # one wake-up per request, its latency from the kernel's stamp.
                        self._answered(sock, buffer, sent)
                    sent = time.time()
                    sock.sendall(self.wire[i % len(self.wire)])
                except (OSError, ValueError):
                    with self._lock:
                        self.errors += 1
                    sent = None
                    sock.close()
                    sock = self._connect()
            if sent is not None:
                self._answered(sock, buffer, sent)
        except (OSError, ValueError):
            with self._lock:
                self.errors += 1
        finally:
            sock.close()
            with self._lock:
                self.cpu_s += time.thread_time() - cpu0

    def _answered(self, sock: socket.socket, buffer: bytearray, sent: float) -> None:
        arrived = _read_answer(sock, buffer)
        with self._lock:
            self.lat.append(arrived - sent)

    def _connect(self) -> socket.socket:
        host, _, port = self.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)  # each read's arrival time
        return sock

    def finish(self) -> dict[str, Any]:
        self.stop_event.set()
        for t in self._threads:
            t.join()
        self.elapsed = time.perf_counter() - self._t0
        ms = [x * 1000 for x in self.lat]
        return {
            "requests": len(ms),
            "errors": self.errors,
            "requests_per_s": len(ms) / self.elapsed if self.elapsed else 0.0,
            "p50_ms": pct(ms, 50) if ms else None,
            "p99_ms": pct(ms, 99) if ms else None,
            "client_cores": self.cpu_s / self.elapsed if self.elapsed else 0.0,
        }


# Linux's SO_TIMESTAMPNS (and SCM_TIMESTAMPNS): reads return when the kernel received
# their bytes, as a struct timespec of the real-time clock.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")


def _read_answer(sock: socket.socket, buffer: bytearray) -> float:
    """Read one HTTP/1.1 answer with a Content-Length; when its last bytes reached this
    host (the kernel's stamp, epoch seconds; now, where there is none). ValueError
    unless it is a 200."""
    view = memoryview(buffer)
    got, need = 0, -1
    while need < 0 or got < need:
        if got == len(buffer):
            msg = f"an answer over {len(buffer)} bytes"
            raise ValueError(msg)
        n, ancillary, _, _ = sock.recvmsg_into([view[got:]], 64)
        if n == 0:
            msg = "the server closed the connection"
            raise ValueError(msg)
        arrived = 0.0
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                sec, nsec = _TIMESPEC.unpack(data[: _TIMESPEC.size])
                arrived = sec + nsec * 1e-9
        got += n
        if need < 0:
            end = buffer.find(b"\r\n\r\n", 0, got)
            if end < 0:
                continue
            head = bytes(buffer[:end]).lower()
            if not head.startswith(b"http/1.1 200 "):
                msg = f"answered {head[:40]!r}"
                raise ValueError(msg)
            match = re.search(rb"\r\ncontent-length: *(\d+)", head)
            if match is None:
                msg = "an answer without a Content-Length"
                raise ValueError(msg)
            need = end + 4 + int(match.group(1))
    return arrived or time.time()


# --- freshness --------------------------------------------------------------------------


class FrozenRows:
    """A ``RowReader`` of one record's rows as they were (the ids must be the same)."""

    def __init__(self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.rows = dict(rows)

    def lookup(self, ids: Mapping[str, Any], *, train: bool = False) -> dict[str, np.ndarray]:
        out = {}
        for table, wanted in ids.items():
            have, rows = self.rows[table]
            if not np.array_equal(np.asarray(wanted, dtype=np.uint64), have):
                msg = f"table {table}: not the ids of the record"
                raise KeyError(msg)
            out[table] = rows
        return out


class LocalForward:
    """This process's forward of a published dense version over given rows: what the
    server answers for a record with those rows on that version."""

    def __init__(self, job: JobConfig) -> None:
        from connectors.codecs import make_codec
        from deploy.job import build_codec, serving_location

        assert job.features is not None
        self.job = job
        self.spec = job.features
        self.codec = build_codec(job) or make_codec("json")
        self.location = serving_location(job)
        self.dims = {n: t.dim for n, t in job.store.tables.items()}
        self._versions: dict[int, Any] = {}

    def version(self, v: int) -> Any:
        """The loaded ``DenseVersion`` numbered ``v`` (None when it is gone)."""
        from serving.model import DenseVersion, inference_module
        from trainer.publish import load_weights, published

        if v not in self._versions:
            entry = next((e for e in published(self.location) if e.version == v), None)
            if entry is None:
                return None
            try:
                state = load_weights(self.location, entry)
            except FileNotFoundError:
                return None  # deleted (keep) between the listing and the read
            module = inference_module(self.job.trainer, self.spec, self.dims, state)
            self._versions[v] = DenseVersion(entry, module)
        return self._versions[v]

    def predict(self, record: bytes, rows: FrozenRows, v: int) -> float | None:
        from serving.model import FixedDense, ServingModel

        version = self.version(v)
        if version is None:
            return None
        model: ServingModel = ServingModel(
            "local", self.spec, self.codec, rows, FixedDense(version)
        )
        return float(model.predict([record]).probabilities[HEAD][0])


def record_ids(job: JobConfig, record: bytes) -> dict[str, np.ndarray]:
    """The record's ids per table, hashed by the training path's own code."""
    from connectors.codecs import make_codec
    from connectors.types import Chunk, RawChunk
    from deploy.job import build_codec
    from pipeline.batch import build_batch

    assert job.features is not None
    spec = job.features.for_scoring()
    codec = build_codec(job) or make_codec("json")
    raw = RawChunk(Chunk("s", "p", 0, 1), np.arange(1), [record])
    table, bad = codec.decode(raw, spec)
    if bad:
        msg = f"bad stamp record: {bad[0]}"
        raise ValueError(msg)
    batch = build_batch(table, spec)
    return {t: tb.unique_ids for t, tb in batch.tables.items()}


@dataclass
class Stamp:
    """One stamped record's poll: its times and what it found."""

    seconds: float  # from the push's acknowledgement to every pushed row served
    first_change: float  # ... to some row served
    effect: float | None  # how far the push moved the prediction (None: timed out)
    polls: int
    swaps: int  # dense versions swapped in meanwhile
    timed_out: bool
    check: float | None  # |server - local| on the version before the push


def stamp_once(
    client: Any,
    store: StoreClient,
    job: JobConfig,
    local: LocalForward,
    record: bytes,
    timeout_s: float,
) -> Stamp:
    """Push on ``record``'s rows in the training shards and poll the server until its
    answer is this process's forward over the pushed rows (see :func:`sparse_freshness`)."""
    ids = record_ids(job, record)
    rows = store.lookup(ids, train=True)  # as a training step does: rows are made
    before = FrozenRows({t: (ids[t], np.asarray(rows[t])) for t in ids})
    req = make_request([record])
    p0, params0 = infer(client, req)
    d0 = params0["dense_version"]
    old: dict[int, float | None] = {d0: float(p0[0])}
    new: dict[int, float | None] = {}
    grads = {
        t: (ids[t], np.full((ids[t].shape[0], store.dims[t]), PUSH_GRAD, np.float32)) for t in ids
    }
    result = store.push(grads, return_rows=True)
    t0 = time.perf_counter()
    assert result.rows is not None
    after = FrozenRows({t: (ids[t], result.rows[t].weights.astype(store.row_dtype)) for t in ids})
    first: float | None = None
    n = swaps = 0
    while True:
        p, params = infer(client, req)
        t1 = time.perf_counter()
        n += 1
        served = float(p[0])
        d = params["dense_version"]
        if d not in old:
            swaps += 1
            old[d] = local.predict(record, before, d)
        if d not in new:
            new[d] = local.predict(record, after, d)
        o, w = old[d], new[d]
        if o is not None and first is None and abs(served - o) > (1e-6 if d == d0 else 1e-5):
            first = t1 - t0
        # The push moves the answer by far more than the 1e-5 they agree to.
        if (
            o is not None
            and w is not None
            and first is not None
            and abs(served - w) <= 1e-5 < abs(w - o) / 2
        ):
            stamp = Stamp(t1 - t0, first, abs(w - o), n, swaps, False, None)
            break
        if t1 - t0 > timeout_s:
            stamp = Stamp(
                t1 - t0, first if first is not None else t1 - t0, None, n, swaps, True, None
            )
            break
    reference = local.predict(record, before, d0)
    if reference is not None:
        stamp.check = abs(reference - float(p0[0]))
    return stamp


def sparse_freshness(
    address: str,
    store: StoreClient,
    job: JobConfig,
    records: list[bytes],
    *,
    timeout_s: float,
    log: bool,
) -> dict[str, Any]:
    """Push on a record's rows in the training shards; time until the server answers with them.

    Every row of the record (one per table) gets the gradient; ``t1`` is the first
    response equal (to 1e-5) to this process's forward of the served dense version
    over the rows as the push left them (``push(return_rows=True)``): every pushed
    row served. ``first_change`` is the first response that differs from the answer
    over the rows as they were (the server's own answer before the push on its
    version; this process's forward on another): some row served. The replica
    follows one table after another, so the first comes sooner.
    """
    client = client_for(address)
    local = LocalForward(job)
    stamps: list[Stamp] = []
    try:
        for i, record in enumerate(records):
            stamps.append(stamp_once(client, store, job, local, record, timeout_s))
            if log and (i + 1) % 10 == 0:
                p50 = statistics.median(s.seconds for s in stamps)
                say(f"    sparse {i + 1}/{len(records)}: p50 {p50:.3f}s")
    finally:
        client.close()
    times = [s.seconds for s in stamps]
    first_change = [s.first_change for s in stamps]
    effects = [s.effect for s in stamps if s.effect is not None]
    # |server - local| on the version before the push, on the first 3 records
    check = [s.check for s in stamps[:3] if s.check is not None]
    return {
        "p50_s": pct(times, 50),
        "p99_s": pct(times, 99),
        "max_s": max(times),
        "mean_s": statistics.fmean(times),
        "first_change_p50_s": pct(first_change, 50),
        "first_change_p99_s": pct(first_change, 99),
        "repeats": len(times),
        "timeouts": sum(s.timed_out for s in stamps),
        "polls_median": statistics.median(s.polls for s in stamps),
        "prediction_moved_by_min": min(effects) if effects else None,
        "dense_swaps_while_polling": sum(s.swaps for s in stamps),
        "local_vs_server_max_abs": max(check) if check else None,
    }


def dense_freshness(
    address: str, job: JobConfig, record: bytes, repeats: int, *, timeout_s: float, log: bool
) -> dict[str, Any]:
    """Publish a new dense version (the served one, scaled); time until a response names it.

    Each publisher starts after the newest version it finds, as a job's does. While
    the job trains, its rank 0 publishes too, on a count of its own: it may write
    the same version number after ours (``served_ours`` counts the answers that
    came from our weights, told by their step).
    """
    import torch

    from deploy.job import serving_location
    from trainer.publish import DensePublisher

    local = LocalForward(job)
    where = serving_location(job)
    client = client_for(address)
    req = make_request([record])
    times: list[float] = []
    ours = 0
    timeouts = 0
    try:
        for i in range(repeats):
            time.sleep(random.uniform(0.0, 0.3))  # another phase of the server's poll
            _, params = infer(client, req)
            served = local.version(params["dense_version"])
            if served is None:
                continue
            module = served.module
            scale = 1.01 if i % 2 == 0 else 1 / 1.01
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(scale)
            publisher = DensePublisher(where, every_s=0.0, keep=job.serving.keep)
            t0 = time.perf_counter()
            publisher.maybe_publish(step=STAMP_STEP + i, samples=0, module=module)
            version = publisher.version
            local._versions.pop(params["dense_version"], None)  # scaled in place
            while True:
                _, params = infer(client, req)
                t1 = time.perf_counter()
                if params["dense_version"] >= version:
                    times.append(t1 - t0)
                    ours += params["dense_step"] == STAMP_STEP + i
                    break
                if t1 - t0 > timeout_s:
                    timeouts += 1
                    times.append(t1 - t0)
                    break
                time.sleep(0.002)
            publisher.close()
            if log and (i + 1) % 5 == 0:
                say(f"    dense {i + 1}/{repeats}: p50 {statistics.median(times):.3f}s")
    finally:
        client.close()
    return {
        "p50_s": pct(times, 50),
        "p99_s": pct(times, 99),
        "max_s": max(times),
        "mean_s": statistics.fmean(times),
        "repeats": len(times),
        "timeouts": timeouts,
        "served_ours": int(ours),
        "published_by": "this process (DensePublisher)",
    }


def job_dense_freshness(
    address: str, job: JobConfig, record: bytes, versions: int, *, timeout_s: float, log: bool
) -> dict[str, Any]:
    """While the job trains: its rank 0 publishes every ``serving.publish_every_s``; from
    each publish (its manifest's ``created``, taken in ``maybe_publish`` as the weights
    are copied) to the first response naming that version or a newer one.

    Our own publisher would collide with rank 0's: it counts versions on from what
    it found when it started, so it writes the number after ours again.
    """
    from deploy.job import serving_location
    from trainer.publish import published

    where = serving_location(job)
    client = client_for(address)
    req = make_request([record])
    created: dict[int, float] = {}
    seen: dict[int, float] = {}
    every = job.serving.publish_every_s or 1.0
    try:
        listed = published(where)
        after = listed[-1].version if listed else 0
        deadline = time.monotonic() + timeout_s + (versions + 1) * every * 3
        while len(seen) < versions and time.monotonic() < deadline:
            for entry in published(where):
                if entry.version > after and entry.version not in created:
                    created[entry.version] = entry.created
            _, params = infer(client, req)
            now = time.time()
            for v in created:
                if v <= params["dense_version"] and v not in seen:
                    seen[v] = now
                    if log and len(seen) % 5 == 0:
                        say(f"    dense {len(seen)}/{versions}")
            time.sleep(0.002)
    finally:
        client.close()
    times = [seen[v] - created[v] for v in sorted(seen)]
    if not times:
        msg = f"no version the job published after {after} was served within the time"
        raise RuntimeError(msg)
    return {
        "p50_s": pct(times, 50),
        "p99_s": pct(times, 99),
        "max_s": max(times),
        "mean_s": statistics.fmean(times),
        "repeats": len(times),
        "timeouts": len(created) - len(seen) if len(seen) < versions else 0,
        "published_by": "the job's rank 0",
    }


# --- the phases --------------------------------------------------------------------------


@dataclass
class Setup:
    """What every phase uses."""

    address: str
    job: JobConfig
    training_store: StoreClient
    args: argparse.Namespace
    log: bool
    reqs: dict[int, list[Request]] = field(default_factory=dict)
    fresh_records: list[bytes] = field(default_factory=list)
    stamps: list[bytes] = field(default_factory=list)
    server_pids: list[int] = field(default_factory=list)  # the server's and its replicas'
    scheduler: str | None = None  # the Dask cluster every training job names (--smoke)


def client_sweep(s: Setup, batch: int, levels: Sequence[int], suffix: str) -> list[dict[str, Any]]:
    """Requests of ``batch`` records from each number of client threads in ``levels``."""
    sweep = []
    for threads in levels:
        r = concurrent(s.address, s.reqs[batch], threads, s.args.seconds, s.server_pids)
        keys = ("threads", "requests_per_s", "p99_ms", "p50_ms", "server_cores")
        sweep.append({k: r[k] for k in keys})
        if s.log:
            say(
                f"  batch {batch}, {threads} threads{suffix}: {r['requests_per_s']:,.0f} "
                f"requests/s ({batch * r['requests_per_s']:,.0f} samples/s)  "
                f"p99 {r['p99_ms']:.2f} ms  server {r['server_cores']:.2f} cores"
            )
    return sweep


def per_server_core(sweep: Sequence[Mapping[str, Any]], per_request: int) -> float | None:
    """At the sweep's best level: what one core of the server's own processes gives
    (with the clients on other machines, the server could have them all)."""
    measured = [r for r in sweep if r.get("server_cores")]
    if not measured:
        return None
    best = max(measured, key=lambda r: r["requests_per_s"])
    return float(per_request * best["requests_per_s"] / best["server_cores"])


def latency_phase(s: Setup, suffix: str, out: dict[str, Any]) -> None:
    """Batches 1, 64, 512 one after the other, batch 512 from concurrent clients, then the
    batch-1 sweep; throughputs are the best of each sweep."""
    detail: dict[str, Any] = {}
    for b in BATCH_SIZES:
        r = sequential(s.address, s.reqs[b], s.args.seconds)
        detail[f"batch{b}"] = r
        out[f"p50_ms_batch{b}{suffix}"] = r["p50_ms"]
        out[f"p99_ms_batch{b}{suffix}"] = r["p99_ms"]
        if s.log:
            say(
                f"  batch {b:>3}{suffix}: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                f"{r['requests_per_s']:,.0f} requests/s  ({r['requests']} requests)"
            )
    first512 = {"threads": 1, "requests_per_s": detail["batch512"]["requests_per_s"]}
    sweep512 = [first512, *client_sweep(s, 512, SWEEP_512, suffix)]
    out[f"sweep512{suffix}"] = sweep512
    out[f"samples_per_s_batch512{suffix}"] = 512 * max(r["requests_per_s"] for r in sweep512)
    out[f"samples_per_s_batch512_per_server_core{suffix}"] = per_server_core(sweep512, 512)
    sweep = client_sweep(s, 1, s.args.sweep, suffix)
    out[f"sweep{suffix}"] = sweep
    out[f"requests_per_s_batch1{suffix}"] = max(r["requests_per_s"] for r in sweep)
    out[f"requests_per_s_batch1_per_server_core{suffix}"] = per_server_core(sweep, 1)
    out[f"requests_per_s_batch1_sequential{suffix}"] = detail["batch1"]["requests_per_s"]
    out[f"latency{suffix}"] = detail


def freshness_phase(s: Setup, suffix: str, records: list[bytes], out: dict[str, Any]) -> None:
    sp = sparse_freshness(
        s.address, s.training_store, s.job, records, timeout_s=s.args.timeout_s, log=s.log
    )
    out[f"sparse_freshness_s_p50{suffix}"] = sp["p50_s"]
    out[f"sparse_freshness_s_p99{suffix}"] = sp["p99_s"]
    out[f"sparse_freshness{suffix}"] = sp
    if s.log:
        say(
            f"  sparse freshness{suffix}: p50 {sp['p50_s']:.3f}s  p99 {sp['p99_s']:.3f}s  "
            f"max {sp['max_s']:.3f}s over {sp['repeats']} records ({sp['timeouts']} timeouts)"
        )
    measure = job_dense_freshness if suffix else dense_freshness
    dn = measure(
        s.address,
        s.job,
        s.fresh_records[0],
        s.args.dense_repeats,
        timeout_s=s.args.timeout_s,
        log=s.log,
    )
    out[f"dense_freshness_s_p50{suffix}"] = dn["p50_s"]
    out[f"dense_freshness_s_p99{suffix}"] = dn["p99_s"]
    out[f"dense_freshness{suffix}"] = dn
    if s.log:
        say(
            f"  dense freshness{suffix}: p50 {dn['p50_s']:.3f}s  p99 {dn['p99_s']:.3f}s  "
            f"max {dn['max_s']:.3f}s over {dn['repeats']} versions ({dn['timeouts']} timeouts, "
            f"published by {dn['published_by']})"
        )


def json_mode(s: Setup, out: dict[str, Any]) -> None:
    """Batch 64 with JSON tensors: what the binary extension saves."""
    reqs = requests_of(s.fresh_records, 64, 8, binary=False)
    r = sequential(s.address, reqs, max(0.2, s.args.seconds / 2))
    out["json_mode"] = {"p50_ms_batch64": r["p50_ms"], "p99_ms_batch64": r["p99_ms"]}
    if s.log:
        say(f"  batch  64, JSON tensors: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms")


def constant_server() -> None:
    """``--constant-server``: this machine's HTTP ceiling, a model that costs nothing.

    The same ``InferenceServer`` as ``streamrec serve`` (the same protocol code, the
    same batching on its loop), in a process of its own, scoring every record 0.5.
    """
    from serving.http import InferenceServer
    from serving.types import Prediction

    class Constant:
        name, heads = MODEL, (HEAD,)

        def ready(self) -> bool:
            return True

        def metadata(self) -> dict[str, object]:
            return {}

        def predict(self, records: Sequence[bytes]) -> Prediction:
            return Prediction({HEAD: np.full(len(records), 0.5, np.float32)}, {"dense_version": 1})

    with InferenceServer(Constant(), port=0) as server:
        print(f"constant model on {server.url} ", flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def ceiling_phase(s: Setup, tmp: Path, out: dict[str, Any]) -> None:
    """The batch-1 figures against a model that costs nothing: what HTTP and the client
    leave of this machine (the clients run on the same cores as the server)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--constant-server"]
    server = Server(argv, tmp / "constant.log")
    try:
        seq = sequential(server.address, s.reqs[1], s.args.seconds)
        sweep = [
            concurrent(server.address, s.reqs[1], threads, s.args.seconds, [server.proc.pid])
            for threads in s.args.sweep
        ]
    finally:
        server.stop()
    best = max(r["requests_per_s"] for r in sweep)
    out["ceiling"] = {
        "p50_ms_batch1": seq["p50_ms"],
        "p99_ms_batch1": seq["p99_ms"],
        "requests_per_s_batch1": best,
        "requests_per_s_batch1_per_server_core": per_server_core(sweep, 1),
        "sweep": [
            {k: r[k] for k in ("threads", "requests_per_s", "p99_ms", "server_cores")}
            for r in sweep
        ],
    }
    out["requests_per_s_batch1_vs_ceiling"] = out["requests_per_s_batch1"] / best
    if s.log:
        say(
            f"  a model that costs nothing: batch 1 p50 {seq['p50_ms']:.2f} ms  "
            f"p99 {seq['p99_ms']:.2f} ms  best {best:,.0f} requests/s, "
            f"{out['ceiling']['requests_per_s_batch1_per_server_core'] or 0:,.0f} per server core"
        )


# A busy loop for ``share`` of every 10 ms of CPU time (not of wall time: preempted by the
# job, a wall-clock spin took 0.17 of a core when asked for 0.23), on a fixed schedule as
# the load sends its requests, catching up when it falls behind: CPU taken from the job
# as the server takes it, with none of the server's memory traffic, wake-ups or messages.
_BURNER = """
import sys, time
share = float(sys.argv[1])
slot = time.monotonic()
while True:  # killed with the benchmark, however it ends (with_parent_death)
    t = time.thread_time()
    while time.thread_time() - t < share * 0.01:
        pass
    slot = max(slot + 0.01, time.monotonic() - 0.1)
    time.sleep(max(0.0, slot - time.monotonic()))
"""


def slowdown_phase(
    s: Setup, tmp: Path, store: str, shards: int, token_file: Path, out: dict[str, Any]
) -> None:
    """The same job on the same events with and without 100 requests/s of batch 64, and
    beside a CPU burner that takes the cores the load cost the server (the control)."""
    step = BATCH * PARTITIONS
    samples = -(-s.args.samples // step) * step
    out["slowdown_samples"] = samples
    load_reqs = requests_of(s.fresh_records, LOAD_BATCH, 16)
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": [], "burner": []}
    for r in range(s.args.repeat):
        # The burner takes the share the last run with load measured, so it follows one.
        order = ("without", "with", "burner") if r % 2 == 0 else ("with", "burner", "without")
        for kind in order:
            # The same job but for its run directory (metrics files are appended to).
            name = f"slowdown-{kind}-{r}"
            job_file = write_job(
                tmp, name, store=store, shards=shards, token_file=token_file, events=samples,
                hidden=s.args.hidden, scheduler=s.scheduler,
            )  # fmt: skip
            before = load()
            run: TrainingRun | InProcessRun = (
                InProcessRun(job_file, samples)
                if s.args.in_process_jobs
                else TrainingRun(job_file, samples)
            )
            loader = Load(s.address, load_reqs, LOAD_RPS) if kind == "with" else None
            share = _burner_share(runs) if kind == "burner" else None
            burner = (
                subprocess.Popen(
                    with_parent_death(
                        [sys.executable, "-c", _BURNER, f"{share:.4f}"], signal.SIGKILL
                    )
                )
                if share is not None
                else None
            )
            cpu0, t0 = cpu_s(s.server_pids), time.monotonic()
            if loader is not None:
                loader.start()
            try:
                run.wait(s.args.job_timeout_s)
            finally:
                served = loader.finish() if loader is not None else None
                burner_cores = None
                if burner is not None:
                    burner_cores = cpu_s([burner.pid]) / (time.monotonic() - t0)
                    burner.kill()
                    burner.wait()
            rate = run.rate()
            rate |= {"round": r, "load_before": before, "load_after": load()}
            rate["server_cores"] = (cpu_s(s.server_pids) - cpu0) / (time.monotonic() - t0)
            if served is not None:
                rate["serving_load"] = served
            if share is not None:
                rate["burner_share"] = share
                rate["burner_cores"] = burner_cores
            runs[kind].append(rate)
            if s.log:
                extra = f", server {rate['server_cores']:.2f} cores"
                if served is not None:
                    extra += (
                        f", load {served['requests_per_s']:.0f} requests/s of batch {LOAD_BATCH}"
                        f" (p99 {served['p99_ms']:.1f} ms, its client {served['client_cores']:.2f}"
                        f" cores)"
                    )
                if share is not None:
                    extra += f", a burner asked for {share:.2f} of a core took {burner_cores:.2f}"
                say(
                    f"  round {r + 1} {kind:<7}: {rate['samples_per_s']:,.0f} samples/s "
                    f"({rate['from']}){extra}"
                )
    with_rate = statistics.median(x["samples_per_s"] for x in runs["with"])
    without_rate = statistics.median(x["samples_per_s"] for x in runs["without"])
    burner_rate = statistics.median(x["samples_per_s"] for x in runs["burner"])
    out["training_samples_per_s_with_load"] = with_rate
    out["training_samples_per_s_without_load"] = without_rate
    out["training_samples_per_s_beside_burner"] = burner_rate
    out["training_slowdown"] = with_rate / without_rate
    out["training_slowdown_burner"] = burner_rate / without_rate
    out["serving_load_cores"] = _burner_share(runs)
    out["burner_cores"] = statistics.median(x["burner_cores"] for x in runs["burner"])
    out["load_requests_per_s_achieved"] = statistics.median(
        x["serving_load"]["requests_per_s"] for x in runs["with"]
    )
    out["load_client_cores"] = statistics.median(
        x["serving_load"]["client_cores"] for x in runs["with"]
    )
    out["slowdown_runs"] = runs


def _burner_share(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> float:
    """The cores the load cost the server: its cores with load (the last run's) over its
    cores without (the median; it follows the training shards either way)."""
    idle = statistics.median(x["server_cores"] for x in runs["without"]) if runs["without"] else 0
    return float(min(1.0, max(0.01, runs["with"][-1]["server_cores"] - idle)))


def while_training_phase(s: Setup, run: TrainingRun, out: dict[str, Any]) -> None:
    """The job trains the endless stream; the serving figures are taken meanwhile."""
    try:
        client = client_for(s.address)
        try:
            wanted = 1 if s.args.smoke else 2
            wait_for(
                lambda: run.training(wanted) and client.is_model_ready(MODEL),
                "the job training and the server ready",
                s.args.job_timeout_s,
            )
        finally:
            client.close()
        t0 = time.monotonic()
        out["while_training_startup_s"] = round(t0 - run.started, 1)
        if s.log:
            say(f"  the job trains ({out['while_training_startup_s']}s after its start)")
        latency_phase(s, "_while_training", out)
        freshness_phase(s, "_while_training", s.stamps, out)
        if not run.training():  # still running: it did not die meanwhile
            msg = "the job stopped while the serving figures were taken"
            raise RuntimeError(msg)
        out["while_training_measured_s"] = round(time.monotonic() - t0, 1)
    finally:
        code = run.stop()
    reports = run.reports()
    last = reports[-1] if reports else {}
    out["while_training_job"] = {
        "exit_code": code,
        "samples": last.get("samples"),
        "rate": run.rate(),
    }
    if s.log:
        say(f"  the job stopped (exit {code}) after {last.get('samples', 0):,} samples")


# --- main --------------------------------------------------------------------------------


def summarize(out: dict[str, Any], cpus: int) -> None:
    if "requests_per_s_batch1" in out:
        out["requests_per_s_batch1_per_core"] = out["requests_per_s_batch1"] / cpus
    if "samples_per_s_batch512" in out:
        out["samples_per_s_batch512_per_core"] = out["samples_per_s_batch512"] / cpus
    for suffix in ("_while_training",):
        if f"requests_per_s_batch1{suffix}" in out:
            out[f"requests_per_s_batch1_per_core{suffix}"] = (
                out[f"requests_per_s_batch1{suffix}"] / cpus
            )
        if f"samples_per_s_batch512{suffix}" in out:
            out[f"samples_per_s_batch512_per_core{suffix}"] = (
                out[f"samples_per_s_batch512{suffix}"] / cpus
            )
    targets = {}
    for key, (op, bound) in TARGETS.items():
        value = out.get(key)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets[key] = {"target": f"{op} {bound:g}", "value": value, "met": met}
    out["targets"] = targets


def show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def print_table(out: dict[str, Any]) -> None:
    keys = [
        "cpus",
        "p50_ms_batch1", "p99_ms_batch1", "p50_ms_batch64", "p99_ms_batch64",
        "p50_ms_batch512", "p99_ms_batch512",
        "requests_per_s_batch1", "requests_per_s_batch1_per_core",
        "requests_per_s_batch1_per_server_core",
        "samples_per_s_batch512", "samples_per_s_batch512_per_core",
        "samples_per_s_batch512_per_server_core",
        "sparse_freshness_s_p50", "sparse_freshness_s_p99",
        "dense_freshness_s_p50", "dense_freshness_s_p99",
    ]  # fmt: skip
    keys += [f"{k}_while_training" for k in keys[1:]]
    keys += [
        "training_samples_per_s_without_load",
        "training_samples_per_s_with_load",
        "training_slowdown",
        "load_requests_per_s_achieved",
        "load_client_cores",
        "serving_load_cores",
        "training_samples_per_s_beside_burner",
        "training_slowdown_burner",
        "burner_cores",
    ]
    say("")
    print_figures({k: out[k] for k in keys if k in out}, show)
    for suffix in ("", "_while_training"):
        if f"sweep{suffix}" in out:
            levels = ", ".join(
                f"{r['threads']}: {r['requests_per_s']:,.0f}/s p99 {r['p99_ms']:.2f} ms"
                for r in out[f"sweep{suffix}"]
            )
            say(f"sweep{suffix} (threads: requests/s, p99): {levels}")
    say("")
    for key, t in out.get("targets", {}).items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = "-" if t["value"] is None else show(t["value"])
        say(f"{key:<40} {value:>12}  (target {t['target']}): {verdict}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--smoke`` brings every size down to its tiny one."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench-results/serve.json"))
    parser.add_argument("--seconds", type=float, default=5.0, help="per latency measurement")
    parser.add_argument(
        "--samples", type=int, default=1_000_000, help="events of each training_slowdown run"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="training_slowdown rounds (with and without load, and beside the burner): the "
        "job alone varies by several %% from one round to the next",
    )
    parser.add_argument("--sparse-repeats", type=int, default=30, help="records stamped")
    parser.add_argument("--dense-repeats", type=int, default=10, help="versions published")
    parser.add_argument("--sweep", type=int, nargs="+", default=list(SWEEP), help="threads")
    parser.add_argument("--shards", type=int, default=2, help="training shards (one replica each)")
    parser.add_argument(
        "--rows",
        choices=("replicas", "follow"),
        default="replicas",
        help="where the server reads rows: a replica process per shard (--store), or "
        "replicas in the server's process (--follow)",
    )
    parser.add_argument("--hidden", type=int, nargs="+", default=HIDDEN, help="FFNN widths")
    parser.add_argument("--timeout-s", type=float, default=15.0, help="per freshness repeat")
    parser.add_argument("--job-timeout-s", type=float, default=300.0, help="per training job")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folder here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure at tiny sizes (seconds): 0.3 s per latency measurement, 16k "
        "events, 1 round, 3 stamps, 2 versions, sweep 1 2, 1 shard, one Dask cluster "
        "that every training job names, the training_slowdown jobs in this process",
    )
    parser.add_argument(
        "--in-process-jobs",
        action="store_true",
        help="run the training_slowdown jobs in this process (deploy.job.run_job) instead of "
        "as `streamrec run` processes, whose start takes longer than a short job (--smoke)",
    )
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--constant-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.in_process_jobs = True
        args.seconds = min(args.seconds, 0.3)
        args.samples = min(args.samples, 16_384)
        args.repeat = 1
        args.sparse_repeats = min(args.sparse_repeats, 3)
        args.dense_repeats = min(args.dense_repeats, 2)
        args.sweep = [1, 2]
        args.shards = 1
    return args


def header(args: argparse.Namespace, cpus: int) -> dict[str, Any]:
    """The figures' first keys: what the run is."""
    return {
        "cpus": cpus,
        "tensor_encoding": TENSOR_ENCODING,
        "seconds_per_latency_measurement": args.seconds,
        "samples": args.samples,
        "repeat": args.repeat,
        "shards": args.shards,
        "replicas": args.shards,
        "rows": args.rows,
        "model": {"kind": "ffnn", "hidden": args.hidden, "dim": DIM, "tables": 26},
        "batch_size": BATCH,
        "load_requests_per_s": LOAD_RPS,
        "load_batch": LOAD_BATCH,
        "smoke": args.smoke,
        "load_before": load(),
    }


@dataclass
class Services:
    """The run's processes, each stopped when the run's ``ExitStack`` closes."""

    tmp: Path
    token_file: Path
    store: str  # grpc://... of the training shards
    scheduler: str | None
    run: TrainingRun  # the endless job of the phase while training
    replicas: list[Any]  # ShardProcess
    server: Server


def work_dir(stack: ExitStack, args: argparse.Namespace) -> Path:
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        return Path(args.keep)
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-")))


def start_services(stack: ExitStack, args: argparse.Namespace, tmp: Path) -> Services:
    """The training shards, the endless job, the replicas and ``streamrec serve``.

    What waits on nothing else starts side by side: the training shards; then the
    job (its start-up takes longest) and the replicas following the shards; then
    the server over the replicas, which answers once the job published weights.
    """
    from deploy.local.shards import ShardProcess

    token_file = write_token(tmp / "store.token")
    # The shards read the store section alone; the same job file for all.
    first = write_job(
        tmp, "shards", store="grpc://127.0.0.1:1", shards=args.shards,
        token_file=token_file, events=None, hidden=args.hidden,
    )  # fmt: skip
    starting = [
        ShardProcess.spawn(
            first, tmp / "store" / f"shard-{i:03d}", token_file=token_file,
            die_with_parent=True,
        )
        for i in range(args.shards)
    ]  # fmt: skip
    # The smoke's jobs are shorter than a Dask cluster's start: they share one.
    scheduler = stack.enter_context(shared_dask(tmp / "dask-scheduler.log")) if args.smoke else None
    training = wait_all(starting)
    for shard in training:
        stack.callback(shard.kill)
    store = "grpc://" + ",".join(s.address for s in training)
    job_file = write_job(
        tmp, "while-training", store=store, shards=args.shards, token_file=token_file,
        events=None, hidden=args.hidden, scheduler=scheduler,
    )  # fmt: skip
    run = TrainingRun(job_file, None)
    stack.callback(run.stop)
    replicas = wait_all(
        [
            ShardProcess.spawn(
                first, tmp / "store" / f"replica-{i:03d}", token_file=token_file,
                follow=shard.address, die_with_parent=True,
            )
            for i, shard in enumerate(training if args.rows == "replicas" else [])
        ]
    )  # fmt: skip
    for replica in replicas:
        stack.callback(replica.kill)
    server = start_server(tmp, args, store, token_file, replicas)
    stack.callback(server.stop)
    return Services(tmp, token_file, store, scheduler, run, replicas, server)


def start_server(
    tmp: Path, args: argparse.Namespace, store: str, token_file: Path, replicas: list[Any]
) -> Server:
    """``streamrec serve`` over the replicas (or following the shards itself)."""
    serve_file = write_job(
        tmp, "serve", store=store, shards=args.shards, token_file=token_file, events=None,
        hidden=args.hidden,
    )  # fmt: skip
    rows = (
        ["--store", "grpc://" + ",".join(r.address for r in replicas)]
        if args.rows == "replicas"
        else ["--follow", store]
    )
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(serve_file), "--port", "0",
            *rows, "--store-token-file", str(token_file)]  # fmt: skip
    return Server(argv, tmp / "serve.log")


def make_setup(stack: ExitStack, args: argparse.Namespace, services: Services, log: bool) -> Setup:
    """What every phase uses: the client of the training shards, the requests, the stamps."""
    from deploy.config import load_config
    from embedding_store.client import StoreClient

    token = services.token_file.read_text().strip()
    job = load_config(services.tmp / "serve.yaml")
    training_store = stack.enter_context(StoreClient.connect(services.store, token=token))
    s = Setup(services.server.address, job, training_store, args, log)
    s.server_pids = [services.server.proc.pid, *(r.proc.pid for r in services.replicas)]
    s.scheduler = services.scheduler
    # Enough for the largest request set (4 of 512 records); the smoke needs no more.
    s.fresh_records = stream_records(512 * 4 if args.smoke else 4096)
    s.reqs = {
        1: requests_of(s.fresh_records, 1, 256),
        64: requests_of(s.fresh_records, 64, 16),
        512: requests_of(s.fresh_records, 512, 4),
    }
    s.stamps = stamp_records(args.sparse_repeats)
    return s


def server_alone_phase(s: Setup, tmp: Path, out: dict[str, Any]) -> None:
    """No training: the latencies, JSON tensors and the ceiling."""
    say("server alone:")
    client = client_for(s.address)
    wait_for(lambda: client.is_model_ready(MODEL), "the server ready")
    client.close()
    latency_phase(s, "", out)
    json_mode(s, out)
    ceiling_phase(s, tmp, out)


def alone_freshness_phase(s: Setup, out: dict[str, Any]) -> None:
    # Records of the trained stream, ids the job learned; each its own.
    start = 1000
    records = s.fresh_records[start : start + s.args.sparse_repeats]
    freshness_phase(s, "", records, out)


def save(out: dict[str, Any], args: argparse.Namespace, cpus: int, t_all: float) -> None:
    """The figures so far, the targets computed, into ``--json``."""
    out["total_s"] = round(time.monotonic() - t_all, 1)
    out["load_after"] = load()
    summarize(out, cpus)
    if args.json:
        write_json(args.json, out)


def run_phases(args: argparse.Namespace, out: dict[str, Any], cpus: int, t_all: float) -> None:
    """Every phase in turn, the JSON written after each."""
    log = not args.quiet
    with ExitStack() as stack:
        tmp = work_dir(stack, args)
        t = time.monotonic()
        services = start_services(stack, args, tmp)
        out["setup_s"] = round(time.monotonic() - t, 1)
        s = make_setup(stack, args, services, log)
        if log:
            replicas = f"{args.shards} replicas" if services.replicas else "replicas in the server"
            say(
                f"{args.shards} training shards, {replicas} and `streamrec serve` on "
                f"{s.address} ({out['setup_s']}s); {cpus} cores, load {load()}"
            )
        say("while training (the job trains the served model as it goes):")
        while_training_phase(s, services.run, out)
        save(out, args, cpus, t_all)
        server_alone_phase(s, tmp, out)
        save(out, args, cpus, t_all)
        alone_freshness_phase(s, out)
        save(out, args, cpus, t_all)
        say(
            f"training_slowdown: {args.repeat} round(s) with and without {LOAD_RPS:.0f} "
            f"requests/s of batch {LOAD_BATCH}:"
        )
        slowdown_phase(s, tmp, services.store, args.shards, services.token_file, out)
        save(out, args, cpus, t_all)
        out["server_errors_logged"] = services.server.log().count("Traceback")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.constant_server:
        constant_server()
        return 0
    cpus = os.cpu_count() or 1
    out = header(args, cpus)
    run_phases(args, out, cpus, time.monotonic())
    print_table(out)
    say(f"load average before {out['load_before']}, after {out['load_after']}")
    say(f"total {out['total_s']}s")
    if args.json:
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
