"""Soak: a continuous job at a steady rate for an hour; memory, lag, disk and speed stay flat.

    python benchmarks/soak.py --minutes 60 --json bench-results/soak.json

A real local broker (Kafka 0.9, or Tansu with ``--broker tansu``), a producer
thread and ``streamrec run`` as a user runs it: the chaos benchmark's job
(hybrid, 2 store shards, 2 Dask workers, one trainer) with its defaults for
what piles up over weeks: job checkpoints every ``--checkpoint-s`` seconds,
``trainer.checkpoint.keep`` (3) manifests and dense states,
``store.keep_full_checkpoints`` (2) full snapshots per shard with their
deltas (a full one every ``store.full_checkpoint_every``, 10), and
``serving.keep`` (3) published dense versions. Nothing is killed.

The events come from a pool of ``--pool-events`` generated before the job
starts, which the producer writes over and over: generating an event costs
about as much CPU as the Kafka client writing it, and on a small machine a
producer that generates takes a core from the job and falls below its rate
(a soak of 18 minutes on 2 cores wrote 9,931 events/s in its first window and
7,129 in its last while the job kept up with every one).

1. **Capacity.** Two backlogs of ``--capacity-events`` are produced before the
   job starts. Its rate over the first (learned events per second, from its
   first learned chunk on) is its capacity alone; over the second, while a
   producer writes another topic at ``--load`` times that, its capacity
   beside the producer, which the steady rate is taken from: the producer
   shares the machine in the steady phase too.
2. **Steady.** The producer writes ``--load`` (0.7) times that capacity, or
   ``--rate``, for ``--minutes``. Every ``--sample-s`` seconds: the RSS and
   the CPU time of every process by role (``job``: the ``streamrec run``
   process, which trains
   rank 0; ``shard``; ``worker``: the Dask workers and their nannies;
   ``scheduler``: the Dask scheduler's process; ``broker``,
   whose JVM holds its whole heap from the start, ``-Xms`` = ``-Xmx``),
   the events produced and learned (the ledger), the lag (produced minus
   learned, in events and in seconds at the rate) and the disk used by the
   job checkpoints, the store shards' data and the rest of the run directory.
3. **End.** The producer stops, the job catches up with the topic's end and
   gets Ctrl-C; every offset of the topic must have been learned exactly once.

After ``--warmup-minutes`` (10) the figures are compared with the end:
``rss_growth_pct_after_warmup`` (per role, the largest growth of one of its
processes' peak RSS, its highest in the last window over its highest in the
first window after the warm-up, as for the disk; ``rss_growth_pct_two_samples``
holds the growth between the sample at the warm-up's end and the last one),
``disk_bytes_first_vs_last``
(the job's highest disk use in the last window over its highest in the first
window after the warm-up: the store's disk swings within each cycle of a full
snapshot and its deltas). The steady phase is
cut into ``--window-minutes`` (5) windows: ``throughput_last_vs_first_window``
is the last whole window's learned events/s over the first's; each window also
has the cores each role kept busy and its CPU milliseconds per learned event
(``producer``: the benchmark's own process). ``lag_max_s``
is the largest lag after the first window (the first holds the job settling
from the backlog to the rate).

JSON keys: minutes, rate, rate_achieved, capacity_events_per_s,
capacity_alone_events_per_s, produced, learned_once,
learned_twice, never_learned, rss_growth_pct_after_warmup, rss_mb_by_role,
lag_max_s, disk_bytes_first_vs_last, disk_bytes_by_kind, windows,
throughput_last_vs_first_window, samples (every sample), targets, exit_code,
and the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from chaos import (  # noqa: E402
    Broker,
    Producer,
    catch_up,
    count_offsets,
    group_source,
    interrupt,
    learned_count,
    start_job,
    write_job,
)
from common import print_figures, write_json  # noqa: E402

ROLES = ("job", "shard", "worker", "scheduler", "broker")
# The capacity phase's producer writes here: a topic the job does not read.
SIDE_TOPIC = "soak-side"
# key -> (comparison, bound)
TARGETS: dict[str, tuple[str, float]] = {
    "never_learned": ("<=", 0),
    "learned_twice": ("<=", 0),
    "rss_growth_pct_after_warmup_max": ("<", 5.0),
    "disk_bytes_first_vs_last": ("<=", 1.1),
    "lag_max_s": ("<", 30.0),
    "throughput_last_vs_first_window": (">=", 0.95),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run a streamrec job at a steady rate and watch what grows."
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="the steady phase")
    parser.add_argument("--warmup-minutes", type=float, default=10.0)
    parser.add_argument("--window-minutes", type=float, default=5.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--capacity-events", type=int, default=60_000)
    parser.add_argument(
        "--pool-events",
        type=int,
        default=300_000,
        help=(
            "events generated before the job starts (at least twice --capacity-events); "
            "the backlogs come from it and the producer writes it over and over"
        ),
    )
    parser.add_argument("--load", type=float, default=0.7, help="share of the capacity")
    parser.add_argument("--rate", type=float, default=None, help="events/s (instead of --load)")
    parser.add_argument("--checkpoint-s", type=float, default=30.0)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--broker", choices=("kafka09", "tansu"), default="kafka09")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--table-rows",
        type=int,
        default=None,
        help=(
            "cap every table's capacity at this many rows, so the tables are full (and "
            "evicting) within the warm-up, as on a job that has run for weeks (default: the "
            "synthetic tables' own, up to 524,288 rows, which fill over hours)"
        ),
    )
    parser.add_argument("--catch-up-s", type=float, default=300.0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def soak_job(work: Path, broker: Broker, topic: str, args: argparse.Namespace) -> Path:
    """The chaos benchmark's job, checkpointing on a clock only."""
    import yaml

    path = write_job(work, broker.bootstrap, topic, args.batch_size, broker.api_version)
    job = yaml.safe_load(path.read_text())
    job["trainer"]["checkpoint"] = {"every_steps": None, "every_s": args.checkpoint_s}
    job["trainer"]["log_every_s"] = 5.0
    if args.table_rows is not None:
        for table in job["store"]["tables"].values():
            table["capacity"] = min(table["capacity"], args.table_rows)
            table["initial_rows"] = min(table["initial_rows"], args.table_rows)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


POLL_S = 0.2  # how often the ledger is read while a backlog is learned


def wait_learned(job: subprocess.Popen[bytes], run_dir: Path, count: int, log_path: Path) -> float:
    """When (``time.monotonic()``) the job had learned ``count`` events."""
    deadline = time.monotonic() + 600
    while learned_count(run_dir) < count:
        if job.poll() is not None or time.monotonic() > deadline:
            msg = f"the job did not learn {count:,} events; see {log_path}"
            raise RuntimeError(msg)
        time.sleep(POLL_S)
    return time.monotonic()


def rate_over(events: int, began: float, ended: float) -> float:
    """Events per second; a backlog learned within one poll counts as one poll long
    (a small one can be, and an unbounded rate would ask the producer for blocks it
    cannot write).

    >>> rate_over(1000, 5.0, 5.5), rate_over(1000, 5.0, 5.0)
    (2000.0, 5000.0)
    """
    return events / max(ended - began, POLL_S)


def processes(job: subprocess.Popen[bytes], broker: Broker) -> dict[str, list[Any]]:
    """The processes of each role now (the job's descendants, and the broker)."""
    import psutil

    out: dict[str, list[Any]] = {role: [] for role in ROLES}
    with contextlib.suppress(psutil.Error):
        out["job"].append(psutil.Process(job.pid))
        for c in psutil.Process(job.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                line = " ".join(c.cmdline())
                if "store serve" in line:
                    out["shard"].append(c)
                elif "distributed.Scheduler" in line:  # the local cluster's own process
                    out["scheduler"].append(c)
                elif "spawn_main" in line or "distributed" in line:
                    out["worker"].append(c)
    with contextlib.suppress(psutil.Error):
        out["broker"].append(psutil.Process(broker.pid))
    return out


def rss_by_process(procs: dict[str, list[Any]]) -> dict[str, dict[int, int]]:
    import psutil

    out: dict[str, dict[int, int]] = {}
    for role, found in procs.items():
        out[role] = {}
        for p in found:
            with contextlib.suppress(psutil.Error):
                out[role][p.pid] = int(p.memory_info().rss)
    return out


def cpu_seconds(procs: dict[str, list[Any]]) -> dict[str, float]:
    """CPU seconds (user and system) each role's processes have used so far, and the
    benchmark's own process as ``producer`` (its producer thread, and the sampling)."""
    import psutil

    out: dict[str, float] = {}
    for role, found in procs.items():
        out[role] = 0.0
        for p in found:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                out[role] += times.user + times.system
    times = psutil.Process().cpu_times()
    out["producer"] = times.user + times.system
    return out


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).stat().st_size
    return total


def disk_bytes(run_dir: Path) -> dict[str, int]:
    """The job's disk: checkpoints (with the published versions), store data, the rest."""
    checkpoints = tree_bytes(run_dir / "checkpoints")
    store = tree_bytes(run_dir / "store")
    return {
        "checkpoints": checkpoints,
        "store": store,
        "run_dir_rest": tree_bytes(run_dir) - checkpoints - store,
    }


def growth_pct(first: dict[Any, int], last: dict[Any, int]) -> float | None:
    """The largest RSS growth of one process present in both samples, in percent."""
    both = [pid for pid in first if pid in last and first[pid] > 0]
    if not both:
        return None
    return max(100.0 * (last[pid] / first[pid] - 1.0) for pid in both)


def rss_peaks_growth(
    samples: list[dict[str, Any]], warmup_s: float, window_s: float
) -> dict[str, float | None]:
    """Per role, the largest growth of one process's peak RSS: its highest in the last
    ``window_s`` over its highest in the first ``window_s`` after the warm-up, in percent
    (None: no process of the role in both). Peaks, as for the disk: a store shard's
    memory swings with its snapshot cycle, and two samples show only where in the
    cycle each fell.

    >>> s = [{"t": t, "rss": {"shard": {"7": 100 + 20 * (t % 3 == 0)}}} for t in range(12)]
    >>> rss_peaks_growth(s, warmup_s=2, window_s=4)
    {'shard': 0.0}
    >>> s[-1]["rss"]["shard"]["7"] = 180
    >>> rss_peaks_growth(s, warmup_s=2, window_s=4)
    {'shard': 50.0}
    """
    after = [x for x in samples if x["t"] >= warmup_s]
    if not after:
        return {}
    first = [x for x in after if x["t"] < after[0]["t"] + window_s]
    last = [x for x in after if x["t"] > after[-1]["t"] - window_s]

    def peaks(part: list[dict[str, Any]], role: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for x in part:
            for pid, rss in x["rss"].get(role, {}).items():
                out[pid] = max(out.get(pid, 0), rss)
        return out

    roles = {role for x in after for role in x["rss"]}
    return {role: growth_pct(peaks(first, role), peaks(last, role)) for role in sorted(roles)}


def windows_of(
    samples: list[dict[str, Any]], start_s: float, window_s: float
) -> list[dict[str, Any]]:
    """Whole windows of ``window_s`` from ``start_s`` on (a sample at or after a window's
    end makes it whole): learned events/s between its first and last samples and, where
    the samples have each role's CPU seconds, the ``cores`` each role kept busy and its
    ``cpu_ms_per_event`` learned.

    >>> s = [{"t": t + 0.1, "learned": 10 * t, "cpu": {"job": t / 2}} for t in range(0, 32, 3)]
    >>> [(w["from_s"], round(w["events_per_s"], 1)) for w in windows_of(s, 0, 10)]
    [(0, 10.0), (10, 10.0), (20, 10.0)]
    >>> windows_of(s, 0, 10)[0]["cores"], windows_of(s, 0, 10)[0]["cpu_ms_per_event"]
    ({'job': 0.5}, {'job': 50.0})
    """
    out = []
    begin = start_s
    while any(s["t"] >= begin + window_s for s in samples):
        end = begin + window_s
        inside = [s for s in samples if begin <= s["t"] <= end]
        if len(inside) >= 2:
            first, last = inside[0], inside[-1]
            span = max(last["t"] - first["t"], 1e-9)
            learned = last["learned"] - first["learned"]
            window: dict[str, Any] = {"from_s": round(begin, 1), "to_s": round(end, 1)}
            window["events_per_s"] = learned / span
            if "cpu" in first and "cpu" in last:
                used = {r: last["cpu"][r] - first["cpu"].get(r, 0.0) for r in last["cpu"]}
                window["cores"] = {r: round(v / span, 3) for r, v in used.items()}
                window["cpu_ms_per_event"] = {
                    r: round(1000 * v / max(learned, 1), 4) for r, v in used.items()
                }
            out.append(window)
        begin = end
    return out


def disk_peaks_ratio(
    samples: list[dict[str, Any]], warmup_s: float, window_s: float
) -> float | None:
    """The job's highest disk use in the last ``window_s`` over its highest in the first
    ``window_s`` after the warm-up (None: too few samples). Peaks, not two samples: the
    store's disk swings within each cycle of a full snapshot and its deltas, and a
    sample shows only where in the cycle it fell.

    >>> s = [{"t": t, "disk": {"store": 100 + 50 * (t % 3 == 0)}} for t in range(12)]
    >>> disk_peaks_ratio(s, warmup_s=2, window_s=4)
    1.0
    >>> s[-1]["disk"]["store"] = 300
    >>> disk_peaks_ratio(s, warmup_s=2, window_s=4)
    2.0
    """
    after = [x for x in samples if x["t"] >= warmup_s]
    if not after:
        return None
    first = [x for x in after if x["t"] < after[0]["t"] + window_s]
    last = [x for x in after if x["t"] > after[-1]["t"] - window_s]

    def peak(part: list[dict[str, Any]]) -> int:
        return max(sum(x["disk"].values()) for x in part)

    return round(peak(last) / max(1, peak(first)), 3)


def check_targets(figures: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, (op, bound) in TARGETS.items():
        value = figures.get(key)
        met = value is not None and (
            value <= bound if op == "<=" else value < bound if op == "<" else value >= bound
        )
        out[key] = {"value": value, "target": f"{op} {bound:g}", "met": bool(met)}
    return out


@dataclass
class Capacity:
    """What the capacity phase measured, and the pool the producers write from."""

    pool: list[bytes]
    backlog: int  # events produced before the steady phase (the two backlogs)
    alone: float  # events/s over the first backlog
    beside: float  # events/s over the second, beside a producer of another topic


def capacity_phase(
    args: argparse.Namespace,
    broker: Broker,
    topic: str,
    job_proc: Callable[[], subprocess.Popen[bytes]],
    run_dir: Path,
    log_path: Path,
) -> tuple[Capacity, subprocess.Popen[bytes]]:
    """Two backlogs before the job starts (each half on each partition): the first
    learned with the machine to itself, the second while a producer writes another
    topic at the rate the first one gives (the steady phase's producer shares the
    machine too). ``job_proc`` starts the job once the backlogs are written."""
    from connectors.kafka_produce import produce
    from connectors.synthetic import SyntheticConfig, iter_json_lines

    cap = args.capacity_events
    backlog = 2 * cap
    pool = list(iter_json_lines(SyntheticConfig(seed=args.seed), max(args.pool_events, backlog)))
    for p in (0, 1):
        part = pool[:cap][p::2] + pool[cap:backlog][p::2]
        produce(broker.bootstrap, topic, part, api_version=broker.api_version, partition=p)
    job = job_proc()
    began = wait_learned(job, run_dir, 1, log_path)
    half = wait_learned(job, run_dir, cap, log_path)
    capacity_alone = rate_over(cap, began, half)
    side = Producer(broker, SIDE_TOPIC, args.load * capacity_alone, args.seed + 2, pool)
    side.start()
    try:
        end = wait_learned(job, run_dir, backlog, log_path)
    finally:
        side.stopped.set()
        side.join(timeout=60)
    return Capacity(pool, backlog, capacity_alone, rate_over(cap, half, end)), job


@dataclass
class Steady:
    """The steady phase's samples, and the RSS and disk at the warm-up's end and last."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    rss_first: dict[str, dict[int, int]] | None = None
    disk_first: dict[str, int] | None = None
    last_rss: dict[str, dict[int, int]] = field(default_factory=dict)


def take_sample(
    job_proc: subprocess.Popen[bytes],
    broker: Broker,
    producer: Producer,
    run_dir: Path,
    backlog: int,
    t: float,
) -> tuple[dict[str, Any], dict[str, dict[int, int]]]:
    """One sample of the steady phase ``t`` seconds in, and the RSS by process."""
    procs = processes(job_proc, broker)
    rss = rss_by_process(procs)
    cpu = cpu_seconds(procs)
    disk = disk_bytes(run_dir)
    # Learned first: the producer counts a block once the broker acknowledged
    # it, and the job may read and learn it before that acknowledgement.
    learned = learned_count(run_dir)
    produced = backlog + producer.blocks * producer.block
    # Never below 0: a block whose acknowledgement is still on its way is
    # not counted as produced, though the job may have it.
    lag = max(0, produced - learned)
    sample = {
        "t": round(t, 1),
        "produced": produced,
        "learned": learned,
        "lag_events": lag,
        # In seconds of the producer's rate so far (on a small machine
        # it may not reach the rate it was given).
        "lag_s": lag / max(1.0, (produced - backlog) / max(t, 1.0)),
        "rss_mb": {role: round(sum(v.values()) / 2**20, 1) for role, v in rss.items()},
        "rss": {role: {str(pid): b for pid, b in v.items()} for role, v in rss.items()},
        "disk": disk,
        "cpu": {role: round(v, 2) for role, v in cpu.items()},
    }
    return sample, rss


def steady_phase(
    args: argparse.Namespace,
    job_proc: subprocess.Popen[bytes],
    broker: Broker,
    producer: Producer,
    run_dir: Path,
    backlog: int,
) -> Steady:
    """The producer at the rate for ``--minutes``, a sample every ``--sample-s``."""
    steady = Steady()
    t0 = time.monotonic()
    warmup_s = args.warmup_minutes * 60
    next_sample = t0
    while time.monotonic() - t0 < args.minutes * 60:
        if job_proc.poll() is not None:
            break
        now = time.monotonic()
        if now >= next_sample:
            sample, rss = take_sample(job_proc, broker, producer, run_dir, backlog, now - t0)
            steady.samples.append(sample)
            if steady.rss_first is None and now - t0 >= warmup_s:
                steady.rss_first, steady.disk_first = rss, sample["disk"]
            steady.last_rss = rss
            print(
                f"{now - t0:7.0f}s  learned {sample['learned']:,}  lag {sample['lag_s']:.1f}s  "
                f"rss MB {sample['rss_mb']}  disk MB "
                f"{sum(sample['disk'].values()) / 2**20:.1f}",
                flush=True,
            )
            next_sample = now + args.sample_s
        time.sleep(min(0.5, max(0.0, next_sample - time.monotonic())))
    return steady


def end_phase(
    args: argparse.Namespace,
    job_proc: subprocess.Popen[bytes],
    broker: Broker,
    producer: Producer,
    topic: str,
    run_dir: Path,
) -> tuple[dict[str, int], int]:
    """The producer stopped, the job caught up with the topic's end and interrupted: the
    topic's end offsets and the job's exit code."""
    producer.stopped.set()
    producer.join(timeout=60)
    src = group_source(broker, topic)
    ends = {p: src.end_position(p) for p in src.partitions()}
    src.close()
    catch_up(job_proc, run_dir, ends, args.catch_up_s)
    return ends, interrupt(job_proc)


def compute_figures(
    args: argparse.Namespace,
    capacity: Capacity,
    rate: float,
    steady: Steady,
    producer: Producer,
    run_dir: Path,
    ends: dict[str, int],
) -> dict[str, Any]:
    """Every figure of the run (the targets and the samples added after)."""
    samples, backlog = steady.samples, capacity.backlog
    warmup_s = args.warmup_minutes * 60
    steady_s = samples[-1]["t"] if samples else 0.0
    achieved = (samples[-1]["produced"] - backlog) / steady_s if steady_s else 0.0
    window_s = args.window_minutes * 60
    windows = windows_of(samples, 0.0, window_s)
    after_first = [s for s in samples if s["t"] >= window_s] or samples
    two_samples: dict[str, float | None] = {}
    if steady.rss_first is not None:
        two_samples = {
            role: growth_pct(steady.rss_first[role], steady.last_rss[role]) for role in ROLES
        }
    growth = rss_peaks_growth(samples, warmup_s, window_s)
    known = [g for g in growth.values() if g is not None]
    return {
        "minutes": args.minutes,
        "table_rows": args.table_rows,
        "warmup_minutes": args.warmup_minutes,
        "rate": round(rate, 1),
        # What the producer wrote per second, which a loaded machine may keep below
        # the rate: the load the job really had.
        "rate_achieved": round(achieved, 1),
        "producer_retries": producer.errors,
        "capacity_events_per_s": round(capacity.beside, 1),
        "capacity_alone_events_per_s": round(capacity.alone, 1),
        "produced": sum(ends.values()),
        **count_offsets(run_dir, ends),
        "rss_growth_pct_after_warmup": {
            k: None if v is None else round(v, 2) for k, v in growth.items()
        },
        "rss_growth_pct_after_warmup_max": round(max(known), 2) if known else None,
        "rss_growth_pct_two_samples": {
            k: None if v is None else round(v, 2) for k, v in two_samples.items()
        },
        "rss_mb_by_role": samples[-1]["rss_mb"] if samples else {},
        "lag_max_s": round(max(s["lag_s"] for s in after_first), 2) if samples else None,
        "disk_bytes_first_vs_last": disk_peaks_ratio(samples, warmup_s, window_s),
        "disk_bytes_by_kind": {"after_warmup": steady.disk_first, "end": samples[-1]["disk"]}
        if samples
        else {},
        "windows": windows,
        "throughput_last_vs_first_window": (
            round(windows[-1]["events_per_s"] / windows[0]["events_per_s"], 3)
            if len(windows) >= 2 and windows[0]["events_per_s"] > 0
            else None
        ),
    }


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    print_figures({k: v for k, v in figures.items() if k != "samples"}, str)
    if args.json is not None:
        write_json(args.json, figures, announce=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="streamrec-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir, log_path, topic = work / "run", work / "job.log", "soak"
    broker = Broker(args.broker, work, fixed_heap=True)  # see the module docstring
    started: list[subprocess.Popen[bytes]] = []
    producer: Producer | None = None

    def start() -> subprocess.Popen[bytes]:
        started.append(start_job(soak_job(work, broker, topic, args), log_path))
        return started[-1]

    try:
        broker.create_topic(topic, partitions=2)
        broker.create_topic(SIDE_TOPIC, partitions=2)
        capacity, job_proc = capacity_phase(args, broker, topic, start, run_dir, log_path)
        rate = args.rate or args.load * capacity.beside
        print(
            f"capacity {capacity.alone:,.0f} events/s alone, {capacity.beside:,.0f} beside a "
            f"producer; steady phase at {rate:,.0f} events/s"
        )
        pool, backlog = capacity.pool, capacity.backlog
        producer = Producer(broker, topic, rate, args.seed + 1, pool[backlog:] + pool[:backlog])
        producer.start()
        steady = steady_phase(args, job_proc, broker, producer, run_dir, backlog)
        ends, exit_code = end_phase(args, job_proc, broker, producer, topic, run_dir)
        figures = compute_figures(args, capacity, rate, steady, producer, run_dir, ends)
        figures |= {"exit_code": exit_code, "work_dir": str(work)}
        figures["targets"] = check_targets(figures)
        figures["samples"] = steady.samples
        report(figures, args)
        return 0
    finally:
        if producer is not None:
            producer.stopped.set()
        for job_proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job_proc.pid, signal.SIGKILL)
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
