"""``streamrec store serve``: run one store shard as a process.

The shard restores itself from ``--data-dir`` when it holds a checkpoint, and
on SIGTERM (or Ctrl-C) stops taking calls, checkpoints into ``--data-dir`` and
exits 0, so a restart loses nothing that was acknowledged before the signal.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from embedding_store.service import make_server
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace removed); it must not be empty."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        msg = f"--token-file {path}: cannot read it ({exc.strerror})"
        raise SystemExit(msg) from exc
    if not token:
        msg = f"--token-file {path}: the file is empty"
        raise SystemExit(msg)
    return token


def serve(
    config: StoreConfig,
    *,
    host: str,
    port: int,
    data_dir: Path,
    token: str | None,
    grace_s: float = 5.0,
) -> int:
    """Serve until SIGTERM/SIGINT, then checkpoint into ``data_dir``; returns the exit code."""
    data_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shard = StoreShard.open(config, data_dir)
    restored = sum(len(t) for t in shard.tables.values())
    server, bound = make_server(shard, host=host, port=port, token=token)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(
        f"streamrec store: serving {len(config.tables)} table(s) on {host}:{bound} "
        f"(data dir {data_dir}, {restored} rows restored, "
        f"ready in {time.perf_counter() - started:.2f}s)",
        flush=True,
    )
    stop.wait()
    print("streamrec store: stopping; checkpointing into the data dir", flush=True)
    server.stop(grace_s).wait()
    result = shard.checkpoint(data_dir, "auto")
    print(
        f"streamrec store: wrote {result.kind} checkpoint {result.seq} "
        f"({result.rows} rows, {result.bytes} bytes) to {result.manifest}",
        flush=True,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover - used via the CLI
    sys.exit("run `streamrec store serve --help`")
