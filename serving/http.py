"""The HTTP shell of ``streamrec serve``: tornado handlers around the pure ``oip`` functions.

Endpoints (the Open Inference Protocol, KServe v2): ``GET /v2/health/live``,
``GET /v2/health/ready``, ``GET /v2``, ``GET /v2/models/{name}[/versions/{v}]``,
``.../ready``, ``POST .../infer``, and ``GET /metrics`` (Prometheus text, from a
registry of the server's own). With a token, every endpoint but the probes'
and the scraper's (``/v2/health/live``, ``/v2/health/ready``, ``/metrics``)
needs ``Authorization: Bearer <token>``.

A plain infer request is answered on the socket (:mod:`serving.wire`),
everything else by tornado ``RequestHandler``s; both answer an infer request
with the same function, so the two paths cannot drift apart.

Input never causes a 500: the protocol layer turns whatever is wrong with a
request into a 400 naming the field and the value; an exception inside the
model is a 500, logged with its traceback, and the server keeps serving.

One request cannot take the server down: a request of more records than
``max_request_records`` is refused from its shape (413) before any is decoded;
what waits to be scored is bounded (``max_queued_records``: 503 with
``Retry-After``); a request still unanswered ``request_timeout_s`` after its
headers (or after its own Triton ``timeout`` parameter) gets 504, checked
while it waits and between the model's stages; the connections are capped
(``max_connections``: 503) and a connection idle for ``idle_timeout_s``, or
one whose request is not all there ``read_timeout_s`` after it began, is
closed (408 for the latter). A stage's compiled kernel cannot be interrupted
once called: a request is late by at most that stage, which is bounded by the
request's size.

>>> import urllib.request, numpy as np
>>> from serving.types import Prediction
>>> class Constant:
...     name, heads = "const", ("click",)
...     def ready(self): return True
...     def metadata(self): return {}
...     def predict(self, records):
...         return Prediction({"click": np.full(len(records), 0.5, np.float32)})
>>> with InferenceServer(Constant()) as server:
...     body = (b'{"inputs": [{"name": "records", "datatype": "BYTES", "shape": [1],'
...             b' "data": ["{}"]}]}')
...     reply = urllib.request.urlopen(server.url + "/v2/models/const/infer", body)
...     reply.read()
b'{"model_name":"const","id":"","parameters":{},"outputs":[{"name":"click","datatype":"FP32","shape":[1],"data":[0.5]}]}'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import importlib.metadata
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Final, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST
from tornado.http1connection import HTTP1Connection
from tornado.httpserver import HTTPServer
from tornado.httputil import (
    HTTPHeaders,
)
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler, stream_request_body

from serving import oip
from serving.batching import LoopBatcher, takes_deadline
from serving.metrics import ServeMetrics
from serving.types import (
    BadRecords,
    Deadline,
    InferRequest,
    ModelUnavailable,
    OipError,
    Overloaded,
    Prediction,
    Predictor,
)
from serving.wire import Reply, WireServer

__all__ = ["InferenceServer", "make_app"]

log = logging.getLogger("streamrec.serve")

# A refused request's body up to this size is read and dropped, so that a client that
# sends its whole body before reading still sees the answer; a larger one is cut off.
DRAIN_LIMIT: Final = 64 << 20
_JSON: Final = "application/json"


def _version() -> str:
    try:
        return importlib.metadata.version("streamrec")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Limits(NamedTuple):
    """What one request and the connections may take (see the module's docstring)."""

    max_request_bytes: int = 16 << 20
    max_request_records: int | None = 65536
    max_queued_records: int | None = None  # None: 16 joined calls' worth
    request_timeout_s: float | None = 10.0
    max_connections: int | None = 1024
    idle_timeout_s: float | None = 120.0
    read_timeout_s: float | None = 30.0

    def check(self) -> Limits:
        """These limits, or a ``ValueError`` naming the one that is not positive.

        >>> Limits(request_timeout_s=0).check()
        Traceback (most recent call last):
        ...
        ValueError: request_timeout_s: expected a positive number or None, got 0
        """
        for name, value in self._asdict().items():
            if value is not None and value <= 0:
                msg = f"{name}: expected a positive number or None, got {value}"
                raise ValueError(msg)
        return self


_DEFAULTS: Final = Limits()


class _Shared:
    """What every handler of one server reads."""

    __slots__ = (
        "batcher", "deadlines", "limits", "max_request_bytes", "metrics", "predictor",
        "readiness", "token", "version",
    )  # fmt: skip

    def __init__(
        self,
        predictor: Predictor,
        token: str | None,
        limits: Limits,
        metrics: ServeMetrics,
        batcher: LoopBatcher | None = None,
        readiness: Callable[[], bool] | None = None,
    ) -> None:
        self.predictor = predictor
        self.readiness = readiness
        self.batcher = batcher
        self.token = None if token is None else token.encode()
        self.limits = limits
        self.max_request_bytes = limits.max_request_bytes
        self.metrics = metrics
        self.version = _version()
        self.deadlines = takes_deadline(predictor)

    def probe_ready(self) -> bool:
        """What the readiness endpoints answer: the model ready, and ``readiness`` (what
        the model reads from answers) where given. Infer requests are gated on the
        model alone: one that reaches a part that stopped answering gets its own 503."""
        return self.predictor.ready() and (self.readiness is None or self.readiness())


def _bearer_ok(token: bytes | None, headers: HTTPHeaders) -> bool:
    """Whether ``headers`` carry ``Authorization: Bearer <token>`` (always, with no token)."""
    if token is None:
        return True
    scheme, _, credentials = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode("latin-1"), token
    )


class _Handler(RequestHandler):
    endpoint: ClassVar[str] = "unknown"
    public: ClassVar[bool] = False  # answered without the token

    def initialize(self, shared: _Shared) -> None:
        self.shared = shared

    def compute_etag(self) -> str | None:
        return None  # no hashing of every body

    def _authorized(self) -> bool:
        return self.public or _bearer_ok(self.shared.token, self.request.headers)

    def _unauthorized_message(self) -> str:
        self.set_header("WWW-Authenticate", 'Bearer realm="streamrec"')
        return 'missing or wrong bearer token: send the header "Authorization: Bearer <token>"'

    def prepare(self) -> None:
        if not self._authorized():
            self._fail(401, self._unauthorized_message(), "unauthorized")

    def _send(self, status: int, body: bytes, content_type: str = _JSON) -> None:
        self.set_status(status)
        self.set_header("Content-Type", content_type)
        self.finish(body)

    def _fail(self, status: int, message: str, reason: str) -> None:
        self.shared.metrics.errors.labels(reason).inc()
        self._send(status, oip.error_body(message))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # What tornado itself refuses (405, an invalid URL) or an exception that escaped.
        if status_code >= 500:
            message = f"internal error answering {self.request.method} {self.request.path}; "
            message += "see the server log"
        else:
            message = f"{self._reason}: {self.request.method} {self.request.path}"
        self.shared.metrics.errors.labels(
            "internal" if status_code >= 500 else f"http_{status_code}"
        ).inc()
        self.set_header("Content-Type", _JSON)
        self.finish(oip.error_body(message))

    def on_finish(self) -> None:
        self.shared.metrics.count_request(self.endpoint, self.get_status())

    def _json(self, status: int, doc: object) -> None:
        self._send(status, oip.dumps(doc))


class _NotFound(_Handler):
    endpoint = "unknown"

    def prepare(self) -> None:
        super().prepare()
        if not self._finished:
            message = (
                f"no endpoint {self.request.method} {self.request.path}; this server answers "
                "GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}, "
                "/v2/models/{name}/ready, /metrics and POST /v2/models/{name}/infer"
            )
            self._fail(404, message, "not_found")


class _Live(_Handler):
    endpoint = "health_live"
    public = True

    def get(self) -> None:
        self._send(200, b'{"live":true}')


class _Ready(_Handler):
    public = True  # a probe (the kubelet's) sends no token
    endpoint = "health_ready"

    def get(self) -> None:
        ready = self.shared.probe_ready()
        self._send(200 if ready else 503, b'{"ready":true}' if ready else b'{"ready":false}')


class _ServerMetadata(_Handler):
    endpoint = "server_metadata"

    def get(self) -> None:
        self._json(200, oip.server_metadata(self.shared.version))


class _Metrics(_Handler):
    public = True  # a scraper sends no token; the figures hold no records
    endpoint = "metrics"

    def get(self) -> None:
        self._send(200, self.shared.metrics.exposition(), CONTENT_TYPE_LATEST)


class _ModelHandler(_Handler):
    def _model_error(self, name: str | None, version: str | None) -> str | None:
        """Why the URL's model (and version) is not this server's; ``None`` when it is."""
        predictor = self.shared.predictor
        if name != predictor.name:
            return f'unknown model "{name}"; this server serves "{predictor.name}"'
        if version is None:
            return None
        known = predictor.metadata().get("version")
        if known is not None and str(known) == version:
            return None
        have = (
            "no numbered version (leave /versions/... out)"
            if known is None
            else (f'version "{known}"')
        )
        return f'model "{name}" has no version "{version}"; it serves {have}'


class _ModelMetadata(_ModelHandler):
    endpoint = "model_metadata"

    def get(self, name: str, version: str | None) -> None:
        error = self._model_error(name, version)
        if error is not None:
            self._fail(404, error, "unknown_model")
            return
        predictor = self.shared.predictor
        self._json(200, oip.model_metadata(predictor.name, predictor.heads, predictor.metadata()))


class _ModelReady(_ModelHandler):
    endpoint = "model_ready"

    def get(self, name: str, version: str | None) -> None:
        error = self._model_error(name, version)
        if error is not None:
            self._fail(404, error, "unknown_model")
            return
        ready = self.shared.probe_ready()
        self._json(200 if ready else 503, {"name": name, "ready": ready})


@stream_request_body
class _Infer(_ModelHandler):
    """``POST /v2/models/{name}/infer``: refusals are decided from the headers alone.

    The body streams in through ``data_received`` so that a request over
    ``max_request_bytes`` is answered 413 from its Content-Length before any of
    it is read. The rest is then read and dropped (up to ``DRAIN_LIMIT``; a client
    that sends its whole body before reading sees the answer), or, when the client
    asked ``Expect: 100-continue`` or claims more, the connection is closed.
    """

    endpoint = "infer"
    SUPPORTED_METHODS = ("POST",)  # anything else is a 405 before prepare() looks at it

    def initialize(self, shared: _Shared) -> None:
        super().initialize(shared)
        self._start = time.perf_counter()
        self._chunks: list[bytes] = []
        self._size = 0
        self._refused = False
        self._length: int | None = None
        self._chunked = False

    def prepare(self) -> None:
        headers = self.request.headers
        length_header = headers.get("Content-Length", "")
        self._length = int(length_header) if length_header.isdigit() else None
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        limit = self.shared.max_request_bytes
        if not self._authorized():
            self._refuse(401, self._unauthorized_message(), "unauthorized")
        elif self._length is not None and self._length > limit:
            message = (
                f"request body of {self._length} bytes (Content-Length) is over this server's "
                f"limit of {limit} bytes (max_request_bytes); send fewer records per request"
            )
            self._refuse(413, message, "too_large")
        elif headers.get("Content-Encoding", "identity").lower() != "identity":
            message = (
                f'Content-Encoding "{headers["Content-Encoding"]}" is not supported; '
                f"send the request uncompressed"
            )
            self._refuse(415, message, "invalid_request")
        else:
            args = self.path_args
            error = self._model_error(args[0], args[1] if len(args) > 1 else None)
            if error is not None:
                self._refuse(404, error, "unknown_model")
            elif self._chunked:
                self._set_connection_limit(DRAIN_LIMIT)  # counted in data_received instead

    def _set_connection_limit(self, size: int) -> None:
        connection = self.request.connection
        if isinstance(connection, HTTP1Connection):
            connection.set_max_body_size(size)

    def _refuse(self, status: int, message: str, reason: str, *, reading: bool = False) -> None:
        """Answer now; the body (if any) is dropped as it comes, or the connection closed."""
        self._refused = True
        self._chunks = []
        self.shared.metrics.errors.labels(reason).inc()
        body = oip.error_body(message)
        self.set_status(status)
        self.set_header("Content-Type", _JSON)
        length = self._length or 0
        expects_body = reading or length > 0 or self._chunked
        continue_asked = self.request.headers.get("Expect", "").lower() == "100-continue"
        if not expects_body or (continue_asked and not reading) or length > DRAIN_LIMIT:
            # Tornado closes the connection after the answer when the body was not read;
            # lifting its limit keeps it from appending a bare "400 Bad Request" to ours.
            self._set_connection_limit(max(length, self.shared.max_request_bytes))
            self.finish(body)
            return
        self._set_connection_limit(max(length, DRAIN_LIMIT) if self._chunked else length)
        self.set_header("Content-Length", str(len(body)))
        self.write(body)
        self.flush()  # the answer goes out now; post() finishes once the body is dropped

    def data_received(self, chunk: bytes) -> None:
        if self._refused:
            return
        self._size += len(chunk)
        if self._size > self.shared.max_request_bytes:  # chunked: no Content-Length to check
            message = (
                f"request body over this server's limit of {self.shared.max_request_bytes} "
                f"bytes (max_request_bytes); send fewer records per request"
            )
            self._refuse(413, message, "too_large", reading=True)
            return
        self._chunks.append(chunk)

    async def post(self, name: str, version: str | None) -> None:
        if self._refused:
            if not self._finished:
                self.finish()
            return
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        reply = await _answer_infer(
            self.shared,
            name,
            version,
            body,
            self.request.headers.get(oip.HEADER_LENGTH),
            self._start,
        )
        if reply.header_length is not None:
            self.set_header(oip.HEADER_LENGTH, str(reply.header_length))
        if reply.retry_after_s is not None:
            self.set_header("Retry-After", str(reply.retry_after_s))
        self._send(reply.status, reply.body, reply.content_type)

    def on_finish(self) -> None:
        super().on_finish()
        self.shared.metrics.infer_latency.observe(time.perf_counter() - self._start)


def _failed(
    shared: _Shared, status: int, message: str, reason: str, retry_after_s: int | None = None
) -> Reply:
    shared.metrics.errors.labels(reason).inc()
    return Reply(status, oip.error_body(message), retry_after_s=retry_after_s)


def _not_ready(shared: _Shared, name: str) -> OipError | None:
    if shared.predictor.ready():
        return None
    message = f'model "{name}" is not ready (parameters loading or catching up); retry'
    return OipError(503, message, "not_ready")


def _infer_request(
    shared: _Shared, name: str, body: bytes, header_length: str | None
) -> InferRequest | Reply:
    """An infer request read whole, parsed; or the answer that refuses it (counted)."""
    error = _not_ready(shared, name)
    if error is not None:
        return _failed(shared, error.status, error.message, error.reason, 1)
    try:
        return oip.parse_infer_request(
            body, shared.predictor.heads, header_length, shared.limits.max_request_records
        )
    except OipError as e:
        return _failed(shared, e.status, e.message, e.reason)


def _too_many(shared: _Shared, n: int) -> OipError | None:
    limit = shared.limits.max_request_records
    if limit is None or n <= limit:
        return None
    message = (
        f"records: {n} records, over this server's limit of {limit} per request "
        f"(serving.max_request_records); send them in several requests"
    )
    return OipError(413, message, "too_many_records")


def _deadline(
    shared: _Shared, timeout_s: float | None, start: float | None = None
) -> Deadline | None:
    """A request's deadline: the server's ``request_timeout_s`` or the request's own
    timeout, the shorter, from ``start`` (its headers' ``perf_counter``); None: neither."""
    limit = shared.limits.request_timeout_s
    if timeout_s is not None and (limit is None or timeout_s < limit):
        limit = timeout_s
    return None if limit is None else Deadline.after(limit, start)


def _infer_reply(
    shared: _Shared,
    name: str,
    version: str | None,
    request: InferRequest,
    prediction: Prediction | None,
    error: Exception | None,
) -> Reply:
    """The answer to a scored request: its prediction's, or its error's (counted)."""
    n = len(request.records)
    try:
        if error is not None:
            raise error  # sorted by the clauses below
        assert prediction is not None  # one of the two is given
        response = oip.infer_response(
            shared.predictor.name, shared.predictor.heads, request, prediction, version
        )
    except BadRecords as e:
        metrics = shared.metrics
        metrics.errors.labels("bad_records").inc()
        for bad in e.errors:
            metrics.bad_records.labels(bad.reason).inc()
        _, reply = oip.bad_records_body(e.errors, n)
        return Reply(400, reply)
    except ModelUnavailable as e:
        message = f'model "{name}" cannot answer now: {e}; retry'
        return _failed(shared, 503, message, "unavailable", 1)
    except OipError as e:  # shed (503), or late (504)
        retry = e.retry_after_s if isinstance(e, Overloaded) else None
        return _failed(shared, e.status, e.message, e.reason, retry)
    except Exception as e:
        log.exception('model "%s" failed on a request of %d records', name, n)
        message = f'model "{name}" failed on {n} records ({type(e).__name__}); see the server log'
        return _failed(shared, 500, message, "internal")
    shared.metrics.records.inc(n)
    return Reply(200, response.body, response.content_type, response.header_length)


async def _answer_infer(
    shared: _Shared,
    name: str,
    version: str | None,
    body: bytes,
    header_length: str | None,
    start: float | None = None,
) -> Reply:
    """The answer to an infer request whose body ``_Infer`` read whole; ``start``: when
    its headers came (``perf_counter``), where its deadline counts from."""
    request = _infer_request(shared, name, body, header_length)
    if isinstance(request, Reply):
        return request
    deadline = _deadline(shared, request.timeout_s, start)
    batcher = shared.batcher
    if batcher is None:
        scored = _scored(shared, request.records, deadline)
        return _infer_reply(shared, name, version, request, *scored)
    try:
        # The requests this loop read in one turn share one call.
        prediction = await batcher.submit(
            request.records, deadline=deadline, priority=request.priority
        )
    except Exception as e:
        return _infer_reply(shared, name, version, request, None, e)
    return _infer_reply(shared, name, version, request, prediction, None)


def _scored(
    shared: _Shared, records: Sequence[bytes], deadline: Deadline | None
) -> tuple[Prediction | None, Exception | None]:
    """Records scored alone, now: their prediction, or the error scoring raised."""
    try:
        if deadline is None:
            return shared.predictor.predict(records), None
        deadline.check("waiting to be scored")
        if shared.deadlines:
            return shared.predictor.predict(records, deadline=deadline), None  # type: ignore[call-arg]
        return shared.predictor.predict(records), None
    except Exception as e:
        return None, e


def _answer_plain(
    shared: _Shared,
    name: str,
    body: bytes,
    header_length: str | None,
    start: float,
    done: Callable[[Reply], None],
) -> None:
    """:func:`_answer_infer` for the plain path of :mod:`serving.wire`, without a
    coroutine: ``done`` is told the answer, at once when the model was idle
    (``LoopBatcher.score``), else once this turn's requests were scored."""
    request = _infer_request(shared, name, body, header_length)
    if isinstance(request, Reply):
        done(request)
        return
    deadline = _deadline(shared, request.timeout_s, start)
    batcher = shared.batcher
    if batcher is None:
        done(_infer_reply(shared, name, None, request, *_scored(shared, request.records, deadline)))
        return
    batcher.score(
        request.records,
        lambda prediction, error: done(
            _infer_reply(shared, name, None, request, prediction, error)
        ),
        deadline=deadline,
        priority=request.priority,
    )


def _log_request(handler: RequestHandler) -> None:
    # Tornado's access log costs a formatted line per request; only failures are logged.
    status = handler.get_status()
    if status >= 500:
        request = handler.request
        log.warning("%d %s %s (%.1f ms)", status, request.method, request.path,
                    1000 * request.request_time())  # fmt: skip


_MODEL: Final = r"/v2/models/([^/]+)(?:/versions/([^/]+))?"


def make_app(
    predictor: Predictor,
    *,
    token: str | None = None,
    max_request_bytes: int = 16 << 20,
    metrics: ServeMetrics | None = None,
    batcher: LoopBatcher | None = None,
    limits: Limits | None = None,
) -> Application:
    """The tornado application of the server (serve it with an ``HTTPServer``);
    ``batcher``: joins the requests read in one turn of the loop (None: each alone);
    ``limits``: those of one request (``max_request_bytes`` is taken from its own
    argument). ``InferenceServer`` serves it behind :mod:`serving.wire`, which
    answers plain infer requests itself."""
    limits = (limits or Limits())._replace(max_request_bytes=max_request_bytes)
    shared = _Shared(predictor, token, limits.check(), metrics or ServeMetrics(), batcher)
    return _application(shared)


def _application(shared: _Shared) -> Application:
    args = {"shared": shared}
    routes: Sequence[tuple[str, type[RequestHandler], dict[str, Any]]] = [
        (r"/v2/health/live", _Live, args),
        (r"/v2/health/ready", _Ready, args),
        (r"/v2/?", _ServerMetadata, args),
        (_MODEL, _ModelMetadata, args),
        (_MODEL + r"/ready", _ModelReady, args),
        (_MODEL + r"/infer", _Infer, args),
        (r"/metrics", _Metrics, args),
    ]
    return Application(
        list(routes),
        default_handler_class=_NotFound,
        default_handler_args=args,
        log_function=_log_request,
        compress_response=False,
        serve_traceback=False,
    )


class _Listening(NamedTuple):
    servers: list[asyncio.Server]
    wire: WireServer
    tornado: HTTPServer


class InferenceServer:
    """An Open Inference Protocol server of one model, its IOLoop on a thread of its own.

    ``start()`` binds (``port=0``: a free port) and returns the URL; ``stop()``
    closes the connections and the loop. Also a context manager.
    """

    def __init__(
        self,
        predictor: Predictor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = 16 << 20,
        max_batch_records: int | None = 4096,
        max_request_records: int | None = _DEFAULTS.max_request_records,
        max_queued_records: int | None = None,
        request_timeout_s: float | None = _DEFAULTS.request_timeout_s,
        max_connections: int | None = _DEFAULTS.max_connections,
        idle_timeout_s: float | None = _DEFAULTS.idle_timeout_s,
        read_timeout_s: float | None = _DEFAULTS.read_timeout_s,
        readiness: Callable[[], bool] | None = None,
    ) -> None:
        """``max_batch_records``: requests read together are scored in one call of up
        to this many records (see :mod:`serving.batching`); None: each request alone.
        The other limits are :class:`Limits`' (None: no limit). ``readiness``: also
        asked by ``/v2/health/ready`` and the model's ``/ready`` (e.g. whether the
        replicas the rows come from answer)."""
        if not 0 <= port <= 65535:
            msg = f"port: expected 0 (a free port) to 65535, got {port}"
            raise ValueError(msg)
        if token is not None and not token.strip():
            msg = "token: empty; give None to serve without a token"
            raise ValueError(msg)
        if max_request_bytes < 1:
            msg = f"max_request_bytes: expected a positive byte count, got {max_request_bytes}"
            raise ValueError(msg)
        self.limits = Limits(
            max_request_bytes, max_request_records, max_queued_records, request_timeout_s,
            max_connections, idle_timeout_s, read_timeout_s,
        ).check()  # fmt: skip
        self.predictor = predictor
        self.host = host
        self.metrics = ServeMetrics()
        self.url: str | None = None
        self.port: int | None = None
        self._requested_port = port
        self._token = token
        self._max_request_bytes = max_request_bytes
        if max_batch_records is not None and max_batch_records < 1:
            msg = f"max_batch_records: expected a positive record count, got {max_batch_records}"
            raise ValueError(msg)
        # No thread of its own: one for the server's life, idle while it is stopped.
        self._batcher = (
            None
            if max_batch_records is None
            else LoopBatcher(
                predictor, max_records=max_batch_records, max_queued_records=max_queued_records
            )
        )
        self._shared = _Shared(
            predictor, token, self.limits, self.metrics, self._batcher, readiness
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None

    def probe_ready(self) -> bool:
        """What the readiness probes answer: the model ready, and ``readiness``."""
        return self._shared.probe_ready()

    def start(self) -> str:
        """Bind, start serving on a thread, and return the URL (``http://host:port``)."""
        if self._thread is not None:
            msg = f"InferenceServer: already started at {self.url}"
            raise RuntimeError(msg)
        sockets = bind_sockets(self._requested_port, self.host)
        self.port = int(sockets[0].getsockname()[1])
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(self._loop, sockets, started),
            name=f"streamrec-serve-{self.port}",
            daemon=True,
        )
        self._thread.start()
        started.wait()
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise self._startup_error
        return self.url

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        started: threading.Event,
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(self._open(sockets))
        except BaseException as e:
            self._startup_error = e
            for sock in sockets:
                sock.close()
            loop.close()
            started.set()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._close(server))
            loop.close()

    async def _open(self, sockets: list[socket.socket]) -> _Listening:
        shared = self._shared
        limits = self.limits
        tornado = HTTPServer(
            _application(shared),
            max_body_size=self._max_request_bytes,
            idle_connection_timeout=limits.idle_timeout_s,
            body_timeout=limits.read_timeout_s,
        )
        name = self.predictor.name
        metrics = self.metrics

        def answer(
            body: bytes, header_length: str | None, start: float, done: Callable[[Reply], None]
        ) -> None:
            _answer_plain(shared, name, body, header_length, start, done)

        def answered(status: int, seconds: float) -> None:
            metrics.count_request("infer", status)
            metrics.infer_latency.observe(seconds)
            if status >= 500:
                log.warning("%d POST /v2/models/%s/infer", status, name)

        # A name the URL carries as is (else its requests take tornado's path, which
        # unquotes the URL's segment).
        safe = name and all(c.isalnum() or c in "-_." for c in name)

        def refused(reason: str) -> None:
            metrics.errors.labels(reason).inc()

        wire = WireServer(
            f"/v2/models/{name}/infer" if safe else None,
            self._max_request_bytes, shared.token, answer, answered, tornado,
            max_connections=limits.max_connections, idle_timeout_s=limits.idle_timeout_s,
            read_timeout_s=limits.read_timeout_s, refused=refused,
        )  # fmt: skip
        wire.start_sweeping()
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(wire.protocol, sock=sock) for sock in sockets]
        return _Listening(servers, wire, tornado)

    @staticmethod
    async def _close(listening: _Listening) -> None:
        for server in listening.servers:
            server.close()
        listening.wire.close_all()
        try:
            await asyncio.wait_for(listening.tornado.close_all_connections(), timeout=5)
        except TimeoutError:
            log.warning("connections still open 5 s after stop(); closing the loop anyway")
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def submit(
        self, records: Sequence[bytes], *, timeout_s: float | None = None, priority: int = 0
    ) -> concurrent.futures.Future[Prediction]:
        """Score ``records`` on the server's loop, from any thread, through the limits
        and the batching of an HTTP request (another front end's way in).

        The future raises :class:`~serving.types.OipError` for a refusal (413 too
        many records, 503 not ready or shed, 504 late), ``BadRecords``,
        ``ModelUnavailable``, or the model's own error. ``timeout_s``: the request's
        own, when shorter than ``request_timeout_s``; it counts from this call.
        """
        loop = self._loop
        if loop is None:
            msg = "InferenceServer: not started"
            raise RuntimeError(msg)
        result: concurrent.futures.Future[Prediction] = concurrent.futures.Future()
        start = time.perf_counter()
        shared = self._shared

        def done(prediction: Prediction | None, error: Exception | None) -> None:
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(prediction)  # type: ignore[arg-type]

        def run() -> None:
            if not result.set_running_or_notify_cancel():
                return
            refusal = _not_ready(shared, self.predictor.name) or _too_many(shared, len(records))
            if refusal is not None:
                done(None, refusal)
                return
            deadline = _deadline(shared, timeout_s, start)
            batcher = shared.batcher
            if batcher is None:
                done(*_scored(shared, records, deadline))
            else:
                batcher.score(records, done, deadline=deadline, priority=priority)

        loop.call_soon_threadsafe(run)
        return result

    def stop(self) -> None:
        """Stop serving: close the listening sockets, the connections and the loop."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None
        self._loop = None

    def __enter__(self) -> InferenceServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
