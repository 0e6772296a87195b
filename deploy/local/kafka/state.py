"""``streamrec kafka up|down``: the servers started detached and recorded in a state dir
(``<state_dir>/kafka.json``), so that they outlive this process and are found again."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from deploy.local.kafka.broker import _BROKER_MAIN, _ZK_MAIN, LocalKafka
from deploy.local.kafka.dirs import LOCK_FILE, STATE_FILE
from deploy.local.kafka.errors import KafkaSetupError, KafkaStartError
from deploy.local.kafka.process import JavaProcess

# The broker port of a new `streamrec kafka up` (the one examples/kafka.yaml names).
DEFAULT_BROKER_PORT = 9092


def recorded_state(state_dir: Path) -> dict[str, Any] | None:
    """What :func:`up` recorded in ``<state_dir>/kafka.json`` (``bootstrap``, ``zookeeper``,
    pids, ...), or None when nothing was; :class:`KafkaSetupError` if it is unreadable."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        msg = f"{path} is not a Kafka state file ({exc}); delete it if no Kafka runs from there"
        raise KafkaSetupError(msg) from exc
    if not isinstance(data, dict):
        msg = f"{path} is not a Kafka state file; delete it if no Kafka runs from there"
        raise KafkaSetupError(msg)
    return data


def _recorded(state: Mapping[str, Any], key: str, main_class: str) -> JavaProcess | None:
    pid = state.get(key)
    if not isinstance(pid, int):
        return None
    return JavaProcess(pid, main_class, Path(os.devnull))


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """Hold ``<state_dir>/kafka.lock``: one ``up`` or ``down`` of a state dir at a time."""
    import fcntl

    with (state_dir / LOCK_FILE).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _port(address: object) -> int | None:
    if isinstance(address, str) and address.rpartition(":")[2].isdigit():
        return int(address.rpartition(":")[2])
    return None


def up(
    state_dir: Path,
    *,
    cache_dir: Path | None = None,
    heap: str = "256m",
    timeout_s: float = 90.0,
    port: int | None = None,
) -> dict[str, Any]:
    """Start ZooKeeper and a broker detached, with data in ``<state_dir>/kafka``.

    A new broker listens on ``port`` (None or 0: a free port). A Kafka recorded in
    ``state_dir`` keeps its recorded port; asking for another non-zero one is a
    :class:`KafkaStartError` (its clients look for it where it was).

    Records pids and addresses in ``<state_dir>/kafka.json`` and returns that record,
    with ``"action"``: ``"started"`` (a new Kafka), ``"running"`` (both servers
    already run: nothing to do) or ``"restarted"`` (a server that had died, or
    was stopped by :func:`down`, started again on the address it had, with its
    data, so clients that were using it carry on). The servers keep running after
    this process exits, until :func:`down`.

    A recorded port that another process holds now is not exchanged for a new
    one (clients would not find Kafka there): :class:`KafkaStartError` names the
    port and the process. Concurrent calls for one ``state_dir`` take turns.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    with state_lock(state_dir):
        return _up(state_dir, cache_dir=cache_dir, heap=heap, timeout_s=timeout_s, port=port)


def _up(
    state_dir: Path, *, cache_dir: Path | None, heap: str, timeout_s: float, port: int | None
) -> dict[str, Any]:
    from embedding_store.persistence import write_file_atomic  # numpy, pyarrow: only here

    old = recorded_state(state_dir)
    zk_port = _port(old.get("zookeeper")) if old else None
    broker_port = _port(old.get("bootstrap")) if old else None
    if old is not None and zk_port is not None and broker_port is not None:
        if port and port != broker_port:
            msg = (
                f"the Kafka of {state_dir} is on port {broker_port}, where its clients look "
                f"for it, not {port}: leave out --port, or run `streamrec kafka down` and "
                f"delete {state_dir / STATE_FILE} to move it (its data is kept)"
            )
            raise KafkaStartError(msg)
        zk = _recorded(old, "zookeeper_pid", _ZK_MAIN)
        broker = _recorded(old, "broker_pid", _BROKER_MAIN)
        if zk is not None and broker is not None and zk.alive() and broker.alive():
            return {**old, "action": "running"}
        work_dir = Path(str(old.get("work_dir") or state_dir / "kafka"))
        kafka = LocalKafka.resume(
            work_dir,
            zk_port=zk_port,
            broker_port=broker_port,
            zookeeper_process=zk if zk is not None and zk.alive() else None,
            broker_process=broker if broker is not None and broker.alive() else None,
            cache_dir=cache_dir,
            heap=heap,
            timeout_s=timeout_s,
        )
        new = kafka.state()
        restarted = [
            name
            for name, key in (("ZooKeeper", "zookeeper_pid"), ("broker", "broker_pid"))
            if new[key] != old.get(key)
        ]
        state = {**new, "action": "restarted", "restarted": restarted}
    else:
        kafka = LocalKafka.start(
            state_dir / "kafka",
            cache_dir=cache_dir,
            heap=heap,
            timeout_s=timeout_s,
            broker_port=port or 0,
        )
        state = {**kafka.state(), "action": "started"}
    body = (json.dumps(state, indent=2) + "\n").encode()
    # Never a half-written state file.
    write_file_atomic(state_dir / STATE_FILE, lambda f: f.write(body))
    return state


def down(state_dir: Path, *, timeout_s: float = 30.0) -> bool:
    """Stop the Kafka that :func:`up` started from ``state_dir``; False if none runs.

    Only pids that still run the expected Java main class are signalled, so a
    stale state file never kills an unrelated process. The data stays in
    ``<state_dir>/kafka`` and the state file keeps the addresses (without pids),
    so the next :func:`up` brings Kafka back where its clients look for it.
    """
    from embedding_store.persistence import write_file_atomic

    if recorded_state(state_dir) is None:  # (no lock file made where nothing was)
        return False
    with state_lock(state_dir):
        state = recorded_state(state_dir)
        if state is None:
            return False
        broker = _recorded(state, "broker_pid", _BROKER_MAIN)
        zookeeper = _recorded(state, "zookeeper_pid", _ZK_MAIN)
        running = [p for p in (broker, zookeeper) if p is not None and p.alive()]
        # Broker first: stopping ZooKeeper under a live broker makes it hang on shutdown.
        for proc in running:
            proc.stop(timeout_s)
        stopped = {**state, "broker_pid": None, "zookeeper_pid": None, "action": "stopped"}
        body = (json.dumps(stopped, indent=2) + "\n").encode()
        write_file_atomic(state_dir / STATE_FILE, lambda f: f.write(body))
    return bool(running)
