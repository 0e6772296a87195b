"""kafka-python clients as streamrec makes them: versions, addresses, options, retries
and the producer, shared by the source (:mod:`connectors.kafka`) and the dead-letter
sink (:mod:`connectors.deadletter`).

>>> parse_api_version("0.9"), bootstrap_hosts("k1:9093,k2")
((0, 9), [('k1', 9093), ('k2', 9092)])
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

ApiVersion = tuple[int, ...]
# What callers may pass for a version: "auto", "0.9", (0, 9) or [0, 9].
ApiVersionSpec = str | Sequence[int]

# Kafka before 0.10 never answers the ApiVersions request kafka-python 3 opens with;
# after this long without an answer from a reachable broker, "auto" assumes 0.9.
DETECT_TIMEOUT_MS = 5000
FALLBACK_API_VERSION: ApiVersion = (0, 9)
# A single metadata or offsets request; longer waits are retries (retry_timeout_s).
REQUEST_TIMEOUT_MS = 10_000
MAX_BACKOFF_S = 5.0
# How often a pause between retries asks whether the job is stopping.
STOP_POLL_S = 0.1
# A broker that stays away is reported this often (each attempt is logged at debug).
WARN_EVERY_S = 30.0
# Set by the source itself; in client_options they would contradict the config.
RESERVED_OPTIONS = frozenset(
    {
        "bootstrap_servers",
        "group_id",
        "api_version",
        "enable_auto_commit",
        "auto_offset_reset",
        "key_deserializer",
        "value_deserializer",
    }
)


class KafkaUnavailable(RuntimeError):
    """Kafka did not answer within ``retry_timeout_s``; the message says what was attempted."""


class Transient(Exception):
    """A condition worth retrying that kafka-python does not report as an error."""


def parse_api_version(value: object) -> Literal["auto"] | ApiVersion:
    """``"auto"`` or a version tuple, from ``"0.9"``, ``[0, 9]``, ``(0, 10, 2)`` or ``"auto"``.

    >>> parse_api_version("0.9"), parse_api_version([0, 10, 2]), parse_api_version("auto")
    ((0, 9), (0, 10, 2), 'auto')
    >>> parse_api_version("nine")
    Traceback (most recent call last):
    ...
    ValueError: api_version must be "auto" or a version like "0.9" or [0, 9], got 'nine'
    """
    if value == "auto":
        return "auto"
    parts: list[object]
    if isinstance(value, str):
        parts = list(value.split("."))
    elif isinstance(value, Sequence):
        parts = list(value)
    else:
        parts = []
    try:
        version = tuple(int(str(p)) for p in parts)
    except ValueError:
        version = ()
    if not 1 <= len(version) <= 4 or any(v < 0 for v in version):
        msg = f'api_version must be "auto" or a version like "0.9" or [0, 9], got {value!r}'
        raise ValueError(msg)
    return version


def bootstrap_hosts(bootstrap_servers: str) -> list[tuple[str, int]]:
    """``"a:1,b"`` → ``[("a", 1), ("b", 9092)]`` (IPv6 as ``[::1]:9092``).

    >>> bootstrap_hosts("127.0.0.1:9093, kafka, [::1]:9094")
    [('127.0.0.1', 9093), ('kafka', 9092), ('::1', 9094)]
    """
    hosts = []
    for item in bootstrap_servers.split(","):
        entry = item.strip()
        if not entry:
            continue
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port = rest.lstrip(":") or "9092"
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        else:
            host, port = entry, "9092"
        hosts.append((host, int(port)))
    return hosts


def reachable(
    bootstrap_servers: str, client_options: Mapping[str, Any], timeout_s: float = 2.0
) -> bool:
    """True when some bootstrap server accepts a TCP connection (or we cannot tell).

    Behind a proxy (``proxy_url``) the brokers are not dialled directly, so this
    says True and leaves the verdict to kafka-python.
    """
    if client_options.get("proxy_url") or client_options.get("socks5_proxy"):
        return True
    for host, port in bootstrap_hosts(bootstrap_servers):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


def is_transient(exc: BaseException) -> bool:
    from kafka.errors import KafkaError

    if isinstance(exc, Transient | OSError | TimeoutError):
        return True
    return isinstance(exc, KafkaError) and bool(exc.retriable)


class Backoff:
    """Pauses between attempts, doubling up to ``MAX_BACKOFF_S``, within ``timeout_s``.

    The time budget runs from ``since``, or else from the first failure; :meth:`reset`
    (after progress) starts it again at the next failure. ``should_stop`` is asked
    while pausing: a job that is stopping (Ctrl-C, ``--max-time``) must not sit out
    the whole budget waiting for a broker.
    """

    def __init__(
        self,
        timeout_s: float,
        since: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._since = since
        self._delay = 0.1
        self.should_stop = should_stop
        self._last_warning = -WARN_EVERY_S

    def reset(self) -> None:
        self._since, self._delay = None, 0.1

    def wait(
        self,
        what: str,
        exc: BaseException,
        give_up: str,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        """Log, run ``on_retry``, sleep; past the budget or on a stop, raise KafkaUnavailable."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        remaining = self._since + self.timeout_s - now
        if remaining <= 0:
            raise KafkaUnavailable(give_up) from exc
        self._stop_check(what, exc)
        pause = min(self._delay, remaining)
        # One warning now and then, not one per attempt: a long outage stays readable.
        quiet = now - self._last_warning < WARN_EVERY_S
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "%s failed (%s); retrying for up to %.0fs more",
            what,
            exc,
            remaining,
        )
        if not quiet:
            self._last_warning = now
        if on_retry is not None:
            on_retry()
        until = time.monotonic() + pause
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, STOP_POLL_S))
            self._stop_check(what, exc)
        self._delay = min(self._delay * 2, MAX_BACKOFF_S)

    def _stop_check(self, what: str, exc: BaseException) -> None:
        if self.should_stop is not None and self.should_stop():
            waited = 0.0 if self._since is None else time.monotonic() - self._since
            msg = f"{what}: gave up after {waited:.1f}s because the job is stopping ({exc})"
            raise KafkaUnavailable(msg) from exc


def retrying(
    what: str,
    fn: Callable[[], T],
    *,
    timeout_s: float,
    bootstrap: str,
    on_retry: Callable[[], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient Kafka errors with backoff.

    Non-transient errors propagate at once; transient ones past ``timeout_s``, or
    while ``should_stop()`` says so, become :class:`KafkaUnavailable`. ``on_retry``
    runs before each new attempt (e.g. to drop a client whose connections are stale).

    >>> calls = []
    >>> def flaky():
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         raise ConnectionRefusedError("broker restarting")
    ...     return "ok"
    >>> retrying("demo", flaky, timeout_s=5, bootstrap="127.0.0.1:9092"), len(calls)
    ('ok', 3)
    """
    backoff = Backoff(timeout_s, since=time.monotonic(), should_stop=should_stop)
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            give_up = (
                f"{what}: Kafka at {bootstrap} still failing after {timeout_s:g}s "
                f"({exc}); check that the broker runs and is reachable from here "
                f"(retry_timeout_s bounds this wait)"
            )
            backoff.wait(what, exc, give_up, on_retry)


def resolve_api_version(
    bootstrap_servers: str,
    api_version: ApiVersionSpec,
    *,
    client_options: Mapping[str, Any] | None = None,
    retry_timeout_s: float = 300.0,
    should_stop: Callable[[], bool] | None = None,
) -> ApiVersion:
    """The version to give kafka-python: ``api_version`` itself, or for ``"auto"`` a detection.

    kafka-python 3 detects brokers 0.10+ (ApiVersions); a 0.9 broker accepts the
    connection but never answers, so a reachable broker that stays silent for
    ``DETECT_TIMEOUT_MS`` is taken to be 0.9. An unreachable one is waited for
    (``retry_timeout_s``), not mistaken for an old one.
    """
    spec = parse_api_version(api_version)
    if spec != "auto":
        return spec
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError

    options = {k: v for k, v in (client_options or {}).items() if k not in RESERVED_OPTIONS}
    options["bootstrap_timeout_ms"] = DETECT_TIMEOUT_MS

    def detect() -> ApiVersion:
        if not reachable(bootstrap_servers, options):
            msg = f"no bootstrap server of {bootstrap_servers} accepts connections"
            raise Transient(msg)
        try:
            probe = KafkaConsumer(bootstrap_servers=bootstrap_servers, **options)
        except KafkaTimeoutError:
            if not reachable(bootstrap_servers, options):
                raise  # it went away meanwhile: retry rather than guess
            log.info(
                "Kafka at %s accepts connections but does not answer ApiVersions "
                "(a broker older than 0.10); using api_version=%s",
                bootstrap_servers,
                FALLBACK_API_VERSION,
            )
            return FALLBACK_API_VERSION
        try:
            return tuple(int(v) for v in probe.config["api_version"])
        finally:
            probe.close(autocommit=False)

    return retrying(
        "detecting the Kafka version",
        detect,
        timeout_s=retry_timeout_s,
        bootstrap=bootstrap_servers,
        should_stop=should_stop,
    )


def check_client_options(
    options: Mapping[str, Any],
    allowed: Iterable[str],
    kind: str,
    reserved_options: Iterable[str] = RESERVED_OPTIONS,
    instead: str = "use the fields of the config instead",
) -> None:
    reserved = sorted(set(options) & set(reserved_options))
    if reserved:
        msg = f"client_options may not set {reserved}: {instead}"
        raise ValueError(msg)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        msg = f"client_options has keys kafka-python's {kind} does not know: {unknown}"
        raise ValueError(msg)


def make_producer(
    bootstrap_servers: str,
    api_version: ApiVersion,
    client_options: Mapping[str, Any] | None,
) -> Any:
    from kafka import KafkaProducer

    options: dict[str, Any] = dict(client_options or {})
    check_client_options(
        options,
        KafkaProducer.DEFAULT_CONFIG,
        "KafkaProducer",
        reserved_options=("bootstrap_servers", "api_version"),
        instead="pass them as arguments",
    )
    if api_version < (0, 11):
        # Idempotent producing needs 0.11; say so instead of letting kafka-python warn.
        options.setdefault("enable_idempotence", False)
        options.setdefault("acks", "all")
        # Without idempotence a retried request may land after a later one: one
        # request in flight keeps each partition's records in the order produced.
        options.setdefault("max_in_flight_requests_per_connection", 1)
    return KafkaProducer(bootstrap_servers=bootstrap_servers, api_version=api_version, **options)
