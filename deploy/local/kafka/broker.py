""":class:`LocalKafka`: ZooKeeper and one Kafka 0.9.0.1 broker on 127.0.0.1, started,
restarted on their ports and stopped."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from deploy.local.kafka.dirs import STATE_FILE
from deploy.local.kafka.distribution import (
    API_VERSION,
    find_java,
    java_command,
    kafka_home,
    render_properties,
)
from deploy.local.kafka.errors import KafkaStartError
from deploy.local.kafka.process import JavaProcess, free_port, port_free, port_holder
from deploy.local.kafka.topics import create_topic, topic_command, wait_for_partitions

log = logging.getLogger(__name__)

# A short session lets a broker that was killed with -9 register again quickly: its
# old ephemeral node in ZooKeeper (/brokers/ids/0) only goes away when the old
# session expires, and a 0.9 broker started before that exits at once. Not shorter:
# a loaded test machine with few cores pauses processes for seconds, and a session
# must outlast those pauses.
ZK_SESSION_TIMEOUT_MS = 6000

_STARTED = re.compile(r"\[Kafka Server \d+\], started \(kafka\.server\.KafkaServer\)")
_ADDRESS_IN_USE = "Address already in use"
# A 0.9 broker that finds its id still registered (the old session of a killed broker
# has not expired yet) exits at once instead of waiting.
_ALREADY_REGISTERED = "A broker is already registered on the path"
_BROKER_NODE = "/brokers/ids/0"  # the broker's registration, an ephemeral ZooKeeper node
_ZK_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_BROKER_MAIN = "kafka.Kafka"

_LOG4J = """\
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.org.apache.zookeeper=WARN
log4j.logger.org.I0Itec.zkclient=WARN
"""


def _zk_ok(port: int) -> bool:
    """ZooKeeper's four-letter health check: ``ruok`` answered by ``imok``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"ruok")
            return s.recv(16) == b"imok"
    except OSError:
        return False


def _zk_broker_registered(port: int) -> bool | None:
    """Whether ZooKeeper holds broker 0's registration (``/brokers/ids/0``); None: no answer.

    Asked with the ``dump`` four-letter word, which lists every session's
    ephemeral nodes: a killed broker's node stays until its session expires.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.sendall(b"dump")
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    text = data.decode(errors="replace")
    if "ephemeral nodes dump" not in text:
        return None
    return any(line.strip() == _BROKER_NODE for line in text.splitlines())


def _port_taken(what: str, port: int, work_dir: Path) -> str:
    return (
        f"{what} cannot listen on 127.0.0.1:{port}, where it ran before and where clients "
        f"look for it: the port is taken by {port_holder(port)}. Stop that process and run "
        f"`streamrec kafka up` again; or, to move Kafka to new ports (its clients must then "
        f"be given the new address), delete {STATE_FILE} in the state dir and run it again: "
        f"the data in {work_dir} is kept"
    )


@dataclass
class LocalKafka:
    """ZooKeeper plus one Kafka 0.9.0.1 broker on 127.0.0.1, with data in ``work_dir``."""

    home: Path
    java: str
    work_dir: Path
    zk_port: int
    broker_port: int
    heap: str = "256m"
    fixed_heap: bool = False  # the broker's whole heap from the start (see :meth:`start`)
    zookeeper_process: JavaProcess | None = None
    broker_process: JavaProcess | None = None
    owns_work_dir: bool = False  # a temporary folder we made, removed by stop()
    # When the broker was last killed: its ZooKeeper session lives on until then + timeout.
    _killed_at: float | None = field(default=None, repr=False)

    # -- life cycle ---------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        work_dir: Path | None = None,
        *,
        cache_dir: Path | None = None,
        heap: str = "256m",
        timeout_s: float = 90.0,
        broker_port: int = 0,
        fixed_heap: bool = False,
    ) -> LocalKafka:
        """Fetch Kafka if needed, write configs with free ports, start ZooKeeper and the broker.

        ``work_dir`` holds the configs, logs and data; without it a temporary folder
        is made and removed again by :meth:`stop`. The broker listens on
        ``broker_port`` (0: a free port); a port another process holds is a
        :class:`KafkaStartError` naming that process, before anything starts.
        ``fixed_heap``: the broker's JVM holds its whole ``heap`` from the start
        (``-Xms`` = ``-Xmx``, pre-touched), as production brokers run, so its RSS
        stays flat for a long run that watches its memory; otherwise it starts at
        32 MB and grows as it needs (what a test's short-lived broker wants).
        """
        java = find_java()  # first: the clearer error when both java and npm are missing
        home = kafka_home(cache_dir)
        if broker_port and not port_free(broker_port):
            msg = (
                f"the Kafka broker cannot listen on 127.0.0.1:{broker_port}: the port is taken "
                f"by {port_holder(broker_port)}; stop that process, or choose another port "
                f"(`streamrec kafka up --port N`, 0: any free port)"
            )
            raise KafkaStartError(msg)
        owns = work_dir is None
        wd = Path(tempfile.mkdtemp(prefix="streamrec-kafka-")) if work_dir is None else work_dir
        wd.mkdir(parents=True, exist_ok=True)
        kafka = cls(
            home, java, wd.resolve(), 0, broker_port, heap=heap, fixed_heap=fixed_heap,
            owns_work_dir=owns,
        )  # fmt: skip
        try:
            kafka._start_zookeeper(timeout_s)
            kafka._start_broker(timeout_s, new_port=not broker_port)
        except BaseException:
            kafka.stop()
            raise
        return kafka

    @classmethod
    def resume(
        cls,
        work_dir: Path,
        *,
        zk_port: int,
        broker_port: int,
        zookeeper_process: JavaProcess | None = None,
        broker_process: JavaProcess | None = None,
        cache_dir: Path | None = None,
        heap: str = "256m",
        timeout_s: float = 90.0,
    ) -> LocalKafka:
        """The servers of ``work_dir`` on their ports: the ones given running are kept,
        the others started again (with the data they left), so clients find Kafka
        where they looked for it.

        A broker killed moments ago still holds its ZooKeeper registration until
        its session expires (``ZK_SESSION_TIMEOUT_MS``); the new one waits it out.
        A running broker whose ZooKeeper is started again reconnects to it with its
        session (ZooKeeper restores sessions from its data); one that has not
        registered again after twice the session timeout is restarted too.
        Raises :class:`KafkaStartError` (naming the process, when another one holds
        a port) and then stops what it started.
        """
        java = find_java()
        home = kafka_home(cache_dir)
        kafka = cls(
            home,
            java,
            work_dir.resolve(),
            zk_port,
            broker_port,
            heap=heap,
            zookeeper_process=zookeeper_process,
            broker_process=broker_process,
        )
        # Both ports first: no server is started in vain when the other port is taken.
        zk_down = zookeeper_process is None or not zookeeper_process.alive()
        if zk_down and not port_free(zk_port):
            raise KafkaStartError(_port_taken("ZooKeeper", zk_port, kafka.work_dir))
        if (broker_process is None or not broker_process.alive()) and not port_free(broker_port):
            raise KafkaStartError(_port_taken("the Kafka broker", broker_port, kafka.work_dir))
        started: list[JavaProcess] = []
        try:
            if zk_down:
                kafka._start_zookeeper(timeout_s, new_port=False)
                if kafka.zookeeper_process is not None:
                    started.append(kafka.zookeeper_process)
                if (
                    broker_process is not None
                    and broker_process.alive()
                    and not kafka.await_registration(2 * ZK_SESSION_TIMEOUT_MS / 1000)
                ):
                    log.warning("the broker did not reconnect to ZooKeeper; restarting it")
                    broker_process.stop()
            if broker_process is None or not broker_process.alive():
                kafka._start_broker(timeout_s, new_port=False)
        except BaseException:
            for proc in started:
                proc.stop()
            raise
        return kafka

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:<port>``, for ``bootstrap_servers``."""
        return f"127.0.0.1:{self.broker_port}"

    @property
    def zookeeper(self) -> str:
        """``127.0.0.1:<port>``, for ``kafka-topics.sh --zookeeper``."""
        return f"127.0.0.1:{self.zk_port}"

    def _write(self, name: str, text: str) -> Path:
        path = self.work_dir / name
        path.write_text(text)
        return path

    def _start_zookeeper(self, timeout_s: float, *, new_port: bool = True) -> None:
        if not new_port and not port_free(self.zk_port):
            raise KafkaStartError(_port_taken("ZooKeeper", self.zk_port, self.work_dir))
        log4j = self._write("log4j.properties", _LOG4J)
        for attempt in range(3):  # a free port may be taken before ZooKeeper binds it
            if new_port:
                self.zk_port = free_port()
            config = self._write(
                "zookeeper.properties",
                render_properties(
                    {
                        "dataDir": self.work_dir / "zookeeper",
                        "clientPort": self.zk_port,
                        "clientPortAddress": "127.0.0.1",
                        # minSessionTimeout is 2 ticks: 1 s ticks allow the broker's 6 s.
                        "tickTime": 1000,
                        "maxClientCnxns": 0,
                    }
                ),
            )
            argv = java_command(
                self.java,
                self.home,
                _ZK_MAIN,
                [str(config)],
                jvm=["-Xmx64m", "-XX:+UseSerialGC", f"-Dlog4j.configuration=file:{log4j}"],
            )
            zk = JavaProcess.spawn(argv, self.work_dir / "zookeeper.log", _ZK_MAIN)
            self.zookeeper_process = zk
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if _zk_ok(self.zk_port):
                    return
                if not zk.alive():
                    break
                time.sleep(0.1)
            tail = zk.log_tail()
            exited = not zk.alive()
            zk.kill()
            if _ADDRESS_IN_USE in tail and attempt < 2 and new_port:
                continue
            if _ADDRESS_IN_USE in tail:
                msg = _port_taken("ZooKeeper", self.zk_port, self.work_dir)
                raise KafkaStartError(msg)
            what = "exited" if exited else f"did not start within {timeout_s}s"
            msg = f"ZooKeeper {what} (log {zk.log_path}); its log ends:\n{tail}"
            raise KafkaStartError(msg)

    def _broker_config(self) -> Path:
        props: dict[str, object] = {
            "broker.id": 0,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.broker_port}",
            "host.name": "127.0.0.1",
            "port": self.broker_port,
            "advertised.host.name": "127.0.0.1",
            "advertised.port": self.broker_port,
            "log.dirs": self.work_dir / "kafka-logs",
            "zookeeper.connect": self.zookeeper,
            "zookeeper.session.timeout.ms": ZK_SESSION_TIMEOUT_MS,
            "zookeeper.connection.timeout.ms": 30000,
            "num.partitions": 1,
            "default.replication.factor": 1,
            # The group-offsets topic is created on the first commit; 50 partitions
            # (the default) take seconds to create, 1 is plenty here.
            "offsets.topic.num.partitions": 1,
            "offsets.topic.replication.factor": 1,
            # With one broker there is nobody to hand leadership to: controlled shutdown
            # would only retry (3 x 5 s) before stopping anyway.
            "controlled.shutdown.enable": "false",
            "delete.topic.enable": "true",
            "auto.create.topics.enable": "true",
            # Compaction works, with a small dedupe buffer (default 128 MB of a 256 MB heap).
            "log.cleaner.enable": "true",
            "log.cleaner.dedupe.buffer.size": 8 * 1024 * 1024,
            "log.cleaner.threads": 1,
            # Look for compactable segments every second, not every 15 s (tests wait on it).
            "log.cleaner.backoff.ms": 1000,
            "num.network.threads": 2,
            "num.io.threads": 2,
            "num.recovery.threads.per.data.dir": 1,
            "background.threads": 2,
        }
        return self._write("server.properties", render_properties(props))

    def _start_broker(self, timeout_s: float, *, new_port: bool) -> None:
        log4j = self.work_dir / "log4j.properties"
        log_path = self.work_dir / "broker.log"
        deadline = time.monotonic() + timeout_s
        if not new_port and not port_free(self.broker_port):
            raise KafkaStartError(_port_taken("the Kafka broker", self.broker_port, self.work_dir))
        self._await_old_session(deadline)
        attempt = 0
        while True:
            attempt += 1
            if new_port:
                self.broker_port = free_port()
            config = self._broker_config()
            offset = log_path.stat().st_size if log_path.exists() else 0
            argv = java_command(
                self.java,
                self.home,
                _BROKER_MAIN,
                [str(config)],
                jvm=[
                    f"-Xmx{self.heap}",
                    *(
                        [f"-Xms{self.heap}", "-XX:+AlwaysPreTouch"]
                        if self.fixed_heap
                        else ["-Xms32m"]
                    ),
                    "-server",
                    "-XX:+UseG1GC",
                    f"-Dlog4j.configuration=file:{log4j}",
                    f"-Dkafka.logs.dir={self.work_dir}",
                ],
            )
            broker = JavaProcess.spawn(argv, log_path, _BROKER_MAIN)
            self.broker_process = broker
            text = ""
            while time.monotonic() < deadline:
                with log_path.open("rb") as f:
                    f.seek(offset)
                    text = f.read().decode(errors="replace")
                if _STARTED.search(text):
                    return
                if not broker.alive():
                    break
                time.sleep(0.1)
            exited = not broker.alive()
            broker.kill()
            if exited and _ADDRESS_IN_USE in text and not new_port:
                msg = _port_taken("the Kafka broker", self.broker_port, self.work_dir)
                raise KafkaStartError(msg)
            if exited and time.monotonic() < deadline:
                if _ADDRESS_IN_USE in text and new_port and attempt < 3:
                    continue
                if _ALREADY_REGISTERED in text:
                    time.sleep(1.0)  # an old session still holds the id: it expires soon
                    continue
            what = "exited" if exited else f"did not start within {timeout_s}s"
            msg = f"Kafka broker {what} (log {log_path}); its log ends:\n{text[-4000:]}"
            raise KafkaStartError(msg)

    def _await_old_session(self, deadline: float) -> None:
        """Wait until no dead broker's registration is left in ZooKeeper (or ``deadline``).

        A broker killed with -9 keeps ``/brokers/ids/0`` until its ZooKeeper session
        expires (``ZK_SESSION_TIMEOUT_MS`` after the kill, or after ZooKeeper's own
        restart, which restores the session); a new broker launched before that
        only exits (see ``_ALREADY_REGISTERED``) and costs a JVM start.
        """
        while time.monotonic() < deadline:
            registered = _zk_broker_registered(self.zk_port)
            if registered is None and self._killed_at is not None:
                # ZooKeeper does not say: wait the session timeout out from the kill.
                expiry = self._killed_at + ZK_SESSION_TIMEOUT_MS / 1000 + 0.5
                time.sleep(max(0.0, min(expiry, deadline) - time.monotonic()))
                break
            if not registered:
                break
            time.sleep(0.1)
        self._killed_at = None

    def await_registration(self, timeout_s: float) -> bool:
        """Wait until ZooKeeper holds the broker's registration; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _zk_broker_registered(self.zk_port):
                return True
            time.sleep(0.1)
        return False

    def stop_broker(self, timeout_s: float = 30.0) -> None:
        """Stop the broker cleanly (SIGTERM); ZooKeeper and the data stay."""
        if self.broker_process is not None:
            self.broker_process.stop(timeout_s)

    def kill_broker(self) -> None:
        """``kill -9`` the broker: its ZooKeeper session lingers until it expires (6 s)."""
        if self.broker_process is not None and self.broker_process.alive():
            self.broker_process.kill()
            self._killed_at = time.monotonic()

    def start_broker(self, timeout_s: float = 90.0) -> None:
        """Start the broker again on the same port and data (after a stop or a kill).

        After a kill the new broker registers only once the old ZooKeeper session
        expired, so this takes about ``ZK_SESSION_TIMEOUT_MS`` longer.
        """
        if self.broker_process is not None and self.broker_process.alive():
            msg = f"the broker (pid {self.broker_process.pid}) is still running"
            raise KafkaStartError(msg)
        self._start_broker(timeout_s, new_port=False)

    def restart_broker(self, *, kill: bool = False, timeout_s: float = 90.0) -> None:
        """Stop (or with ``kill=True``, kill -9) the broker and start it again on the same port."""
        if kill:
            self.kill_broker()
        else:
            self.stop_broker()
        self.start_broker(timeout_s)

    def stop(self) -> None:
        """Stop the broker, then ZooKeeper; remove the work dir if it is a temporary one."""
        if self.broker_process is not None:
            self.broker_process.stop()
        if self.zookeeper_process is not None:
            self.zookeeper_process.stop()
        if self.owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> LocalKafka:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- topics -------------------------------------------------------------------------

    def topic_command(self, *args: str, timeout_s: float = 60.0) -> str:
        """Run ``kafka-topics.sh --zookeeper <zk> <args>`` (see :func:`topic_command`)."""
        return topic_command(
            self.zookeeper, *args, home=self.home, java=self.java, timeout_s=timeout_s
        )

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        *,
        config: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """Create a topic and wait until every partition has a leader (ready to produce)."""
        create_topic(
            self.zookeeper,
            self.bootstrap,
            name,
            partitions,
            config=config,
            home=self.home,
            java=self.java,
            timeout_s=timeout_s,
        )

    def add_partitions(self, name: str, partitions: int, *, timeout_s: float = 60.0) -> None:
        """Grow a topic to ``partitions`` partitions (``kafka-topics.sh --alter``)."""
        self.topic_command("--alter", "--topic", name, "--partitions", str(partitions))
        wait_for_partitions(self.bootstrap, name, partitions, timeout_s=timeout_s)

    # -- detached (CLI) -----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``down`` needs to find and stop the servers again (JSON-able)."""
        return {
            "bootstrap": self.bootstrap,
            "zookeeper": self.zookeeper,
            "api_version": list(API_VERSION),
            "broker_pid": self.broker_process.pid if self.broker_process else None,
            "zookeeper_pid": self.zookeeper_process.pid if self.zookeeper_process else None,
            "work_dir": str(self.work_dir),
            "home": str(self.home),
        }
