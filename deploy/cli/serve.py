"""``streamrec score``, ``evaluate`` and ``serve``: a file scored, or predictions served over
HTTP, with a job's parameters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deploy.cli.usage import UsageError, load_job
from deploy.status_line import StatusLine, progress_bar

# Each attempt of a call to a replica process: short, so that a replica that stopped
# answering turns readiness off within the retry policy's attempts (about 20 s); a
# request's read is bounded by its deadline, and retried within it.
REPLICA_CALL_TIMEOUT_S = 3.0


def _scored(args: argparse.Namespace, command: str, *, labels_required: bool) -> Any:
    """The file's scores with the parameters asked for."""
    from deploy.scoring import ScoringParameters, load_model
    from serving.offline import OfflineError
    from trainer.checkpoint import JobCheckpointError

    job = load_job(args.job)
    if job.features is None:
        msg = f"{args.job} has no `features:` section"
        raise UsageError(msg)
    params = ScoringParameters(args.job, args.checkpoint, args.shards, labels_required)
    on_cluster = args.workers > 0 or args.scheduler is not None
    try:
        if on_cluster:
            return _score_on_cluster(args, command, job, params)
        model, manifest, where = load_model(params, job)
        _say_checkpoint(command, manifest, where)
        return _score_with_progress(model, args.source, args.batch)
    except (OfflineError, JobCheckpointError, OSError) as exc:
        raise UsageError(str(exc)) from exc


def _say_checkpoint(command: str, manifest: Any, where: str) -> None:
    print(
        f"streamrec {command}: checkpoint step {manifest.step} ({manifest.samples:,} samples "
        f"learned) from {where}",
        flush=True,
    )


def _score_with_progress(model: Any, path: Path, batch: int) -> Any:
    from serving.offline import count_records, score_file

    total = max(1, count_records(path))
    status = StatusLine(sys.stdout)

    def show(done: int) -> None:
        status.show(f"{progress_bar(done / total)} {done:,}/{total:,} records")

    scores = score_file(model, path, batch=batch, on_progress=show)
    status.done()
    return scores


def _score_on_cluster(args: argparse.Namespace, command: str, job: Any, params: Any) -> Any:
    """Score the file's parts as tasks on a Dask cluster (see ``deploy.scoring``)."""
    from distributed import Client

    from deploy.job import checkpoint_location
    from deploy.local.dask_cluster import local_dask_cluster
    from deploy.scoring import score_on_cluster
    from serving.offline import pick_checkpoint, plan_parts
    from trainer.checkpoint import CheckpointBook

    book = CheckpointBook(checkpoint_location(job))
    _say_checkpoint(command, pick_checkpoint(book, args.checkpoint), str(book.location))
    parts = plan_parts(args.source, args.part_records)
    total = max(1, sum(p.records for p in parts))
    cluster = None
    if args.scheduler is None:
        cluster = local_dask_cluster(
            workers=args.workers, threads_per_worker=1, dashboard_address=":0",
            log_path=job.run_dir / f"{command}-scheduler.log", scheduler_process=False,
        )  # fmt: skip
    address = args.scheduler if cluster is None else cluster.scheduler_address
    where = f"the Dask cluster at {address}" if cluster is None else f"{args.workers} workers"
    print(f"streamrec {command}: {len(parts):,} parts on {where}", flush=True)
    status = StatusLine(sys.stdout)

    def show(done: int) -> None:
        status.show(f"{progress_bar(done / total)} {done:,}/{total:,} records")

    try:
        with Client(address, set_as_default=False) as client:  # type: ignore[no-untyped-call]
            scores = score_on_cluster(
                client, params, args.source, parts, tuple(job.features.labels),
                batch=args.batch, on_progress=show,
            )  # fmt: skip
    finally:
        if cluster is not None:
            cluster.close()
    status.done()
    return scores


def cmd_score(args: argparse.Namespace) -> int:
    from serving.offline import write_scores

    scores = _scored(args, "score", labels_required=False)
    rejected = write_scores(scores, args.out)
    scored = scores.records - len(scores.bad)
    print(f"streamrec score: {scored:,} of {scores.records:,} records scored into {args.out}")
    if rejected is not None:
        print(
            f"streamrec score: {len(scores.bad):,} bad records not scored, with their reasons, "
            f"in {rejected}"
        )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from connectors.validate import count_reasons
    from serving.offline import evaluate_scores

    scores = _scored(args, "evaluate", labels_required=True)
    result = evaluate_scores(scores)
    reasons = count_reasons(scores.bad)
    for head, m in result.items():
        fmt = {k: "-" if v is None else f"{v:.4f}" for k, v in m.items() if k != "samples"}
        print(
            f"{head}: AUC {fmt['auc']}, logloss {fmt['logloss']}, calibration "
            f"{fmt['calibration']} over {m['samples']:,} records"
        )
    if reasons:
        listed = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
        print(f"streamrec evaluate: {len(scores.bad):,} bad records left out ({listed})")
    if args.json is not None:
        body = {"heads": result, "records": scores.records, "bad": reasons}
        args.json.write_text(json.dumps(body, indent=1) + "\n")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=Path, help="the job YAML")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        required=True,
        metavar="FILE",
        help="records: a JSON-lines file in the job's format, or a Parquet file (.parquet)",
    )
    parser.add_argument(
        "--checkpoint",
        type=int,
        metavar="STEP",
        help="the job checkpoint at this step (default: the newest)",
    )
    parser.add_argument(
        "--shards",
        nargs="+",
        metavar="DIR_OR_URL",
        help=(
            "each store shard's checkpoint folder (data dir or snapshot URL), in shard order "
            "(default: the local job's run_dir/store/shard-NNN)"
        ),
    )
    parser.add_argument("--batch", type=int, default=4096, help="records scored at once (4096)")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="score on a local Dask cluster of N worker processes, each with its own copy of "
        "the model (for large files; default 0: in this process)",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="score on this running Dask cluster instead (its workers must read the file "
        "and the checkpoint where this command does)",
    )
    parser.add_argument(
        "--part-records",
        type=int,
        default=262_144,
        metavar="N",
        help="records per task on a cluster (262,144; Parquet: whole row groups)",
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``score`` and ``evaluate`` to the ``streamrec`` parser."""
    score = sub.add_parser(
        "score",
        help="score a file of records with a job checkpoint's parameters",
        description=(
            "Score every record of a JSON-lines or Parquet file with one job checkpoint's "
            "dense weights and store rows (restored in this process, or in each worker with "
            "--workers/--scheduler: the job need not run), "
            "with the job's own decoding, hashing and pooling. Writes a Parquet file with the "
            "record's position and one probability per label head; bad records go, with "
            "their reasons, to OUT.rejected.jsonl. Labels are not needed."
        ),
    )
    _common(score)
    score.add_argument("--to", dest="out", type=Path, required=True, metavar="OUT.parquet")
    score.set_defaults(func=cmd_score)
    evaluate = sub.add_parser(
        "evaluate",
        help="AUC, logloss and calibration per head on a held-out file, without training",
        description=(
            "Score a labelled held-out file as `streamrec score` does and print AUC, logloss "
            "and calibration (mean prediction over mean label) per label head. Records without "
            "a label are left out and counted by reason."
        ),
    )
    _common(evaluate)
    evaluate.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    evaluate.set_defaults(func=cmd_evaluate)
    add_serve_command(sub)


class ServingStack:
    """A job's prediction server: its model over the rows at ``store``, the newest
    published dense weights, and what keeps both fresh."""

    def __init__(
        self,
        job: Any,
        store: str,
        store_token: str | None,
        *,
        host: str,
        port: int,
        token: str | None = None,
        scheduler: str | None = None,
        follow: bool = False,
        grpc_port: int | None = None,
    ) -> None:
        """``store``: the serving replicas, or with ``follow`` the training shards, which
        this process then follows itself (see :mod:`serving.replicas`).
        ``grpc_port``: also serve over gRPC on this port (None: HTTP only).
        ``scheduler``: a Dask scheduler with the streamrec plugin to report to (its
        dashboard page then shows this server); None: no reports."""
        from connectors.codecs import make_codec
        from deploy.job import build_codec, serving_location
        from embedding_store.client import StoreClient
        from embedding_store.transport.base import RetryPolicy
        from serving.freshness import FreshnessCollector, SparseFreshness
        from serving.http import InferenceServer
        from serving.model import DenseFollower, ServingModel
        from serving.replicas import LocalReplicas, ReplicaRows, StoreRows
        from serving.warmup import Warmup

        cfg = job.serving
        self.replicas: LocalReplicas | None = None
        self.rows: ReplicaRows | StoreClient
        if follow:
            self.replicas = LocalReplicas.follow(
                job.store, store, token=store_token, poll_s=cfg.follow_poll_s
            )
            self.rows = self.replicas.rows
        else:
            # Retried as the store's client retries (a replica that restarts is waited
            # for), each attempt short (see REPLICA_CALL_TIMEOUT_S).
            retry = RetryPolicy(timeout_s=REPLICA_CALL_TIMEOUT_S)
            self.rows = StoreClient.connect(store, token=store_token, retry=retry)
        dims = {name: t.dim for name, t in job.store.tables.items()}
        self.where = serving_location(job)
        self.dense = DenseFollower(self.where, job.trainer, job.features, dims, poll_s=cfg.poll_s)
        self.dense.start()
        self.sparse = SparseFreshness(self.rows)
        self.sparse.start()
        codec = build_codec(job) or make_codec("json")
        # Rows of replica processes go through the client; StoreRows adds the flat read.
        reader = self.rows if isinstance(self.rows, ReplicaRows) else StoreRows(self.rows)
        self.model = ServingModel(
            cfg.model_name, job.features, codec, reader, self.dense,
            sparse_version=self.sparse.version, rows_ready=self._rows_ready,
        )  # fmt: skip
        # Readiness waits for the kernels, compiled on one made-up record (serving.warmup).
        self.warmup = Warmup(self.model.ready, self.model.warm_up)
        self.server = InferenceServer(
            self.model,
            host=host,
            port=port,
            token=token,
            max_request_bytes=cfg.max_request_bytes,
            max_batch_records=cfg.max_batch_records,
            max_request_records=cfg.max_request_records,
            max_queued_records=cfg.max_queued_records,
            request_timeout_s=cfg.request_timeout_s,
            max_connections=cfg.max_connections,
            idle_timeout_s=cfg.idle_timeout_s,
            read_timeout_s=cfg.read_timeout_s,
            readiness=self._ready_to_serve,
        )
        self.server.metrics.registry.register(FreshnessCollector(self.sparse, self.dense))
        self.grpc: Any = None
        self.grpc_address: str | None = None
        try:
            self.url = self.server.start()
            if grpc_port is not None:
                from serving.grpc_service import GrpcInferenceServer

                self.grpc = GrpcInferenceServer(
                    self.server, host=host, port=grpc_port, token=token,
                    max_request_bytes=cfg.max_request_bytes,
                )  # fmt: skip
                self.grpc_address = self.grpc.start()
        except BaseException:
            self.close(server=getattr(self, "url", None) is not None)  # the HTTP one started
            raise
        self._client: Any = None
        self._reporter: Any = None
        if scheduler is not None:
            self._report_to(scheduler, host, cfg.model_name)
        auth = f" -H 'Authorization: Bearer {token}'" if token is not None else ""
        self.curl = (
            f"curl -s {self.url}/v2/models/{cfg.model_name}/infer{auth} "
            f"-H 'Content-Type: application/json' -d '{_example_record(job)}'"
        )

    def _ready_to_serve(self) -> bool:
        """Readiness: the kernels warmed up, and replica processes answered the last
        poll, every one caught up."""
        return self.warmup.done() and (self.replicas is not None or self.sparse.answering)

    def _rows_ready(self) -> bool:
        """Replicas in this process are ready once caught up and their version known."""
        if self.replicas is None:
            return True
        if self.replicas.caught_up() and self.sparse.as_of is None:
            self.sparse.poll()
        return self.sparse.as_of is not None

    def _report_to(self, scheduler: str, host: str, name: str) -> None:
        import logging
        import socket

        from distributed import Client

        from monitoring.serve_reporter import ServeReporter
        from monitoring.types import TOPIC

        try:
            self._client = Client(  # type: ignore[no-untyped-call]
                scheduler, timeout="5s", set_as_default=False
            )
        except (OSError, TimeoutError) as exc:
            logging.getLogger(__name__).warning(
                "serving without reports to the dashboard: scheduler %s: %s", scheduler, exc
            )
            return
        # A name per server: with --host 0.0.0.0 every host's URL would read the same.
        where = socket.getfqdn() if host in {"0.0.0.0", "::"} else host
        client = self._client
        self._reporter = ServeReporter(
            lambda report: client.log_event(TOPIC, report),
            f"http://{where}:{self.server.port}/v2/models/{name}",
            self.server.metrics.registry,
        )
        self._reporter.start()

    def stop_reporting(self) -> None:
        """Stop reporting to the Dask scheduler (before it goes: a server that goes on
        serving after its job's cluster closed reports nothing, and says nothing)."""
        reporter, self._reporter = getattr(self, "_reporter", None), None
        if reporter is not None:
            reporter.close()
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            client.close()

    def close(self, *, server: bool = True) -> None:
        self.stop_reporting()
        self.warmup.close()
        if getattr(self, "grpc", None) is not None:
            self.grpc.stop()  # before the HTTP server whose loop its calls wait on
        if server:
            self.server.stop()
        self.sparse.close()
        self.dense.close()
        if self.replicas is not None:
            self.replicas.close()
        else:
            self.rows.close()


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from deploy.job.threads import take_short_gil_turns
    from deploy.store_server import read_token
    from embedding_store.errors import StoreError

    job = load_job(args.job)
    cfg = job.serving
    if job.features is None:
        msg = f"{args.job} has no `features:` section"
        raise UsageError(msg)
    if args.follow is not None and args.store is not None:
        msg = "give --store or --follow, not both"
        raise UsageError(msg)
    store = args.follow or args.store or cfg.store or job.cluster.store
    if store is None:
        msg = (
            "give the serving replicas with --store grpc://HOST:PORT,... "
            "(or serving.store in the job YAML)"
        )
        raise UsageError(msg)
    token_file = args.token_file or cfg.token_file
    token = read_token(token_file) if token_file is not None else None
    store_token_file = args.store_token_file or job.cluster.token_file
    store_token = read_token(store_token_file) if store_token_file is not None else None
    port = cfg.port if args.port is None else args.port
    # The event loop, the model's thread and the replicas' and followers' threads hand
    # each request along: with the 5 ms default turn, a hand-off to a thread waiting
    # for the GIL can wait out a busy thread's whole turn (as a trainer rank's do).
    take_short_gil_turns()
    if cfg.torch_threads is not None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    try:
        stack = ServingStack(
            job,
            store,
            store_token,
            host=args.host or cfg.host,
            port=port,
            token=token,
            scheduler=job.cluster.scheduler,
            follow=args.follow is not None,
            grpc_port=cfg.grpc_port if args.grpc_port is None else args.grpc_port,
        )
    except (StoreError, ValueError) as exc:
        flag = "--follow" if args.follow is not None else "--store"
        msg = f"{flag} {store}: {exc}"
        raise UsageError(msg) from exc
    except OSError as exc:
        msg = f"cannot listen on port {port}: {exc}"
        raise UsageError(msg) from exc
    rows = f"following {store} every {cfg.follow_poll_s:g}s" if args.follow else f"from {store}"
    print(
        f"streamrec serve: model {cfg.model_name!r} on {stack.url} (rows {rows}, dense "
        f"weights from {stack.where}; ready once a version is published and the kernels "
        f"are compiled)\n  {stack.curl}",
        flush=True,
    )
    if stack.grpc_address is not None:
        print(f"streamrec serve: gRPC (KServe v2 GRPCInferenceService) on {stack.grpc_address}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    announced = False
    while not stop.wait(0.2):
        current = stack.dense.current
        if not announced and current is not None and stack.warmup.done():
            print(
                f"streamrec serve: ready with dense version {current.entry.version} (scoring "
                f"kernels warmed up in {stack.warmup.seconds or 0:.1f}s)",
                flush=True,
            )
            announced = True
    stack.close()
    print("streamrec serve: stopped", flush=True)
    return 0


class ServingBeside:
    """A prediction server beside a local job (``demo --serve``): one serving replica per
    store shard and a :class:`ServingStack` over them, in this process."""

    def __init__(
        self, job: Any, store: str, token_file: Path, port: int, scheduler: str | None = None
    ) -> None:
        from deploy.local.shards import ShardProcess
        from deploy.store_server import read_token

        self.replicas = []
        for i, address in enumerate(store.removeprefix("grpc://").split(",")):
            self.replicas.append(
                ShardProcess.start(
                    job.run_dir / "job.yaml",
                    job.run_dir / "serving" / f"replica-{i:03d}",
                    token_file=token_file,
                    follow=address,
                    die_with_parent=True,
                )
            )
        replicas = "grpc://" + ",".join(r.address for r in self.replicas)
        self.stack = ServingStack(
            job,
            replicas,
            read_token(token_file),
            host=job.serving.host,
            port=port,
            scheduler=scheduler,
        )
        self.url, self.curl = self.stack.url, self.stack.curl

    def stop_reporting(self) -> None:
        """The stack's :meth:`ServingStack.stop_reporting`."""
        self.stack.stop_reporting()

    def close(self) -> None:
        self.stack.close()
        for r in self.replicas:
            r.stop()


def _example_record(job: Any) -> str:
    """A one-record infer request body for the job's features (JSON, for the curl line)."""
    record = job.features.example_record()
    for label in job.features.labels:
        del record[label]
    body = {
        "inputs": [
            {"name": "records", "datatype": "BYTES", "shape": [1], "data": [json.dumps(record)]}
        ]
    }
    return json.dumps(body, separators=(",", ":"))


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the ``streamrec`` parser."""
    serve = sub.add_parser(
        "serve",
        help="answer predictions over HTTP (Open Inference Protocol) while the job trains",
        description=(
            "Serve the job's model over HTTP in the Open Inference Protocol (KServe v2, as "
            "Triton and MLServer speak it): POST /v2/models/NAME/infer with an input `records` "
            "(BYTES, one record in the job's format per element) gives one FP32 output per "
            "label head, and the versions used in the response's parameters. Rows come from "
            "the serving replicas (--store), the dense weights from the newest version rank 0 "
            "published (serving.dir); /v2/health/ready answers 200 once one is loaded and "
            "the scoring kernels are compiled (tens of seconds with an empty numba cache). "
            "Prometheus metrics at /metrics."
        ),
    )
    serve.add_argument("job", type=Path, help="the job YAML (its features:, store: and serving:)")
    serve.add_argument(
        "--store", metavar="grpc://HOST:PORT,...", help="the serving replicas (serving.store)"
    )
    serve.add_argument(
        "--follow",
        metavar="grpc://HOST:PORT,...",
        help=(
            "follow the training shards from this process instead of reading serving "
            "replicas: rows are read from memory (lowest latency; each server then holds "
            "a copy of every table)"
        ),
    )
    serve.add_argument("--host", help="address to bind (serving.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (serving.port, 8000; 0: any free)")
    serve.add_argument(
        "--grpc-port",
        type=int,
        help="also serve over gRPC on this port (serving.grpc_port; default: HTTP only; "
        "0: any free)",
    )
    serve.add_argument(
        "--token-file", type=Path, help="require this token from clients (serving.token_file)"
    )
    serve.add_argument(
        "--store-token-file",
        type=Path,
        help="the store's token, for the replicas (cluster.token_file)",
    )
    serve.set_defaults(func=cmd_serve)
