"""The server's connections: plain infer requests answered on the socket, the rest by tornado.

A prediction server beside a training job pays for every instruction a
request runs, and each request, arriving alone every few milliseconds, finds
the caches cold. Tornado's HTTP/1.1 connection (an ``IOStream``, a coroutine
per request, a header object, a handler) is a large part of a paced small
request's CPU beside the model; this module's protocol answers the requests a
client sends over and over with a few dozen lines of work.

:class:`Wire` is an ``asyncio.Protocol``. It reads a request's head and, when
:func:`plain_infer` says it is a plain infer request, reads its body, answers
it with the server's ``answer`` function and writes the response itself.
Anything else (another endpoint, a refusal, a chunked body, an ``Expect``
header, a head it cannot read) hands the connection over to tornado for the
rest of its life, with the bytes read so far: a socket pair carries them to a
connection of tornado's ``HTTPServer``, and tornado's answers back. Tornado
decides everything but the plain case, so the two cannot disagree on what is
valid HTTP.

The connections are bounded: past ``max_connections`` a new one is answered
503 and closed; a sweep closes a connection idle for ``idle_timeout_s``, and
answers 408 and closes one whose request is not all there ``read_timeout_s``
after its first byte (a client that trickles its request cannot hold a
connection forever). Tornado applies the same two timeouts to the connections
handed over to it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from http.client import responses
from typing import Final, NamedTuple

from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream

__all__ = ["PlainInfer", "Reply", "Wire", "WireServer", "plain_infer"]

log = logging.getLogger("streamrec.serve")

# A head longer than this is left to tornado, which refuses it.
MAX_HEAD_BYTES: Final = 64 << 10
# Bytes read ahead of an answer (pipelined requests) before reading pauses.
READ_AHEAD_BYTES: Final = 1 << 20


class PlainInfer(NamedTuple):
    """What :class:`Wire` needs of a plain infer request's head."""

    body_length: int
    header_length: str | None  # Inference-Header-Content-Length, as sent
    keep_alive: bool


class Reply(NamedTuple):
    """An answer to write: status, body, content type and the JSON part's length of a
    binary response."""

    status: int
    body: bytes
    content_type: str = "application/json"
    header_length: int | None = None
    retry_after_s: int | None = None  # sent as Retry-After (a shed request's 503)


def plain_infer(head: bytes, path: bytes, max_body: int, token: bytes | None) -> PlainInfer | None:
    """The plain infer request in ``head`` (the bytes before the blank line), or None.

    Plain: ``POST path HTTP/1.1`` (no query), one Content-Length of at most
    ``max_body``, no Transfer-Encoding, Expect or Upgrade, no Content-Encoding
    but ``identity``, and ``Authorization: Bearer <token>`` when there is a
    token. None leaves the request to tornado, which answers it or refuses it.

    >>> head = b"POST /v2/models/m/infer HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 12"
    >>> plain_infer(head, b"/v2/models/m/infer", 1 << 20, None)
    PlainInfer(body_length=12, header_length=None, keep_alive=True)
    >>> plain_infer(head, b"/v2/models/m/infer", 10, None) is None  # too long: tornado's 413
    True
    >>> plain_infer(head + b"\\r\\nConnection: close", b"/v2/models/m/infer", 99, None)
    PlainInfer(body_length=12, header_length=None, keep_alive=False)
    >>> plain_infer(head, b"/v2/models/m/infer", 99, b"secret") is None  # tornado's 401
    True
    """
    lines = head.split(b"\r\n")
    if lines[0] != b"POST " + path + b" HTTP/1.1":
        return None
    length: int | None = None
    header_length: str | None = None
    keep_alive = True
    authorized = token is None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[0] in b" \t" or name[-1] in b" \t":
            return None  # folded or malformed: tornado says what is wrong
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name in (b"transfer-encoding", b"expect", b"upgrade"):
            return None
        elif name == b"content-encoding":
            if value.lower() != b"identity":
                return None
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            keep_alive = b"close" not in tokens
        elif name == b"inference-header-content-length":
            header_length = value.decode("latin-1")
        elif name == b"authorization" and token is not None:
            scheme, _, credentials = value.partition(b" ")
            authorized = scheme.lower() == b"bearer" and hmac.compare_digest(
                credentials.strip(), token
            )
    if length is None or length > max_body or not authorized:
        return None
    return PlainInfer(length, header_length, keep_alive)


def _head(
    status: int,
    length: int,
    date: bytes,
    content_type: bytes = b"application/json",
    extra: bytes = b"",
) -> bytes:
    """A response's status line and headers, ``extra`` (whole header lines) last.

    >>> _head(408, 2, b"D", extra=b"Connection: close\\r\\n").split(b"\\r\\n")
    [b'HTTP/1.1 408 Request Timeout', b'Content-Type: application/json', \
b'Content-Length: 2', b'Date: D', b'Connection: close', b'', b'']
    """
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nDate: %s\r\n%s\r\n" % (
        status, responses.get(status, "").encode(), content_type, length, date, extra,
    )  # fmt: skip


class WireServer:
    """What every connection of one server shares: how to answer, where to hand over.

    ``answer(body, header_length, start, done)`` answers a plain infer request's
    body (``start``: the ``perf_counter`` its head was read at), telling ``done``
    the reply (at once, or on a later turn of the loop); ``answered(status,
    seconds)`` is told of each answer (the metrics); ``refused(reason)`` of each
    connection refused or closed by a limit; ``tornado`` serves the connections
    handed over.
    """

    def __init__(
        self,
        path: str | None,
        max_body: int,
        token: bytes | None,
        answer: Callable[[bytes, str | None, float, Callable[[Reply], None]], None],
        answered: Callable[[int, float], None],
        tornado: HTTPServer,
        *,
        max_connections: int | None = None,
        idle_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        """``path``: the infer URL's path; None: every request goes to tornado. The
        limits: None for none."""
        self.path = None if path is None else path.encode()
        self.max_body = max_body
        self.token = token
        self.answer = answer
        self.answered = answered
        self.tornado = tornado
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.read_timeout_s = read_timeout_s
        self.refused = refused or (lambda reason: None)
        self.connections: set[Wire] = set()
        self._date = (0, b"")
        self._sweeper: asyncio.TimerHandle | None = None

    def date(self) -> bytes:
        """The Date header's value, formatted once a second."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    def protocol(self) -> Wire:
        """A protocol for one accepted connection (``loop.create_server``'s factory)."""
        return Wire(self)

    def start_sweeping(self) -> None:
        """Close idle and trickling connections from now on, on the running loop: a
        sweep every quarter of the shorter timeout (at most a second apart), rather
        than a timer per request."""
        timeouts = [t for t in (self.idle_timeout_s, self.read_timeout_s) if t is not None]
        if not timeouts:
            return
        every = min(1.0, min(timeouts) / 4)
        loop = asyncio.get_running_loop()

        def sweep() -> None:
            self.sweep(time.perf_counter())
            self._sweeper = loop.call_later(every, sweep)

        self._sweeper = loop.call_later(every, sweep)

    def sweep(self, now: float) -> None:
        """Close the connections past a timeout at ``now`` (a ``perf_counter``)."""
        for wire in list(self.connections):
            wire.check_timeouts(now)

    def close_all(self) -> None:
        """Close every connection, handed over or not."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for wire in list(self.connections):
            wire.close()


class Wire(asyncio.Protocol):
    """One client connection: plain infer requests answered here, one at a time and in
    order; the rest of the connection handed to tornado at the first other request."""

    def __init__(self, server: WireServer) -> None:
        self.server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._request: PlainInfer | None = None  # its head read, its body awaited
        self._body_at = 0  # where that body starts in the buffer
        self._started = 0.0
        self._answering = False
        self._in_next = False  # in _next's loop, which takes the next request itself
        self._writing_paused = False
        self._reading_paused = False
        self._closed = False
        self._pipe: asyncio.Transport | None = None  # to tornado, once handed over
        self._handing_over = False
        self._eof = False  # the client sent all it will send
        self._task: asyncio.Future[None] | None = None  # answering, or handing over
        # Since when the connection has waited for a request, or read the one it has.
        self._idle_since = time.perf_counter()
        self._reading_since: float | None = None

    # --- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        server = self.server
        limit = server.max_connections
        if limit is not None and len(server.connections) >= limit:
            self._closed = True
            server.refused("too_many_connections")
            message = (
                f'{{"error":"server at its limit of {limit} connections (max_connections); '
                f'retry after the Retry-After seconds"}}'
            ).encode()
            extra = b"Retry-After: 1\r\nConnection: close\r\n"
            transport.write(_head(503, len(message), server.date(), extra=extra) + message)
            transport.close()
            return
        server.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # An answer is one write; Nagle would hold it back for the client's ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._pipe is not None:
            self._pipe.write(data)
            return
        if self._closed:
            return
        if self._reading_since is None:
            self._reading_since = time.perf_counter()
        self._buffer += data
        if self._handing_over:
            return
        if self._answering or self._writing_paused:
            if len(self._buffer) > READ_AHEAD_BYTES:
                self._pause_reading()
            return
        self._next()

    def eof_received(self) -> bool:
        if self._pipe is not None:
            if self._pipe.can_write_eof():
                self._pipe.write_eof()
            return True
        # A client that half-closes after its request still gets its answer; one that
        # does so inside a request will never send the rest of it.
        self._eof = True
        return self._answering or self._handing_over

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server.connections.discard(self)
        if self._pipe is not None:
            self._pipe.close()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._pipe is not None:
            self._pipe.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._pipe is not None:
            self._pipe.resume_reading()
        elif not self._answering and not self._handing_over:
            self._next()

    # --- requests ----------------------------------------------------------------

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._pipe is not None:
            self._pipe.close()

    def check_timeouts(self, now: float) -> None:
        """Close this connection when idle past ``idle_timeout_s``, or answer 408 and
        close it when its request is not all there ``read_timeout_s`` after it began.
        A connection being answered, or handed over (tornado's own timeouts), is left."""
        if self._closed or self._answering or self._handing_over or self._pipe is not None:
            return
        server = self.server
        if self._reading_since is None:
            if server.idle_timeout_s is not None and now - self._idle_since > server.idle_timeout_s:
                server.refused("idle_timeout")
                self.close()
            return
        limit = server.read_timeout_s
        if limit is not None and now - self._reading_since > limit:
            server.refused("read_timeout")
            message = (
                f'{{"error":"request not received whole within {limit:g}s of its first '
                f'byte (read_timeout_s); send it at once"}}'
            ).encode()
            assert self._transport is not None
            head = _head(408, len(message), server.date(), extra=b"Connection: close\r\n")
            self._transport.write(head + message)
            self._closed = True
            self._transport.close()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _next(self) -> None:
        """Answer the requests in the buffer, one at a time, while they are whole (a
        loop, not a recursion: an answer may come before ``answer`` returns)."""
        if self._in_next:
            return
        self._in_next = True
        try:
            while (
                not self._answering
                and not self._writing_paused
                and not self._handing_over
                and not self._closed
                and self._pipe is None
                and self._buffer
                and self._start_one()
            ):
                pass
        finally:
            self._in_next = False

    def _start_one(self) -> bool:
        """Start answering the request at the buffer's head; False when it is not
        whole yet, or was handed over."""
        buffer = self._buffer
        request = self._request
        if request is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    self._hand_over()
                return False
            server = self.server
            request = (
                plain_infer(bytes(buffer[:end]), server.path, server.max_body, server.token)
                if server.path is not None
                else None
            )
            if request is None:
                self._hand_over()
                return False
            self._request = request
            self._body_at = end + 4
            self._started = time.perf_counter()
        end = self._body_at + request.body_length
        if len(buffer) < end:
            return False
        body = bytes(buffer[self._body_at : end])
        del buffer[:end]
        self._request = None
        self._answering = True
        started = self._started
        answered = False

        def done(reply: Reply) -> None:
            nonlocal answered
            if not answered:  # once, whatever calls it
                answered = True
                self._answered(reply, request, started)

        try:
            self.server.answer(body, request.header_length, started, done)
        except Exception:  # a bug there must not leave the client waiting
            log.exception("answering an infer request")
            done(Reply(500, b'{"error":"internal error answering the request"}'))
        return True

    def _answered(self, reply: Reply, request: PlainInfer, started: float) -> None:
        server = self.server
        if self._closed:
            return
        transport = self._transport
        assert transport is not None
        extra = b""
        if reply.header_length is not None:
            extra = b"Inference-Header-Content-Length: %d\r\n" % reply.header_length
        if not request.keep_alive:
            extra += b"Connection: close\r\n"
        if reply.retry_after_s is not None:
            extra += b"Retry-After: %d\r\n" % reply.retry_after_s
        head = _head(
            reply.status, len(reply.body), server.date(), reply.content_type.encode(), extra
        )
        transport.write(head + reply.body)
        server.answered(reply.status, time.perf_counter() - started)
        if not request.keep_alive or (self._eof and not self._buffer):
            transport.close()
            return
        now = time.perf_counter()
        self._idle_since = now
        self._reading_since = now if self._buffer else None  # a pipelined request began
        self._answering = False
        self._resume_reading()
        self._next()  # returns at once when called from within _next's loop

    # --- handing over ------------------------------------------------------------

    def _hand_over(self) -> None:
        """The rest of this connection, from the bytes in the buffer on, to tornado."""
        self._handing_over = True
        ours, theirs = socket.socketpair()
        assert self._transport is not None
        peer = self._transport.get_extra_info("peername")
        self.server.tornado.handle_stream(IOStream(theirs), peer)
        self._task = asyncio.ensure_future(self._connect(ours))

    async def _connect(self, ours: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            pipe, _ = await loop.create_connection(lambda: _Pipe(self), sock=ours)
        except OSError:
            log.exception("handing a connection over to tornado")
            self.close()
            return
        assert isinstance(pipe, asyncio.Transport)
        if self._closed:
            pipe.close()
            return
        self._pipe = pipe
        self._handing_over = False
        if self._buffer:
            pipe.write(bytes(self._buffer))
            self._buffer.clear()
        self._resume_reading()
        if self._writing_paused:
            pipe.pause_reading()

    def _from_tornado(self, data: bytes) -> None:
        if not self._closed and self._transport is not None:
            self._transport.write(data)

    def _tornado_closed(self) -> None:
        if self._transport is not None:
            self._transport.close()  # after what is buffered is sent


class _Pipe(asyncio.Protocol):
    """Tornado's end of a handed-over connection, as seen from the client's."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.wire._from_tornado(data)

    def eof_received(self) -> bool:
        return False  # tornado closed its side: close the client's

    def connection_lost(self, exc: Exception | None) -> None:
        self.wire._tornado_closed()

    def pause_writing(self) -> None:
        self.wire._pause_reading()

    def resume_writing(self) -> None:
        self.wire._resume_reading()
