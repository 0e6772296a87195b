"""The real server on 127.0.0.1 and real clients: tritonclient.http, urllib, raw sockets."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.http as tritonclient_http
import tritonclient.utils as tritonclient_utils

from serving.http import InferenceServer
from serving.oip import encode_bytes_tensor
from serving.types import BadRecords, ModelUnavailable, Prediction, Predictor, RecordError

InferenceServerException = tritonclient_utils.InferenceServerException

TOKEN = "s3cret-token"
MODEL = "/v2/models/ranker"
VERSIONS = {"dense_version": 11, "sparse_version": 12, "samples_learned": 3456}


class FakeRanker:
    """click = sigmoid(len(record) / 100), like = 1 - click; records must be JSON objects."""

    name = "ranker"
    heads = ("click", "like")

    def __init__(self) -> None:
        self.is_ready = True
        self.calls = 0

    def ready(self) -> bool:
        return self.is_ready

    def metadata(self) -> Mapping[str, object]:
        return {"version": "3", **VERSIONS}

    def predict(self, records: Sequence[bytes]) -> Prediction:
        self.calls += 1
        errors: list[RecordError] = []
        for i, record in enumerate(records):
            try:
                doc = json.loads(record)
            except ValueError as e:
                errors.append(RecordError(i, None, "not_json", str(e)))
                continue
            if not isinstance(doc, dict):
                errors.append(RecordError(i, None, "not_object", f"a JSON {type(doc).__name__}"))
            elif "user" not in doc:
                errors.append(RecordError(i, "user", "missing_field", "no key user"))
            elif doc["user"] == "boom":
                msg = "the model broke"
                raise RuntimeError(msg)
        if errors:
            raise BadRecords(errors)
        click = expected_click(records)
        return Prediction({"click": click, "like": 1 - click}, VERSIONS)


def expected_click(records: Sequence[bytes]) -> npt.NDArray[np.float32]:
    lengths = np.array([len(r) for r in records], np.float32)
    return (1 / (1 + np.exp(-lengths / 100))).astype(np.float32)


RECORDS = [b'{"user": 1}', b'{"user": 22, "items": [1, 2, 3]}']


@pytest.fixture(scope="module")
def ranker() -> FakeRanker:
    return FakeRanker()


@pytest.fixture(scope="module")
def server(ranker: FakeRanker) -> Iterator[InferenceServer]:
    with InferenceServer(ranker, max_request_bytes=1 << 20) as running:
        yield running


def triton(server: InferenceServer) -> Any:
    assert server.url is not None
    return tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"))


@pytest.fixture
def client(server: InferenceServer) -> Iterator[Any]:
    c = triton(server)
    yield c
    c.close()


def records_input(records: Sequence[bytes], *, binary: bool, shape: list[int] | None = None) -> Any:
    tensor = tritonclient_http.InferInput("records", shape or [len(records)], "BYTES")
    tensor.set_data_from_numpy(
        np.array(records, dtype=object).reshape(shape or [len(records)]), binary_data=binary
    )
    return tensor


def request(
    server: InferenceServer,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes, Mapping[str, str]]:
    """A plain urllib request (what curl does); returns status, body, lower-cased headers."""
    req = urllib.request.Request(f"{server.url}{path}", data=body, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, reply.read(), {k.lower(): v for k, v in reply.headers.items()}
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}


def json_request(records: Sequence[str], **doc: Any) -> bytes:
    inputs = [{"name": "records", "datatype": "BYTES", "shape": [len(records)],
               "data": list(records)}]  # fmt: skip
    return json.dumps({"inputs": inputs, **doc}).encode()


def raise_status(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    return info.value.status(), info.value.message()


# --- health and metadata -----------------------------------------------------------------


def test_the_fake_is_a_predictor(ranker: FakeRanker) -> None:
    assert isinstance(ranker, Predictor)


def test_live_ready_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("ranker")
    assert client.is_model_ready("ranker", model_version="3")
    assert not client.is_model_ready("ranker", model_version="4")
    assert client.get_server_metadata() == {
        "name": "streamrec",
        "version": "0.1.0",
        "extensions": ["binary_tensor_data"],
    }
    meta = client.get_model_metadata("ranker")
    assert meta["name"] == "ranker"
    assert meta["versions"] == ["3"]
    assert meta["platform"] == "streamrec"
    assert meta["inputs"] == [{"name": "records", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [
        {"name": "click", "datatype": "FP32", "shape": [-1]},
        {"name": "like", "datatype": "FP32", "shape": [-1]},
    ]
    assert meta["parameters"] == {"version": "3", **VERSIONS}
    assert client.get_model_metadata("ranker", model_version="3") == meta


def test_not_ready_is_503(client: Any, ranker: FakeRanker) -> None:
    ranker.is_ready = False
    try:
        assert client.is_server_live()
        assert not client.is_server_ready()
        assert not client.is_model_ready("ranker")
        status, message = raise_status(
            client.infer, "ranker", [records_input(RECORDS, binary=False)]
        )
        assert (status, message) == (
            "503",
            'model "ranker" is not ready (parameters loading or catching up); retry',
        )
    finally:
        ranker.is_ready = True
    assert client.is_server_ready()


# --- infer -----------------------------------------------------------------------------


def test_infer_json_tensors(client: Any) -> None:
    outputs = [tritonclient_http.InferRequestedOutput(h, binary_data=False)
               for h in ("click", "like")]  # fmt: skip
    result = client.infer(
        "ranker", [records_input(RECORDS, binary=False)], outputs=outputs, request_id="req-1"
    )
    click = expected_click(RECORDS)
    np.testing.assert_array_equal(result.as_numpy("click"), click)
    np.testing.assert_array_equal(result.as_numpy("like"), 1 - click)
    response = result.get_response()
    assert response["model_name"] == "ranker"
    assert response["id"] == "req-1"
    assert response["parameters"] == VERSIONS
    assert response["outputs"][0]["data"] == click.tolist()
    assert "model_version" not in response


def test_infer_binary_by_default(client: Any) -> None:
    # tritonclient's defaults: the input as binary data, outputs asked for as binary.
    result = client.infer("ranker", [records_input(RECORDS, binary=True)])
    click = expected_click(RECORDS)
    np.testing.assert_array_equal(result.as_numpy("click"), click)
    np.testing.assert_array_equal(result.as_numpy("like"), 1 - click)
    assert result.get_output("click")["parameters"] == {"binary_data_size": 8}
    assert result.get_response()["parameters"] == VERSIONS


def test_infer_binary_input_json_output_and_n_by_1(client: Any) -> None:
    outputs = [tritonclient_http.InferRequestedOutput("like", binary_data=False)]
    result = client.infer(
        "ranker", [records_input(RECORDS, binary=True, shape=[2, 1])], outputs=outputs
    )
    np.testing.assert_array_equal(result.as_numpy("like"), 1 - expected_click(RECORDS))


def test_requested_outputs(client: Any) -> None:
    outputs = [tritonclient_http.InferRequestedOutput("like")]
    result = client.infer("ranker", [records_input(RECORDS, binary=False)], outputs=outputs)
    assert result.as_numpy("click") is None
    assert [o["name"] for o in result.get_response()["outputs"]] == ["like"]
    outputs = [tritonclient_http.InferRequestedOutput("dwell", binary_data=False)]
    status, message = raise_status(
        client.infer, "ranker", [records_input(RECORDS, binary=False)], outputs=outputs
    )
    assert status == "400"
    assert message == 'outputs[0].name: unknown output "dwell"; this model\'s outputs are ' \
        '"click", "like"'  # fmt: skip


def test_versioned_url(client: Any, server: InferenceServer) -> None:
    result = client.infer("ranker", [records_input(RECORDS, binary=False)], model_version="3")
    assert result.get_response()["model_version"] == "3"
    status, message = raise_status(
        client.infer, "ranker", [records_input(RECORDS, binary=False)], model_version="9"
    )
    assert (status, message) == ("404", 'model "ranker" has no version "9"; it serves version "3"')


def test_bad_records_are_400_naming_index_field_reason(
    client: Any, server: InferenceServer
) -> None:
    records = [b'{"user": 1}', b"not json", b"[1]", b'{"item": 2}']
    status, message = raise_status(client.infer, "ranker", [records_input(records, binary=False)])
    assert status == "400"
    assert message.startswith("bad record at index 1: not_json (Expecting value")
    assert message.endswith('; 3 of 4 records bad (see "records")')
    status, message = raise_status(
        client.infer, "ranker", [records_input([b'{"item": 2}'], binary=True)]
    )
    assert message == (
        'bad record at index 0, field "user": missing_field (no key user); '
        '1 of 1 records bad (see "records")'
    )
    code, body, _ = request(server, f"{MODEL}/infer", json_request([r.decode() for r in records]))
    assert code == 400
    assert [(r["index"], r["field"], r["reason"]) for r in json.loads(body)["records"]] == [
        (1, None, "not_json"),
        (2, None, "not_object"),
        (3, "user", "missing_field"),
    ]


def test_model_exception_is_500_and_server_keeps_serving(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="streamrec.serve"):
        status, message = raise_status(
            client.infer, "ranker", [records_input([b'{"user": "boom"}'], binary=False)]
        )
    assert (status, message) == (
        "500",
        'model "ranker" failed on 1 records (RuntimeError); see the server log',
    )
    failures = [r for r in caplog.records if r.name == "streamrec.serve" and r.exc_info]
    assert failures
    assert "the model broke" in str(failures[0].exc_info[1])  # type: ignore[index]
    assert (
        client.infer("ranker", [records_input(RECORDS, binary=False)]).as_numpy("click") is not None
    )


def test_unknown_model_is_404(client: Any, server: InferenceServer) -> None:
    status, message = raise_status(client.infer, "nope", [records_input(RECORDS, binary=False)])
    assert (status, message) == ("404", 'unknown model "nope"; this server serves "ranker"')
    status, message = raise_status(client.get_model_metadata, "nope")
    assert (status, message) == ("404", 'unknown model "nope"; this server serves "ranker"')
    assert not client.is_model_ready("nope")
    code, body, _ = request(server, "/v2/nothing/here")
    assert code == 404
    assert json.loads(body)["error"].startswith("no endpoint GET /v2/nothing/here; this server")
    code, body, _ = request(server, f"{MODEL}/infer")  # a GET on the infer URL
    assert code == 405
    assert json.loads(body) == {"error": f"Method Not Allowed: GET {MODEL}/infer"}


def test_curl_like_json_path(server: InferenceServer) -> None:
    records = [r.decode() for r in RECORDS]
    code, body, headers = request(
        server, f"{MODEL}/infer", json_request(records, id="curl-1"),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert code == 200
    assert headers["content-type"] == "application/json"
    reply = json.loads(body)
    assert reply["id"] == "curl-1"
    assert reply["parameters"] == VERSIONS
    assert reply["outputs"][1] == {
        "name": "like",
        "datatype": "FP32",
        "shape": [2],
        "data": (1 - expected_click(RECORDS)).tolist(),
    }
    code, body, _ = request(server, "/v2/health/ready")
    assert (code, json.loads(body)) == (200, {"ready": True})


def binary_request(shape: str) -> tuple[bytes, dict[str, str]]:
    """A binary request of two records whose shape says ``shape`` elements."""
    tensor = encode_bytes_tensor([b"{}", b"{}"])
    head = (
        b'{"inputs": [{"name": "records", "datatype": "BYTES", "shape": [' + shape.encode()
        + b'], "parameters": {"binary_data_size": ' + str(len(tensor)).encode() + b"}}]}"
    )  # fmt: skip
    return head + tensor, {"Inference-Header-Content-Length": str(len(head))}


MALFORMED: list[tuple[str, bytes, dict[str, str]]] = [
    ("not json", b"{records: 1}", {}),
    ("empty body", b"", {}),
    ("json array", b"[]", {}),
    ("non-utf-8", b'{"inputs": [{"name": "records", "data": ["\xc3\x28"]}]}', {}),
    ("latin-1 record", '{"inputs": ["é"]}'.encode("latin-1"), {}),
    ("lone surrogate", json_request(["\ud800"]), {}),
    ("deep nesting", b"[" * 200_000, {}),
    ("wrong types", b'{"inputs": [{"name": 1, "datatype": [], "shape": {}, "data": 5}]}', {}),
    ("huge shape", json_request(["{}"]).replace(b"[1]", b"[100000000000000000000]"), {}),
    ("long shape", json_request(["{}"]).replace(b"[1]", b"[" + b"1," * 100_000 + b"1]"), {}),
    ("float shape", json_request(["{}"]).replace(b"[1]", b"[1e308]"), {}),
    ("infinite shape", json_request(["{}"]).replace(b"[1]", b"[Infinity]"), {}),
    ("record not a string", json_request(["{}"]).replace(b'["{}"]', b"[{}]"), {}),
    ("header length not a number", json_request(["{}"]), {"Inference-Header-Content-Length": "x"}),
    ("header length too big", json_request(["{}"]), {"Inference-Header-Content-Length": "999"}),
    ("binary junk", json_request(["{}"]) + b"\x00\xff", {"Inference-Header-Content-Length": "80"}),
    ("gzip", b"\x1f\x8b\x08\x00", {"Content-Encoding": "gzip"}),
    # A binary tensor's shape is checked against its bytes before anything is allocated.
    ("binary shape 10**20", *binary_request("100000000000000000000")),
    ("binary shape 10**12", *binary_request("1000000000000")),
    ("binary shape one over", *binary_request("3")),
]


@pytest.mark.parametrize(("body", "headers"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])  # fmt: skip
def test_malformed_input_is_4xx_never_500(
    server: InferenceServer, body: bytes, headers: dict[str, str]
) -> None:
    code, reply, _ = request(server, f"{MODEL}/infer", body, headers)
    assert code in (400, 413, 415), reply
    assert json.loads(reply)["error"]


def test_binary_request_by_hand(server: InferenceServer) -> None:
    tensor = encode_bytes_tensor(RECORDS)
    head = json.dumps({
        "inputs": [{"name": "records", "datatype": "BYTES", "shape": [2],
                    "parameters": {"binary_data_size": len(tensor)}}],
        "outputs": [{"name": "click", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    code, body, headers = request(
        server, f"{MODEL}/infer", head + tensor,
        {"Inference-Header-Content-Length": str(len(head))},
    )  # fmt: skip
    assert code == 200
    assert headers["content-type"] == "application/octet-stream"
    split = int(headers["inference-header-content-length"])
    assert json.loads(body[:split])["outputs"][0]["parameters"] == {"binary_data_size": 8}
    np.testing.assert_array_equal(np.frombuffer(body[split:], "<f4"), expected_click(RECORDS))


def test_plain_and_streamed_infer_requests_answer_alike(
    server: InferenceServer, ranker: FakeRanker
) -> None:
    """A request with a Content-Length is answered on the socket (``serving.wire``), a
    chunked one by tornado's handler: the same bodies get the same answers."""
    tensor = encode_bytes_tensor(RECORDS)
    head = json.dumps({
        "inputs": [{"name": "records", "datatype": "BYTES", "shape": [2],
                    "parameters": {"binary_data_size": len(tensor)}}],
    }).encode()  # fmt: skip
    cases: list[tuple[bytes, dict[str, str], int]] = [
        (head + tensor, {"Inference-Header-Content-Length": str(len(head))}, 200),
        (json_request([r.decode() for r in RECORDS]), {}, 200),
        (json_request(['{"user": 1}', "not json"]), {}, 400),
        (json_request(['{"user": "boom"}']), {}, 500),
        (b'{"inputs": 7}', {}, 400),
        (head + tensor, {"Inference-Header-Content-Length": "x"}, 400),
    ]
    assert server.url is not None
    address = server.url.removeprefix("http://")
    # A chunked request hands its connection to tornado for good: one connection each.
    plain, streamed = (http.client.HTTPConnection(address, timeout=10) for _ in range(2))
    seen = []
    try:
        for body, headers, status in cases:
            answers = []
            for conn, chunked in ((plain, False), (streamed, True)):
                payload: Any = iter([body[:5], body[5:]]) if chunked else body
                conn.request("POST", f"{MODEL}/infer", payload, headers, encode_chunked=chunked)
                reply = conn.getresponse()
                got = {k.lower(): v for k, v in reply.getheaders()}
                # Tornado's handlers name it; the socket's answers do not.
                assert ("server" in got) is chunked
                answers.append((
                    reply.status, reply.read(), got.get("content-type"),
                    got.get("inference-header-content-length"), "date" in got,
                ))  # fmt: skip
            assert answers[0] == answers[1]
            assert answers[0][0] == status
            seen.append(answers[0][1])
        ranker.is_ready = False
        for conn in (plain, streamed):
            conn.request("POST", f"{MODEL}/infer", json_request(['{"user": 1}']))
            reply = conn.getresponse()
            assert (reply.status, json.loads(reply.read())["error"]) == (
                503,
                'model "ranker" is not ready (parameters loading or catching up); retry',
            )
    finally:
        ranker.is_ready = True
        plain.close()
        streamed.close()
    outputs = {o["name"]: o["data"] for o in json.loads(seen[1])["outputs"]}
    np.testing.assert_allclose(outputs["click"], expected_click(RECORDS), rtol=1e-6)


# --- the connection -------------------------------------------------------------------


def plain_request(body: bytes, extra: bytes = b"") -> bytes:
    """An infer request's bytes as a client writes them."""
    return (
        b"POST %s/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n"
        % (MODEL.encode(), len(body), extra)
        + body
    )


def read_answer(stream: Any) -> tuple[int, dict[str, str], bytes]:
    """One answer off a connection's read stream: status, lower-cased headers, body."""
    status = int(stream.readline().split()[1])
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, stream.read(int(headers.get("content-length", "0")))


def clicks(body: bytes) -> list[float]:
    return list(next(o["data"] for o in json.loads(body)["outputs"] if o["name"] == "click"))


def test_pipelined_requests_are_answered_in_order_across_the_hand_over(
    server: InferenceServer,
) -> None:
    """Requests written in one go, plain ones and others mixed, answered in order: the
    plain ones on the socket until the first other one hands the connection (and the
    bytes read after it) to tornado."""
    one, two = json_request([RECORDS[0].decode()]), json_request([r.decode() for r in RECORDS])
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        sock.sendall(
            plain_request(one) + plain_request(two)
            + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" + plain_request(two)
        )  # fmt: skip
        answers = [read_answer(stream) for _ in range(4)]
        assert [a[0] for a in answers] == [200, 200, 200, 200]
        assert ["server" in a[1] for a in answers] == [False, False, True, True]
        assert answers[2][2] == b'{"live":true}'
        assert clicks(answers[0][2]) == pytest.approx(expected_click(RECORDS[:1]).tolist())
        assert clicks(answers[1][2]) == clicks(answers[3][2])
        assert clicks(answers[1][2]) == pytest.approx(expected_click(RECORDS).tolist())
        # The handed-over connection goes on serving.
        sock.sendall(plain_request(one))
        assert read_answer(stream)[0] == 200


def test_a_client_that_writes_ahead_without_reading_gets_every_answer(
    server: InferenceServer,
) -> None:
    """Thousands of requests written before any answer is read: the server stops reading
    while its answers wait, and every one arrives in order."""
    bodies = [json_request([json.dumps({"user": i, "pad": "x" * (i % 50)})]) for i in range(3000)]
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        stream = sock.makefile("rb")
        sock.sendall(b"".join(plain_request(b) for b in bodies))
        for body in bodies:
            status, _, answer = read_answer(stream)
            record = json.loads(body)["inputs"][0]["data"][0].encode()
            assert (status, clicks(answer)) == (200, pytest.approx(expected_click([record])))


def test_a_request_dribbled_a_few_bytes_at_a_time_is_answered(server: InferenceServer) -> None:
    data = plain_request(json_request([r.decode() for r in RECORDS]))
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = sock.makefile("rb")
        for at in range(0, len(data), 7):
            sock.sendall(data[at : at + 7])
        status, headers, body = read_answer(stream)
        assert (status, "server" in headers) == (200, False)
        assert clicks(body) == pytest.approx(expected_click(RECORDS).tolist())


def test_connection_close_and_a_half_closed_client_get_their_answer(
    server: InferenceServer,
) -> None:
    one = json_request([RECORDS[0].decode()])
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        sock.sendall(plain_request(one, b"Connection: close\r\n") + plain_request(one))
        status, headers, _ = read_answer(stream)
        assert (status, headers["connection"]) == (200, "close")
        assert stream.read() == b""  # closed: the request behind it is not answered
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        sock.sendall(plain_request(one))
        sock.shutdown(socket.SHUT_WR)
        assert read_answer(stream)[0] == 200
        assert stream.read() == b""
    # Half-closed inside a request: the rest will never come, and the server closes.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(plain_request(one)[:-5])
        sock.shutdown(socket.SHUT_WR)
        assert sock.makefile("rb").read() == b""


def test_stop_closes_connections_plain_and_handed_over() -> None:
    ranker = FakeRanker()
    with InferenceServer(ranker) as running:
        assert running.port is not None
        socks = [socket.create_connection(("127.0.0.1", running.port), timeout=10) for _ in "ab"]
        streams = [s.makefile("rb") for s in socks]
        socks[0].sendall(plain_request(json_request([RECORDS[0].decode()])))
        socks[1].sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [read_answer(s)[0] for s in streams] == [200, 200]
    try:
        assert [s.read() for s in streams] == [b"", b""]
    finally:
        for s in socks:
            s.close()


# --- limits and the token -----------------------------------------------------------------


def test_oversized_request_is_413(server: InferenceServer, client: Any) -> None:
    limit = 1 << 20
    # tritonclient sends the whole body, then reads the answer.
    big = records_input([b'{"user": "' + b"x" * (limit + 10) + b'"}'], binary=True)
    status, message = raise_status(client.infer, "ranker", [big])
    assert status == "413"
    assert message.endswith(
        f"bytes (Content-Length) is over this server's limit of {limit} bytes "
        "(max_request_bytes); send fewer records per request"
    )
    # http.client, 3 MiB; the connection still serves the next request.
    assert server.port is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", f"{MODEL}/infer", body=b"y" * (3 << 20))
        reply = conn.getresponse()
        assert reply.status == 413
        assert json.loads(reply.read())["error"].startswith("request body of 3145728 bytes")
        conn.request("GET", "/v2/health/live")
        assert conn.getresponse().read() == b'{"live":true}'
        # Chunked, so no Content-Length: counted as it arrives.
        chunks = iter([b"z" * (256 << 10)] * 6)
        conn.request("POST", f"{MODEL}/infer", body=chunks, encode_chunked=True)
        reply = conn.getresponse()
        assert reply.status == 413
        assert json.loads(reply.read())["error"].startswith("request body over this server's")
    finally:
        conn.close()


@pytest.mark.parametrize("expect", [b"", b"Expect: 100-continue\r\n"])
def test_413_is_sent_from_the_headers_before_the_body(
    server: InferenceServer, expect: bytes
) -> None:
    # The client claims a gigabyte and sends 64 KiB of it: the answer comes anyway.
    assert server.port is not None
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Length: 1000000000\r\n" + expect + b"\r\n"
        )
        if not expect:
            sock.sendall(b"z" * (64 << 10))
        reply = sock.recv(1 << 16)
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"100 (Continue)" not in reply
    assert reply.endswith(
        b'limit of 1048576 bytes (max_request_bytes); send fewer records per request"}'
    )


def test_token(ranker: FakeRanker) -> None:
    with InferenceServer(ranker, token=TOKEN) as server:
        anonymous = triton(server)
        wrong = {"Authorization": "Bearer nope"}
        right = {"Authorization": f"Bearer {TOKEN}"}
        try:
            # The probes' and the scraper's endpoints are public.
            assert anonymous.is_server_live()
            assert anonymous.is_server_ready()
            expected = (
                "401",
                'missing or wrong bearer token: send the header "Authorization: Bearer <token>"',
            )
            assert raise_status(anonymous.get_server_metadata) == expected
            assert raise_status(anonymous.get_model_metadata, "ranker", headers=wrong) == expected
            assert (
                raise_status(anonymous.infer, "ranker", [records_input(RECORDS, binary=True)])
                == expected
            )
            assert raise_status(anonymous.infer, "nope", [records_input(RECORDS, binary=False)],
                                headers=wrong) == expected  # fmt: skip
            assert anonymous.is_server_ready(headers=right)
            assert anonymous.get_model_metadata("ranker", headers=right)["name"] == "ranker"
            result = anonymous.infer("ranker", [records_input(RECORDS, binary=True)], headers=right)
            np.testing.assert_array_equal(result.as_numpy("click"), expected_click(RECORDS))
        finally:
            anonymous.close()
        code, body, _ = request(server, "/metrics")
        assert code == 200
        assert b'streamrec_serve_requests_total{code="401",endpoint="infer"} 2.0' in body


def test_metrics_count_requests(ranker: FakeRanker) -> None:
    with InferenceServer(ranker) as server:
        c = triton(server)
        try:
            for _ in range(3):
                c.infer("ranker", [records_input(RECORDS, binary=False)])
            raise_status(c.infer, "ranker", [records_input([b"[]", b"x"], binary=False)])
            raise_status(c.infer, "nope", [records_input(RECORDS, binary=False)])
            c.is_server_live()
        finally:
            c.close()
        code, body, headers = request(server, "/metrics")
    assert code == 200
    assert headers["content-type"].startswith("text/plain")
    text = body.decode()
    for line in [
        'streamrec_serve_requests_total{code="200",endpoint="infer"} 3.0',
        'streamrec_serve_requests_total{code="400",endpoint="infer"} 1.0',
        'streamrec_serve_requests_total{code="404",endpoint="infer"} 1.0',
        'streamrec_serve_requests_total{code="200",endpoint="health_live"} 1.0',
        "streamrec_serve_records_scored_total 6.0",
        "streamrec_serve_infer_latency_seconds_count 5.0",
        'streamrec_serve_infer_latency_seconds_bucket{le="0.005"}',
        'streamrec_serve_errors_total{reason="bad_records"} 1.0',
        'streamrec_serve_errors_total{reason="unknown_model"} 1.0',
        'streamrec_serve_bad_records_total{reason="not_object"} 1.0',
        'streamrec_serve_bad_records_total{reason="not_json"} 1.0',
    ]:
        assert line in text, line


def test_servers_have_their_own_registries_and_stop_closes_the_port(ranker: FakeRanker) -> None:
    first, second = InferenceServer(ranker), InferenceServer(ranker)
    url = first.start()
    second.start()
    try:
        assert url == f"http://127.0.0.1:{first.port}"
        assert first.metrics.registry is not second.metrics.registry
        assert request(first, "/v2/health/live")[0] == 200
        with pytest.raises(RuntimeError, match="already started"):
            first.start()
    finally:
        first.stop()
        second.stop()
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", first.port or 0), 1),
    ):
        pass
    first.stop()  # a second stop() does nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "port: expected 0 (a free port) to 65535, got 70000"),
        ({"token": " "}, "token: empty; give None to serve without a token"),
        ({"max_request_bytes": 0}, "max_request_bytes: expected a positive byte count, got 0"),
    ],
)
def test_constructor_checks(ranker: FakeRanker, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        InferenceServer(ranker, **kwargs)


class Unavailable(FakeRanker):
    def predict(self, records: Sequence[bytes]) -> Prediction:
        raise ModelUnavailable("the rows' replicas do not answer")


def test_a_model_that_cannot_answer_now_gets_503_and_the_server_goes_on() -> None:
    with InferenceServer(Unavailable()) as server:
        c = triton(server)
        try:
            status, message = raise_status(
                c.infer, "ranker", [records_input(RECORDS, binary=False)]
            )
            assert status == "503"
            assert "the rows' replicas do not answer" in message
            assert c.is_server_live()
        finally:
            c.close()
        code, body, _ = request(server, "/metrics")
        assert code == 200
        assert b'streamrec_serve_errors_total{reason="unavailable"} 1.0' in body
