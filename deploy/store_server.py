"""``streamrec store serve``: run one store shard as a process.

The shard restores itself from ``--data-dir`` when it holds a checkpoint (or
from ``--snapshots`` in an object store, when that holds a newer one), and
on SIGTERM (or Ctrl-C) stops taking calls, checkpoints into ``--data-dir`` and
exits 0, so a restart loses nothing that was acknowledged before the signal.

With ``--metrics-port`` it also serves Prometheus metrics over HTTP at
``http://HOST:PORT/metrics`` on the gRPC server's host, labelled
``shard="HOST:GRPC_PORT"`` (the address clients name the shard by).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from embedding_store.follow import FOLLOW_POLL_S
from embedding_store.location import Location
from embedding_store.service import EmbeddingStoreServicer, make_server
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig

if TYPE_CHECKING:
    import grpc

    from monitoring.store_metrics import MetricsServer


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed); it must not be empty."""
    from deploy.cluster import ClusterError, read_token_file

    try:
        return read_token_file(path, "--token-file")
    except ClusterError as exc:
        raise SystemExit(str(exc)) from exc


def _serve_metrics(
    servicer: EmbeddingStoreServicer,
    server: grpc.Server,
    host: str,
    bound: int,
    metrics_port: int | None,
    advertise: str | None,
    who: str,
) -> MetricsServer | None:
    """``/metrics`` of the shard at ``metrics_port`` (None: none); a taken port ends it."""
    if metrics_port is None:
        return None
    from monitoring.store_metrics import serve_store_metrics  # only when asked for

    label = f"{advertise or host}:{bound}"
    try:
        metrics = serve_store_metrics(
            f"{host}:{metrics_port}", label, servicer.stats, servicer.health_status
        )
    except OSError as exc:
        server.stop(None)
        msg = f"--metrics-port {metrics_port}: {exc}"
        raise SystemExit(msg) from exc
    # Printed before the "serving" line: a launcher that waits for that line
    # finds the metrics URL already in the log.
    print(f"streamrec {who}: metrics on {metrics.url} (shard={label})", flush=True)
    return metrics


def _signals_received() -> list[int]:
    """The SIGTERMs and SIGINTs received from now on, appended as they come.

    A plain list, not an Event: a handler that takes a lock deadlocks when a
    second signal lands while the main thread is inside that same lock (seen:
    SIGTERM from the dying parent and one from the test, back to back).
    """
    signals: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return signals


def serve(
    config: StoreConfig,
    *,
    host: str,
    port: int,
    data_dir: Path,
    token: str | None,
    grace_s: float = 5.0,
    metrics_port: int | None = None,
    allow_dirs: tuple[Path, ...] = (),
    mirror: Location | None = None,
    advertise: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then checkpoint into ``data_dir``; returns the exit code.

    ``metrics_port``: serve ``/metrics`` on ``host`` at this port (0: any free
    one); None: no metrics server. ``allow_dirs``: folders besides ``data_dir``
    that Checkpoint and Restore calls may name. ``mirror``: every checkpoint is
    copied there too, and a newer one there is restored at start (an empty disk on
    a new host). ``advertise``: the host clients name this shard by (labels).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shard = StoreShard.open(config, data_dir, mirror=mirror)
    restored = sum(len(t) for t in shard.tables.values())
    servicer = EmbeddingStoreServicer(shard, allow_dirs=allow_dirs)
    server, bound = make_server(shard, host=host, port=port, token=token, servicer=servicer)
    metrics = _serve_metrics(servicer, server, host, bound, metrics_port, advertise, "store")
    signals = _signals_received()
    print(
        f"streamrec store: serving {len(config.tables)} table(s) on {host}:{bound} "
        f"(data dir {data_dir}{f', snapshots {mirror}' if mirror is not None else ''}, "
        f"{restored} rows restored, "
        f"ready in {time.perf_counter() - started:.2f}s)",
        flush=True,
    )
    while not signals:
        time.sleep(0.1)
    print("streamrec store: stopping; checkpointing into the data dir", flush=True)
    server.stop(grace_s).wait()
    try:
        result = shard.checkpoint(data_dir, "auto")
    finally:
        if metrics is not None:
            metrics.close()
    print(
        f"streamrec store: wrote {result.kind} checkpoint {result.seq} "
        f"({result.rows} rows, {result.bytes} bytes) to {result.manifest}",
        flush=True,
    )
    return 0


def serve_replica(
    config: StoreConfig,
    *,
    follow: str,
    host: str,
    port: int,
    token: str | None,
    data_dir: Path,
    snapshots: Location | None = None,
    poll_s: float = FOLLOW_POLL_S,
    metrics_port: int | None = None,
    advertise: str | None = None,
    grace_s: float = 2.0,
) -> int:
    """Serve a read-only replica of the training shard at ``follow`` until SIGTERM/SIGINT.

    With ``snapshots`` (the training shard's data dir or snapshot mirror) the
    replica starts from its newest checkpoint, so it serves even while the
    training shard is down, and asks only for the rows changed since; the
    checkpoint is fetched into ``data_dir``. Health answers SYNCING until every
    table has caught up, then SERVING. Nothing is written back: on a stop the
    replica just exits 0.
    """
    import threading

    from embedding_store.errors import CheckpointError
    from embedding_store.replica import ShardFollower
    from embedding_store.transport.base import RetryPolicy
    from embedding_store.transport.grpc import GrpcTransport

    data_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        shard = StoreShard.open(config, data_dir, mirror=snapshots, read_only=True)
    except CheckpointError as exc:
        # An unreadable snapshot (say, one the training shard is collecting) only costs
        # a copy from the shard itself.
        print(f"streamrec store replica: not starting from the snapshots: {exc}", flush=True)
        shard = StoreShard(config, read_only=True)
    restored = sum(len(t) for t in shard.tables.values())
    # Few quick attempts: a round that fails is tried again a poll later anyway.
    source = GrpcTransport(
        follow,
        token=token,
        max_message_bytes=config.max_message_bytes,
        retry=RetryPolicy(attempts=2, timeout_s=30.0),
        shared_memory=False,
    )
    follower = ShardFollower(shard, source, poll_s=poll_s)
    servicer = EmbeddingStoreServicer(shard, health=follower.health, current_at=follower.current_at)
    server, bound = make_server(shard, host=host, port=port, token=token, servicer=servicer)
    metrics = _serve_metrics(
        servicer, server, host, bound, metrics_port, advertise, "store replica"
    )
    signals = _signals_received()
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,), name="replica-follow", daemon=True)
    thread.start()
    print(
        f"streamrec store replica: serving {len(config.tables)} table(s) on {host}:{bound} "
        f"(following {follow} every {poll_s:g}s; {restored} rows from snapshots"
        f"{f' {snapshots}' if snapshots is not None else ''}; "
        f"up in {time.perf_counter() - started:.2f}s)",
        flush=True,
    )
    announced = False
    while not signals:
        if not announced and follower.caught_up.is_set():
            announced = True
            st = follower.stats
            print(
                f"streamrec store replica: caught up with {follow} "
                f"({st.copies} table(s) copied, {st.rows_applied} rows applied)",
                flush=True,
            )
        time.sleep(0.1)
    stop.set()
    server.stop(grace_s).wait()
    thread.join(timeout=grace_s + 30)
    source.close()
    if metrics is not None:
        metrics.close()
    print("streamrec store replica: stopped", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - used via the CLI
    sys.exit("run `streamrec store serve --help`")
