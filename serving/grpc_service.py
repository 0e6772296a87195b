"""The gRPC shell of ``streamrec serve``: the Open Inference Protocol's
``inference.GRPCInferenceService`` in front of an HTTP :class:`~serving.http.InferenceServer`.

Records are never scored here. The model is not thread-safe, and the HTTP server
scores on its own loop with dynamic batching: an infer call hands its records to
``InferenceServer.submit`` (the same limits and batching as an HTTP request, and
the same queue) and waits for the future. The server runs ``grpc.aio`` on a thread
of its own, so a waiting call holds no thread: the requests of many clients join
the HTTP server's batches. The health and metadata calls read the predictor's
``ready()`` and ``metadata()`` from that thread (reads, never scoring).

Refusals, as gRPC statuses: a malformed request is ``INVALID_ARGUMENT`` naming the
field and the value (bad records: each one's index, field and reason), an unknown
model or version ``NOT_FOUND``, a missing or wrong token ``UNAUTHENTICATED``, too
many records or a message over ``max_request_bytes`` ``RESOURCE_EXHAUSTED`` (as is a
call past ``max_concurrent_rpcs``), a model not ready or a full queue
``UNAVAILABLE``, a request past its deadline ``DEADLINE_EXCEEDED`` (Triton's
``timeout`` parameter, in microseconds, or the call's own deadline, whichever is
shorter, else the HTTP server's ``request_timeout_s``), and a failure of the model
``INTERNAL`` (logged with its traceback; the message says to see the server log).
Each call is counted in the HTTP server's metrics under ``grpc_*`` endpoints, with
the HTTP status that answer would have had.

>>> import numpy as np, grpc
>>> from serving.http import InferenceServer
>>> from serving.proto import grpc_predict_v2_pb2 as pb, grpc_predict_v2_pb2_grpc as pb_grpc
>>> from serving.types import Prediction
>>> class Constant:
...     name, heads = "const", ("click",)
...     def ready(self): return True
...     def metadata(self): return {}
...     def predict(self, records):
...         return Prediction({"click": np.full(len(records), 0.5, np.float32)})
>>> with InferenceServer(Constant()) as http, GrpcInferenceServer(http) as server:
...     with grpc.insecure_channel(server.address) as channel:
...         stub = pb_grpc.GRPCInferenceServiceStub(channel)
...         request = pb.ModelInferRequest(model_name="const", inputs=[
...             pb.ModelInferRequest.InferInputTensor(name="records", datatype="BYTES",
...                 shape=[2], contents=pb.InferTensorContents(bytes_contents=[b"{}", b"{}"]))])
...         reply = stub.ModelInfer(request, timeout=10)
>>> reply.outputs[0].name, np.frombuffer(reply.raw_output_contents[0], "<f4").tolist()
('click', [0.5, 0.5])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import importlib.metadata
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Protocol, TypeVar

import grpc
import grpc.aio

from serving import grpc_oip
from serving.metrics import ServeMetrics
from serving.proto import grpc_predict_v2_pb2 as pb
from serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from serving.types import BadRecords, ModelUnavailable, OipError, Prediction, Predictor

__all__ = ["STATUS_CODES", "GrpcInferenceServer", "Inference", "OipServicer"]

log = logging.getLogger("streamrec.serve")

# The status of a refusal the HTTP side answers with an HTTP status.
STATUS_CODES: Final[Mapping[int, grpc.StatusCode]] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
AUTH_HEADER: Final = "authorization"
# Counted under this code: a call its client gave up (cancelled, or past its deadline)
# before the answer (nginx's "client closed request").
CLIENT_GONE: Final = 499


class Inference(Protocol):
    """What the servicer needs of the HTTP server (:class:`serving.http.InferenceServer`)."""

    @property
    def predictor(self) -> Predictor:
        """The model served."""
        ...

    @property
    def metrics(self) -> ServeMetrics:
        """Where calls are counted."""
        ...

    def submit(
        self, records: Sequence[bytes], *, timeout_s: float | None = None, priority: int = 0
    ) -> concurrent.futures.Future[Prediction]:
        """Score ``records`` on the server's loop, through its limits and batching."""
        ...

    def probe_ready(self) -> bool:
        """What the readiness calls answer."""
        ...


class _Refused(Exception):
    """A call answered with an error status: ``http_status`` is what it is counted under."""

    def __init__(self, code: grpc.StatusCode, http_status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.message = message
        self.reason = reason


def _refused(error: OipError) -> _Refused:
    default = grpc.StatusCode.INTERNAL if error.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT
    code = STATUS_CODES.get(error.status, default)
    return _Refused(code, error.status, error.message, error.reason)


def _version() -> str:
    try:
        return importlib.metadata.version("streamrec")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
# The request and response types are the method's; a context's are of no use here.
Context = grpc.aio.ServicerContext[Any, Any]
_Method = Callable[["OipServicer", _Req, Context], Awaitable[_Resp]]


def _answered(
    endpoint: str, *, public: bool = False
) -> Callable[[_Method[_Req, _Resp]], _Method[_Req, _Resp]]:
    """A servicer method that checks the token first (unless ``public``: the probes),
    counts the call under ``endpoint``, and turns a :class:`_Refused` into its status."""

    def wrap(method: _Method[_Req, _Resp]) -> _Method[_Req, _Resp]:
        @functools.wraps(method)
        async def wrapper(self: OipServicer, request: _Req, context: Context) -> _Resp:
            metrics = self.inference.metrics
            try:
                if not public:
                    self.authorize(context)
                response = await method(self, request, context)
            except _Refused as e:
                metrics.errors.labels(e.reason).inc()
                metrics.count_request(endpoint, e.http_status)
                await context.abort(e.code, e.message)
            except asyncio.CancelledError:
                metrics.count_request(endpoint, CLIENT_GONE)
                raise
            except Exception:  # a bug here or in the predictor: its words stay in the log
                log.exception("gRPC %s failed", method.__name__)
                metrics.errors.labels("internal").inc()
                metrics.count_request(endpoint, 500)
                message = f"internal error answering {method.__name__}; see the server log"
                await context.abort(grpc.StatusCode.INTERNAL, message)
            else:
                metrics.count_request(endpoint, 200)
                return response

        return wrapper

    return wrap


class OipServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The six calls of the protocol, for the model ``inference`` serves (``grpc.aio``)."""

    def __init__(self, inference: Inference, token: str | None = None) -> None:
        if token is not None and not token.strip():
            msg = "token: empty; give None to serve without a token"
            raise ValueError(msg)
        self.inference = inference
        self._token = None if token is None else token.encode()
        self._version = _version()

    def authorize(self, context: Context) -> None:
        """Raise ``UNAUTHENTICATED`` unless the call carries ``authorization: Bearer <token>``
        (always passes with no token)."""
        if self._token is None:
            return
        for key, value in context.invocation_metadata() or ():
            if key != AUTH_HEADER:
                continue
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, credentials = text.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                credentials.strip().encode("latin-1", "replace"), self._token
            ):
                return
        message = 'missing or wrong bearer token: send the metadata "authorization: Bearer <token>"'
        raise _Refused(grpc.StatusCode.UNAUTHENTICATED, 401, message, "unauthorized")

    def _served_version(self) -> str | None:
        known = self.inference.predictor.metadata().get("version")
        return None if known is None else str(known)

    def check_model(self, name: str, version: str) -> None:
        """Raise ``NOT_FOUND`` unless ``name`` (and ``version``, when not empty) is the
        model served, in the words of the HTTP side's 404."""
        predictor = self.inference.predictor
        if name != predictor.name:
            message = f'unknown model "{name}"; this server serves "{predictor.name}"'
            raise _Refused(grpc.StatusCode.NOT_FOUND, 404, message, "unknown_model")
        if not version:
            return
        known = self._served_version()
        if known == version:
            return
        have = (
            "no numbered version (leave the version empty)"
            if known is None
            else f'version "{known}"'
        )
        message = f'model "{name}" has no version "{version}"; it serves {have}'
        raise _Refused(grpc.StatusCode.NOT_FOUND, 404, message, "unknown_model")

    @_answered("grpc_health_live", public=True)
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_answered("grpc_health_ready", public=True)
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Context
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.inference.probe_ready())

    @_answered("grpc_model_ready")
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        self.check_model(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.inference.probe_ready())

    @_answered("grpc_server_metadata")
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return grpc_oip.server_metadata(self._version)

    @_answered("grpc_model_metadata")
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        self.check_model(request.name, request.version)
        predictor = self.inference.predictor
        return grpc_oip.model_metadata(predictor.name, predictor.heads, predictor.metadata())

    @_answered("grpc_infer")
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Context
    ) -> pb.ModelInferResponse:
        self.check_model(request.model_name, request.model_version)
        predictor = self.inference.predictor
        try:
            parsed = grpc_oip.parse_infer(request, predictor.heads)
        except OipError as e:
            raise _refused(e) from None
        timeout_s = parsed.timeout_s
        remaining = context.time_remaining()  # None: the call has no deadline
        if remaining is not None and (timeout_s is None or remaining < timeout_s):
            timeout_s = remaining
        n = len(parsed.records)
        try:
            future = self.inference.submit(
                parsed.records, timeout_s=timeout_s, priority=parsed.priority
            )
        except RuntimeError as e:  # the HTTP server is not started, or stopped
            message = f'model "{predictor.name}" is not served now ({e}); retry'
            raise _Refused(grpc.StatusCode.UNAVAILABLE, 503, message, "unavailable") from None
        # Cancelling this call (the client gave up) cancels the future: a request not
        # yet queued is then never scored.
        prediction = await self._scored(asyncio.wrap_future(future), predictor.name, n)
        try:
            response = grpc_oip.infer_response(
                predictor.name, self._served_version(), predictor.heads, parsed, prediction
            )
        except ValueError as e:
            raise _internal(predictor.name, n, e) from None
        self.inference.metrics.records.inc(n)
        return response

    async def _scored(self, scoring: Awaitable[Prediction], name: str, n: int) -> Prediction:
        """The prediction, or the refusal its error stands for (bad records counted)."""
        try:
            return await scoring
        except BadRecords as e:
            for bad in e.errors:
                self.inference.metrics.bad_records.labels(bad.reason).inc()
            message = grpc_oip.bad_records_message(e.errors, n)
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, 400, message, "bad_records") from None
        except ModelUnavailable as e:
            message = f'model "{name}" cannot answer now: {e}; retry'
            raise _Refused(grpc.StatusCode.UNAVAILABLE, 503, message, "unavailable") from None
        except OipError as e:  # too many records (413), not ready or shed (503), late (504)
            raise _refused(e) from None
        except Exception as e:
            raise _internal(name, n, e) from None


def _internal(name: str, n: int, error: Exception) -> _Refused:
    log.error('model "%s" failed on a gRPC request of %d records', name, n, exc_info=error)
    message = f'model "{name}" failed on {n} records ({type(error).__name__}); see the server log'
    return _Refused(grpc.StatusCode.INTERNAL, 500, message, "internal")


class GrpcInferenceServer:
    """The gRPC front end of one HTTP :class:`~serving.http.InferenceServer` (``inference``),
    on a thread of its own.

    ``start()`` binds (``port=0``: a free port) and returns ``"host:port"``;
    ``stop()`` cancels the calls still running after ``grace_s`` and closes the
    server. Also a context manager. ``max_request_bytes``: the largest message
    taken (gRPC refuses a larger one, ``RESOURCE_EXHAUSTED``), as the HTTP server's
    body limit; ``max_concurrent_rpcs``: the calls answered at once, past which
    gRPC refuses them at once (``RESOURCE_EXHAUSTED``) rather than queueing them.
    Stop it before the HTTP server: a call waiting on a stopped HTTP server's loop is
    answered only by its own deadline, or by this server's ``stop()``.
    """

    def __init__(
        self,
        inference: Inference,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_request_bytes: int = 16 << 20,
        max_concurrent_rpcs: int = 256,
        grace_s: float = 1.0,
    ) -> None:
        if not 0 <= port <= 65535:
            msg = f"port: expected 0 (a free port) to 65535, got {port}"
            raise ValueError(msg)
        if max_request_bytes < 1:
            msg = f"max_request_bytes: expected a positive byte count, got {max_request_bytes}"
            raise ValueError(msg)
        if max_concurrent_rpcs < 1:
            msg = f"max_concurrent_rpcs: expected a positive call count, got {max_concurrent_rpcs}"
            raise ValueError(msg)
        if grace_s < 0:
            msg = f"grace_s: expected seconds >= 0, got {grace_s}"
            raise ValueError(msg)
        self.servicer = OipServicer(inference, token)
        self.host = host
        self.port: int | None = None
        self.address: str | None = None
        self.max_request_bytes = max_request_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.grace_s = grace_s
        self._requested_port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None

    def start(self) -> str:
        """Bind, start serving on a thread, and return the address (``host:port``)."""
        if self._thread is not None:
            msg = f"GrpcInferenceServer: already started at {self.address}"
            raise RuntimeError(msg)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="streamrec-serve-grpc", daemon=True)
        thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._open(), loop).result()
        except BaseException:
            asyncio.run_coroutine_threadsafe(self._close(None, 0), loop).result()
            self._close_loop(loop, thread)
            raise
        self._loop, self._thread = loop, thread
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.address = f"{host}:{self.port}"
        return self.address

    async def _open(self) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_request_bytes),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ],
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
        host = f"[{self.host}]" if ":" in self.host else self.host
        where = f"{host}:{self._requested_port}"
        try:
            port = server.add_insecure_port(where)
        except RuntimeError as e:  # newer grpcio raises where older ones return 0
            port, reason = 0, f": {e}"
        else:
            reason = ""
        if port == 0:
            await server.stop(None)
            msg = f"could not listen on {where} (port in use?){reason}"
            raise OSError(msg)
        await server.start()
        self._server = server
        return port

    @staticmethod
    async def _close(server: grpc.aio.Server | None, grace_s: float) -> None:
        if server is not None:
            await server.stop(grace_s)
        # What grpc.aio leaves behind ends here, not as "Task was destroyed" at close().
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    @staticmethod
    def _close_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def stop(self) -> None:
        """Stop serving: refuse new calls, cancel those still running after ``grace_s``."""
        loop, thread, server = self._loop, self._thread, self._server
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(server, self.grace_s), loop).result()
        self._close_loop(loop, thread)
        self._loop = self._thread = self._server = None

    def __enter__(self) -> GrpcInferenceServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
