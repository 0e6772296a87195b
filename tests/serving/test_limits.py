"""What one request, one client or a flood may take of the server: real sockets, a real
server on 127.0.0.1, and after every refusal the next request answered.

The model here sleeps to stand for work that holds the server's loop (a large
request's kernels, a store read): the server scores on its loop's thread.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import tritonclient.http as tritonclient_http
import tritonclient.utils as tritonclient_utils

from serving.http import InferenceServer
from serving.oip import encode_bytes_tensor
from serving.types import Deadline, OipError, Prediction

MODEL = "/v2/models/slow"


class SlowModel:
    """Sleeps ``delay_s`` per call, in two halves with a deadline check between them
    (as the real model checks between its stages); counts the records it scored."""

    name = "slow"
    heads = ("click",)

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.calls = 0
        self.scored = 0

    def ready(self) -> bool:
        return True

    def metadata(self) -> Mapping[str, object]:
        return {"version": 7}

    def predict(self, records: Sequence[bytes], *, deadline: Deadline | None = None) -> Prediction:
        self.calls += 1
        time.sleep(self.delay_s / 2)
        if deadline is not None:
            deadline.check("the first half")
        time.sleep(self.delay_s / 2)
        self.scored += len(records)
        return Prediction({"click": np.full(len(records), 0.5, np.float32)}, {"dense_version": 7})


class Unchecked(SlowModel):
    """A model that takes no deadline: only the queue's checks apply."""

    def predict(self, records: Sequence[bytes]) -> Prediction:  # type: ignore[override]
        return super().predict(records)


def body(n: int = 1, **parameters: Any) -> bytes:
    doc: dict[str, Any] = {
        "inputs": [{"name": "records", "datatype": "BYTES", "shape": [n], "data": ["{}"] * n}]
    }
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def post(path: str, payload: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n{extra}\r\n"
    ).encode() + payload


def connect(server: InferenceServer) -> socket.socket:
    assert server.port is not None
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response off ``sock``: status, lower-cased headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a response body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What ``sock`` got until the server closed it (fails if it stays open)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds}s; got {got!r}")
    return got


def infer(server: InferenceServer, payload: bytes | None = None) -> tuple[int, dict[str, Any]]:
    with connect(server) as sock:
        sock.sendall(post(f"{MODEL}/infer", payload or body()))
        code, _, reply = read_reply(sock)
    return code, json.loads(reply)


@pytest.fixture
def model() -> SlowModel:
    return SlowModel()


def serving(model: SlowModel, **limits: Any) -> InferenceServer:
    return InferenceServer(model, **limits)


@pytest.fixture
def timed(model: SlowModel) -> Iterator[InferenceServer]:
    with serving(model, request_timeout_s=0.3) as server:
        yield server


def test_a_slow_request_gets_504_and_the_next_is_answered(
    timed: InferenceServer, model: SlowModel
) -> None:
    model.delay_s = 1.0  # past the deadline at its first check, 0.5 s in
    code, reply = infer(timed)
    assert code == 504, reply
    assert reply["error"].startswith(
        "request timed out after 0.3s while the first half (serving.request_timeout_s"
    )
    assert model.scored == 0  # stopped between its stages
    model.delay_s = 0.0
    code, reply = infer(timed)
    assert code == 200, reply
    # The tornado path (a versioned URL) keeps the same deadline.
    model.delay_s = 1.0
    with connect(timed) as sock:
        sock.sendall(post(f"{MODEL}/versions/7/infer", body()))
        code, _, raw = read_reply(sock)
    assert code == 504, raw
    metrics = timed.metrics.exposition().decode()
    assert 'streamrec_serve_errors_total{reason="timeout"} 2.0' in metrics


def test_a_request_whose_deadline_passes_while_it_waits_is_not_scored() -> None:
    """Requests handed to the loop (``submit``, the gRPC front end's way in) while it
    scores another: their deadlines count from the hand-over, pass while they wait,
    and they are answered without being scored."""
    slow = Unchecked()
    slow.delay_s = 0.6
    with serving(slow, request_timeout_s=0.3, max_batch_records=1) as server:
        first = server.submit([b"{}"])
        time.sleep(0.15)  # the loop is scoring the first
        waiting = [server.submit([b"{}"]), server.submit([b"{}"], priority=1)]
        assert first.result(timeout=10).probabilities["click"].tolist() == [0.5]
        for future in waiting:
            with pytest.raises(OipError) as info:
                future.result(timeout=10)
            assert info.value.status == 504
            assert "while waiting in the queue" in info.value.message
        assert slow.calls == 1
        slow.delay_s = 0.0
        assert infer(server)[0] == 200


def test_the_triton_timeout_parameter_shortens_the_deadline(model: SlowModel) -> None:
    model.delay_s = 0.6
    with serving(model, request_timeout_s=30.0) as server:
        assert server.url is not None
        client = tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"))
        tensor = tritonclient_http.InferInput("records", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"{}"], dtype=object))
        with pytest.raises(tritonclient_utils.InferenceServerException) as info:
            client.infer("slow", [tensor], timeout=200_000, priority=1)  # microseconds
        assert "request timed out after 0.2s" in str(info.value)
        model.delay_s = 0.0
        answer = client.infer("slow", [tensor], timeout=5_000_000, priority=2)
        assert answer.as_numpy("click").tolist() == [0.5]
        client.close()


def test_a_full_queue_sheds_requests_with_503_and_retry_after(model: SlowModel) -> None:
    model.delay_s = 0.3
    with serving(model, max_batch_records=1, max_queued_records=1) as server:
        first = connect(server)
        first.sendall(post(f"{MODEL}/infer", body()))
        time.sleep(0.1)  # the loop scores the first; five more arrive meanwhile
        others = [connect(server) for _ in range(5)]
        for sock in others:
            sock.sendall(post(f"{MODEL}/infer", body()))
        assert read_reply(first)[0] == 200
        replies = [read_reply(sock) for sock in others]
        shed = [r for r in replies if r[0] == 503]
        assert shed, [r[0] for r in replies]
        assert {r[0] for r in replies} <= {200, 503}, replies
        for _, headers, raw in shed:
            assert headers["retry-after"] == "1"
            assert b"max_queued_records" in raw
        for sock in [first, *others]:
            sock.close()
        model.delay_s = 0.0
        assert infer(server)[0] == 200
        assert model.calls == 1 + len(replies) - len(shed) + 1


def test_too_many_records_get_413_before_any_is_decoded(model: SlowModel) -> None:
    with serving(model, max_request_records=100) as server:
        code, reply = infer(server, body(101))
        assert code == 413, reply
        assert reply["error"].startswith(
            "inputs[0].shape: 101 records, over this server's limit of 100 per request"
        )
        # A binary tensor whose shape claims more than the limit: refused from its head.
        head = json.dumps({
            "inputs": [{"name": "records", "datatype": "BYTES", "shape": [3_000_000],
                        "parameters": {"binary_data_size": 8}}],
        }).encode()  # fmt: skip
        payload = head + encode_bytes_tensor([b"{}", b""])
        with connect(server) as sock:
            sock.sendall(
                post(f"{MODEL}/infer", payload, f"Inference-Header-Content-Length: {len(head)}\r\n")
            )
            code, _, raw = read_reply(sock)
        assert code == 413, raw
        assert model.calls == 0
        assert infer(server, body(100))[0] == 200


def test_connections_past_the_cap_get_503_and_are_closed(model: SlowModel) -> None:
    with serving(model, max_connections=2) as server:
        held = [connect(server), connect(server)]
        for sock in held:  # both accepted and answered: the loop knows them
            sock.sendall(post(f"{MODEL}/infer", body()))
            assert read_reply(sock)[0] == 200
        extra = connect(server)
        got = closed_within(extra, 10)
        assert got.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), got
        assert b"Retry-After: 1\r\n" in got
        assert b"limit of 2 connections (max_connections)" in got
        extra.close()
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the close on its next turn
            code, _ = infer(server)
            if code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert code == 200
        held[0].sendall(post(f"{MODEL}/infer", body()))
        assert read_reply(held[0])[0] == 200
        held[0].close()


def test_an_idle_connection_is_closed(model: SlowModel) -> None:
    with serving(model, idle_timeout_s=0.5) as server:
        sock = connect(server)
        sock.sendall(post(f"{MODEL}/infer", body()))
        assert read_reply(sock)[0] == 200
        started = time.monotonic()
        assert closed_within(sock, 10) == b""
        assert time.monotonic() - started >= 0.4
        sock.close()
        assert infer(server)[0] == 200


@pytest.mark.parametrize(
    "partial",
    [
        b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-",  # a head cut short
        post(f"{MODEL}/infer", body())[:-5],  # a body cut short
    ],
    ids=["head", "body"],
)
def test_a_request_that_trickles_in_gets_408(model: SlowModel, partial: bytes) -> None:
    with serving(model, read_timeout_s=0.5) as server:
        sock = connect(server)
        sock.sendall(partial)
        got = closed_within(sock, 10)
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert b"within 0.5s of its first byte (read_timeout_s)" in got
        sock.close()
        assert infer(server)[0] == 200
        assert 'reason="read_timeout"' in server.metrics.exposition().decode()


def test_a_chunked_body_that_trickles_is_cut_off_by_tornado(model: SlowModel) -> None:
    with serving(model, read_timeout_s=0.5) as server:
        sock = connect(server)
        # Chunked: handed over to tornado, whose body timeout is the same.
        sock.sendall(
            b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b'\r\n5\r\n{"inp\r\n'
        )
        closed_within(sock, 10)
        sock.close()
        assert infer(server)[0] == 200


def test_submit_scores_from_another_thread_through_the_same_limits(model: SlowModel) -> None:
    with serving(model, max_request_records=3, request_timeout_s=5.0) as server:
        got: list[Any] = []

        def from_thread() -> None:
            got.append(server.submit([b"{}", b"{}"]).result(timeout=10))
            try:
                server.submit([b"{}"] * 4).result(timeout=10)
            except OipError as e:
                got.append(e)
            model.delay_s = 0.6
            try:
                server.submit([b"{}"], timeout_s=0.2).result(timeout=10)
            except OipError as e:
                got.append(e)

        thread = threading.Thread(target=from_thread)
        thread.start()
        thread.join(30)
        prediction, too_many, late = got
        assert prediction.probabilities["click"].tolist() == [0.5, 0.5]
        assert (too_many.status, too_many.reason) == (413, "too_many_records")
        assert (late.status, late.reason) == (504, "timeout")
