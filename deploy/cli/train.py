"""The training commands of ``streamrec``: ``demo``, ``run`` and ``backfill``.

They load (or, for the demo, build) a job, start what it needs, show a live
progress line and print a summary; Ctrl-C or SIGTERM stops the job cleanly
(a last checkpoint first). Imports of torch and Dask happen inside the
commands so that ``streamrec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from deploy.cli.usage import UsageError, load_job
from deploy.status_line import StatusLine, progress_bar

if TYPE_CHECKING:
    # Imported in the commands: deploy.config pulls in every source's config (numba,
    # kafka-python), which `streamrec --help` must not wait for.
    from deploy.config import JobConfig
    from trainer.checkpoint import JobManifest
    from trainer.progress import LoopStats, Progress


def demo_job(
    run_dir: Path, *, events: int, partitions: int = 2, seed: int = 0, dim: int = 16
) -> JobConfig:
    """The embedded default: the synthetic stream, two local shards, one trainer.

    >>> job = demo_job(Path("runs/demo"), events=1000)
    >>> job.source.kind, job.trainer.mode, job.cluster.store_shards
    ('synthetic', 'hybrid', 2)
    """
    from connectors.synthetic import synthetic_feature_spec, synthetic_store_section
    from deploy.config import JobConfig

    return JobConfig.model_validate(
        {
            "store": synthetic_store_section(dim=dim),
            "features": synthetic_feature_spec().model_dump(),
            "source": {
                "kind": "synthetic",
                "seed": seed,
                "partitions": partitions,
                "events": -(-events // partitions),
            },
            "trainer": {
                "mode": "hybrid",
                "staleness": 4,
                "batch_size": 4096,
                "model": {"kind": "ffnn", "hidden": [512, 256]},
                "optimizer": {"kind": "adam", "lr": 0.001},
                "log_every_s": 1.0,
                "checkpoint": {"every_steps": 100, "every_s": 60},
            },
            "cluster": {"workers": 2, "store_shards": 2},
            "run_dir": str(run_dir),
        }
    )


class ProgressLine(StatusLine):
    """A training job's status line: step, samples, rate, AUC, loss, staleness."""

    def __init__(
        self,
        out: TextIO,
        *,
        best_auc: float | None = None,
        total: int | None = None,
        every_s: float = 5.0,
    ) -> None:
        super().__init__(out, every_s=every_s)
        self.best_auc = best_auc
        self.total = total
        self.last: Any = None

    def text(self, p: Any) -> str:
        """One progress line for ``p`` (a ``trainer.progress.Progress``)."""
        # Every rank's samples (the step's sums), where the report has them.
        ranks = getattr(p, "ranks", 1)
        samples, rate, total = (
            (p.job_samples, p.job_samples_per_s, p.job_samples_total)
            if ranks > 1
            else (p.samples, p.samples_per_s, p.samples_total)
        )
        parts = [f"step {p.step:>6}", f"{samples:>10,} samples", f"{rate:>8,.0f}/s"]
        if ranks > 1:
            parts[1] += f" ({ranks} ranks)"
        if self.total:
            parts.insert(0, progress_bar(total / self.total))
        auc = p.metrics.auc
        everyone = getattr(p, "job_metrics", None)
        if everyone is not None and everyone.auc is not None:
            mine = f"{auc:.4f}" if auc is not None else "-"
            parts.append(f"AUC {everyone.auc:.4f} (rank {p.rank} {mine})")
        else:
            parts.append(f"AUC {auc:.4f}" if auc is not None else "AUC -")
        best = self.best_auc if self.best_auc is not None else getattr(p, "best_auc", None)
        if best is not None:
            parts.append(f"(best {best:.4f})")
        if p.loss is not None:
            parts.append(f"loss {p.loss:.4f}")
        parts.append(f"staleness {p.staleness}")
        parts.append(f"pushes queued {p.pushes_queued}")
        return "  ".join(parts)

    def __call__(self, p: Any) -> None:
        self.last = p  # the loop's final report ends every run: the summary reads it
        self.show(self.text(p))


def _install_stop() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: give up on the clean stop
        print("\nstopping: finishing the step and taking a checkpoint ...", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def _say_resume(job: JobConfig) -> None:
    """Say where the job resumes: the newest checkpoint it is about to restore."""
    from deploy.job import checkpoint_location
    from embedding_store.errors import CheckpointError
    from trainer.checkpoint import CheckpointBook, JobCheckpointError

    try:
        manifest = CheckpointBook(checkpoint_location(job)).latest()
    except (OSError, CheckpointError, JobCheckpointError):
        return  # the job itself says what is wrong with its checkpoints
    if manifest is None:
        return
    offsets = ", ".join(f"{p}={n:,}" for p, n in sorted(manifest.positions.items()))
    print(
        f"resuming from checkpoint step {manifest.step} ({manifest.samples:,} samples learned), "
        f"offsets {offsets or 'none'}"
    )


def _print_summary(
    job: JobConfig,
    stats: LoopStats,
    manifest: JobManifest | None,
    last: Progress | None,
    elapsed: float,
) -> None:
    """The job's summary: what it trained, where the time went, its AUC and what it
    healed (``last``: the final progress, None if none came)."""
    print(
        f"trained {stats.samples:,} samples in {stats.steps} steps, "
        f"{elapsed:.1f}s ({stats.samples / max(elapsed, 1e-9):,.0f} samples/s overall); "
        f"stopped by {stats.stopped_by}"
    )
    print(
        f"time: waiting for batches {stats.wait_s:.1f}s, compute {stats.compute_s:.1f}s, "
        f"push queue {stats.push_wait_s:.1f}s, rank sync {stats.sync_s:.1f}s, "
        f"{stats.checkpoints} checkpoints"
    )
    final = last.metrics if last is not None else None
    everyone = getattr(last, "job_metrics", None)  # every rank's predictions
    best = last.best_auc if last is not None else None
    if everyone is not None and everyone.auc is not None:
        rank0 = f", rank 0 {final.auc:.4f}" if final is not None and final.auc else ""
        print(f"progressive AUC {everyone.auc:.4f} (every rank's predictions{rank0})")
        final = everyone
    elif final is not None and final.auc is not None:
        best_text = f" (the stream's best achievable: {best:.4f})" if best is not None else ""
        print(f"progressive AUC {final.auc:.4f}{best_text}")
    if final is not None and final.logloss is not None:
        calibration = (
            f", calibration {final.calibration:.3f} (mean prediction / label rate)"
            if final.calibration is not None
            else ""
        )
        print(f"progressive logloss {final.logloss:.4f}{calibration}")
    if stats.bad_records:
        print(f"{stats.bad_records} bad records dead-lettered (see {job.run_dir})")
    if stats.recoveries:
        times = ", ".join(f"{s:.1f}s" for s in stats.recovery_s)
        print(
            f"recovered {stats.recoveries} time(s) from a lost store shard by rolling back "
            f"to the newest checkpoint ({times})"
        )
    if stats.rank_restarts:
        print(
            f"started the trainer ranks again {stats.rank_restarts} time(s) after a rank "
            "process or the Dask scheduler was lost, each from the newest checkpoint (the "
            "figures above count from the last start)"
        )
    if manifest is not None:
        print(f"checkpoint: {manifest.path} (step {manifest.step})")


def _train(
    job: JobConfig,
    *,
    max_events: int | None,
    max_time_s: float | None,
    total: int | None = None,
    next_steps: str = "",
    serve_port: int | None = None,
) -> int:
    """Run ``job``; with ``serve_port`` also serve predictions beside it (``--serve``)."""
    from connectors.kafka import UnknownTopic
    from connectors.kafka_client import KafkaUnavailable
    from deploy.config import ConfigError
    from deploy.job import JobError, run_job

    line = ProgressLine(sys.stdout, total=total)
    stop = _install_stop()

    def announce(services: Any) -> Any:
        if services.dashboard:
            print(f"Dask dashboard: {services.dashboard}")
            page = services.dashboard.rsplit("/", 1)[0]
            print(f"training page: {page}/streamrec   metrics: {page}/metrics")
        print(f"store: {services.store}   run dir: {job.run_dir}")
        for i, url in enumerate(services.store_metrics):
            print(f"store shard {i} metrics: {url}")
        if serve_port is not None:
            from deploy.cli.serve import ServingBeside

            token_file = job.cluster.token_file or job.run_dir / "store.token"
            beside.append(
                ServingBeside(job, services.store, token_file, serve_port, services.scheduler)
            )
            print(
                f"predictions: {beside[0].url} (Open Inference Protocol; answers once the "
                f"first weights are published, a second after the first step), e.g.\n"
                f"  {beside[0].curl}",
                flush=True,
            )
            # The server outlives the job's cluster: it stops reporting to it first.
            return beside[0].stop_reporting
        return None

    _say_resume(job)
    started = time.monotonic()
    beside: list[Any] = []
    trained = False
    try:
        stats, manifest = run_job(
            job,
            max_events=max_events,
            max_time_s=max_time_s,
            stop=stop,
            on_progress=line,
            on_services=announce,
        )
        trained = True
    except ConfigError as exc:
        line.done()
        raise UsageError(str(exc)) from exc
    except (JobError, KafkaUnavailable, UnknownTopic) as exc:
        # What could not be reached or recovered, in one line: no traceback.
        line.done()
        elapsed = time.monotonic() - started
        print(f"streamrec: {exc} (after {elapsed:.1f}s)", file=sys.stderr)
        return 1
    finally:
        if beside and (stop.is_set() or not trained):
            beside[0].close()  # the job failed or was stopped: its server goes too
    line.done()
    _print_summary(job, stats, manifest, line.last, time.monotonic() - started)
    if next_steps:
        print(next_steps)
    if beside and not stop.is_set():
        print(f"still serving the trained model on {beside[0].url}; Ctrl-C stops it", flush=True)
        stop.wait()
        beside[0].close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    job = demo_job(args.run_dir, events=args.events)
    if args.fresh and args.run_dir.exists():
        import shutil

        shutil.rmtree(args.run_dir)
    print(
        f"streamrec demo: {args.events:,} synthetic events, 2 store shards, "
        "2 Dask workers, 1 trainer (hybrid, staleness 4)"
    )
    return _train(
        job,
        max_events=None,
        max_time_s=args.max_time,
        total=args.events,
        next_steps=demo_next_steps(args.run_dir),
        serve_port=args.serve_port if args.serve else None,
    )


def demo_next_steps(run_dir: Path) -> str:
    """What the demo says to run next: each line works as printed (tests run them)."""
    return (
        f"next: `streamrec report {run_dir}` plots this run's loss, AUC, "
        "throughput and staleness.\n"
        "from Kafka: `streamrec kafka up`, then `streamrec produce --to "
        "kafka://127.0.0.1:9092/events --events 200000`, then `streamrec run "
        "examples/kafka.yaml --max-events 200000`.\n"
        "from history: `streamrec synth --to runs/data/history.parquet --events 1000000`, "
        "then `streamrec backfill examples/backfill.yaml --from "
        "runs/data/history.parquet`.\n"
        'your own records: see docs/own-data.md, "Your own data".'
    )


def cmd_run(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    return _train(job, max_events=args.max_events, max_time_s=args.max_time)


def cmd_backfill(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    if args.paths:
        from deploy.config import JobConfig

        source: dict[str, Any] = {"kind": "parquet", "paths": [str(p) for p in args.paths]}
        if job.source is not None and job.source.kind == "parquet":
            source = {**job.source.model_dump(), **source}
        job = JobConfig.model_validate({**job.model_dump(), "source": source})
    if job.source is None or job.source.kind != "parquet":
        msg = "give Parquet files with --from, or a `source: {kind: parquet}`"
        raise UsageError(msg)
    from deploy.job import build_source

    try:
        src = build_source(job)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    total = sum(src.end_position(p) or 0 for p in src.partitions())
    return _train(job, max_events=args.max_events, max_time_s=args.max_time, total=total)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-events", type=int, default=None, help="stop after N events")
    parser.add_argument("--max-time", type=float, default=None, help="stop after N seconds")


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo``, ``run`` and ``backfill`` to the ``streamrec`` parser."""
    demo = sub.add_parser(
        "demo",
        help="train on the synthetic stream with everything local (the embedded default)",
        description=(
            "Start two store shards and a local Dask cluster, train one trainer on the "
            "synthetic Criteo-like stream, show live progress and a summary."
        ),
    )
    demo.add_argument("--events", type=int, default=600_000, help="events to train on")
    demo.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    demo.add_argument("--max-time", type=float, default=None, help="stop after N seconds")
    demo.add_argument(
        "--fresh",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start from scratch (default) or resume the demo's checkpoint",
    )
    demo.add_argument(
        "--serve",
        action="store_true",
        help=(
            "also serve predictions over HTTP while it trains (a serving replica per shard, "
            "the Open Inference Protocol; prints the URL and a curl line), and after it until "
            "Ctrl-C"
        ),
    )
    demo.add_argument(
        "--serve-port", type=int, default=8000, help="the --serve port (8000; 0: any free one)"
    )
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser(
        "run",
        help="train continuously from the job's source (Kafka) until it ends or you stop it",
        description=(
            "Train from the job's source as long as the stream lasts (or --max-events / "
            "--max-time); restarts from the newest checkpoint in the run directory."
        ),
    )
    run.add_argument("job", type=Path, help="job YAML (see examples/kafka.yaml)")
    _add_limits(run)
    run.set_defaults(func=cmd_run)

    backfill = sub.add_parser(
        "backfill",
        help="train over Parquet history, with a progress bar; resumable",
        description=(
            "Train over Parquet files (trainer.batch_size rows per step) with a progress bar; "
            "a stopped backfill resumes at its checkpoint's position."
        ),
    )
    backfill.add_argument("job", type=Path, help="job YAML (see examples/backfill.yaml)")
    backfill.add_argument(
        "--from", dest="paths", nargs="+", type=Path, help="Parquet files, folders or globs"
    )
    _add_limits(backfill)
    backfill.set_defaults(func=cmd_backfill)
