"""The gRPC front end on 127.0.0.1 around a real HTTP server, and real clients:
tritonclient.grpc, and the committed stubs on a plain channel (for what tritonclient
cannot send: records in contents.bytes_contents, malformed messages)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as tritonclient_grpc
import tritonclient.grpc.service_pb2 as triton_pb
import tritonclient.utils as tritonclient_utils
from google.protobuf.descriptor import Descriptor

from serving.grpc_service import GrpcInferenceServer, OipServicer
from serving.http import InferenceServer
from serving.oip import encode_bytes_tensor
from serving.proto import grpc_predict_v2_pb2 as pb
from serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from serving.types import BadRecords, Deadline, ModelUnavailable, Prediction, RecordError

InferenceServerException = tritonclient_utils.InferenceServerException

TOKEN = "s3cret-token"
VERSIONS = {"dense_version": 11, "sparse_version": 12}
RECORDS = [b'{"user": 1}', b'{"user": 22, "items": [1, 2, 3]}']


class Ranker:
    """click = sigmoid(len(record) / 100), like = 1 - click; records are JSON objects with
    a "user" ("boom": the model fails, "gone": its rows cannot be read); {"sleep": s}
    sleeps s seconds, then checks the deadline (as a model does between its stages)."""

    name = "ranker"
    heads = ("click", "like")

    def __init__(self) -> None:
        self.is_ready = True
        self.timeouts: list[float | None] = []  # each call's deadline, in seconds
        self.started = threading.Event()

    def ready(self) -> bool:
        return self.is_ready

    def metadata(self) -> Mapping[str, object]:
        return {"version": "3", **VERSIONS}

    def predict(self, records: Sequence[bytes], *, deadline: Deadline | None = None) -> Prediction:
        self.timeouts.append(None if deadline is None else deadline.timeout_s)
        self.started.set()
        errors: list[RecordError] = []
        for i, record in enumerate(records):
            try:
                doc = json.loads(record)
            except ValueError as e:
                errors.append(RecordError(i, None, "not_json", str(e)))
                continue
            if not isinstance(doc, dict):
                errors.append(RecordError(i, None, "not_object", f"a JSON {type(doc).__name__}"))
            elif "sleep" in doc:
                time.sleep(doc["sleep"])
                if deadline is not None:
                    deadline.check("scoring")
            elif "user" not in doc:
                errors.append(RecordError(i, "user", "missing_field", "no key user"))
            elif doc["user"] == "boom":
                msg = "the model broke"
                raise RuntimeError(msg)
            elif doc["user"] == "gone":
                msg = "no serving replica of shard 1 answers"
                raise ModelUnavailable(msg)
        if errors:
            raise BadRecords(errors)
        click = expected_click(records)
        return Prediction({"click": click, "like": 1 - click}, VERSIONS)


def expected_click(records: Sequence[bytes]) -> npt.NDArray[np.float32]:
    lengths = np.array([len(r) for r in records], np.float32)
    return (1 / (1 + np.exp(-lengths / 100))).astype(np.float32)


@pytest.fixture(scope="module")
def ranker() -> Ranker:
    return Ranker()


@pytest.fixture(scope="module")
def http(ranker: Ranker) -> Iterator[InferenceServer]:
    with InferenceServer(ranker, max_request_records=1000) as running:
        yield running


@pytest.fixture(scope="module")
def server(http: InferenceServer) -> Iterator[GrpcInferenceServer]:
    with GrpcInferenceServer(http, max_request_bytes=1 << 20) as running:
        yield running


@pytest.fixture
def client(server: GrpcInferenceServer) -> Iterator[Any]:
    assert server.address is not None
    c = tritonclient_grpc.InferenceServerClient(server.address)
    yield c
    c.close()


@pytest.fixture
def stub(server: GrpcInferenceServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    assert server.address is not None
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def records_input(records: Sequence[bytes], shape: list[int] | None = None) -> Any:
    shape = shape or [len(records)]
    tensor = tritonclient_grpc.InferInput("records", shape, "BYTES")
    tensor.set_data_from_numpy(np.array(records, dtype=object).reshape(shape))
    return tensor


def infer(client: Any, records: Sequence[bytes], **kwargs: Any) -> Any:
    return client.infer("ranker", [records_input(records)], client_timeout=30, **kwargs)


def refused(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """The status and message of a call that must fail."""
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    return info.value.status(), info.value.message()


def contents_request(records: Sequence[bytes], **fields: Any) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="records",
        datatype="BYTES",
        shape=[len(records)],
        contents=pb.InferTensorContents(bytes_contents=list(records)),
    )
    return pb.ModelInferRequest(model_name="ranker", inputs=[tensor], **fields)


def rpc_error(call: Any, request: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30, **kwargs)
    return info.value


# --- the stubs -----------------------------------------------------------------------------


def _fields(descriptor: Descriptor) -> dict[str, tuple[int, int, str]]:
    return {
        f.name: (f.number, f.type, f.message_type.name if f.message_type else "")
        for f in descriptor.fields
    }


def _same_messages(ours: Descriptor, theirs: Descriptor) -> None:
    assert _fields(ours) == _fields(theirs), ours.full_name
    for nested in ours.nested_types:
        _same_messages(nested, theirs.nested_types_by_name[nested.name])


def test_the_messages_are_tritons_and_load_beside_its_own() -> None:
    # Both modules are imported in this process: each in a descriptor pool of its own.
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        _same_messages(message, triton_pb.DESCRIPTOR.message_types_by_name[name])
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name,
            other.output_type.full_name,
        )
    request = contents_request(RECORDS, id="r1")
    request.parameters["timeout"].int64_param = 5
    parsed = triton_pb.ModelInferRequest.FromString(request.SerializeToString())
    assert list(parsed.inputs[0].contents.bytes_contents) == RECORDS
    assert parsed.parameters["timeout"].int64_param == 5


# --- health and metadata -------------------------------------------------------------------


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("ranker")
    assert client.is_model_ready("ranker", "3")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "streamrec"
    assert meta["extensions"] == ["binary_tensor_data"]
    assert meta["version"]
    model = client.get_model_metadata("ranker", as_json=True)
    assert model["name"] == "ranker"
    assert model["versions"] == ["3"]
    assert model["platform"] == "streamrec"
    assert model["inputs"] == [{"name": "records", "datatype": "BYTES", "shape": ["-1"]}]
    assert [o["name"] for o in model["outputs"]] == ["click", "like"]
    assert {o["datatype"] for o in model["outputs"]} == {"FP32"}


def test_a_model_not_ready_is_unavailable(client: Any, ranker: Ranker) -> None:
    ranker.is_ready = False
    try:
        assert not client.is_server_ready()
        assert not client.is_model_ready("ranker")
        status, message = refused(infer, client, RECORDS)
    finally:
        ranker.is_ready = True
    assert status == "StatusCode.UNAVAILABLE"
    assert message == 'model "ranker" is not ready (parameters loading or catching up); retry'
    assert infer(client, RECORDS).as_numpy("click") is not None


def test_an_unknown_model_or_version_is_not_found(client: Any) -> None:
    status, message = refused(infer, client, RECORDS, model_version="9")
    assert status == "StatusCode.NOT_FOUND"
    assert message == 'model "ranker" has no version "9"; it serves version "3"'
    status, message = refused(client.infer, "nope", [records_input(RECORDS)])
    assert status == "StatusCode.NOT_FOUND"
    assert message == 'unknown model "nope"; this server serves "ranker"'
    assert refused(client.is_model_ready, "nope")[0] == "StatusCode.NOT_FOUND"
    assert refused(client.get_model_metadata, "ranker", "4")[0] == "StatusCode.NOT_FOUND"
    reply = infer(client, RECORDS, model_version="3")
    assert reply.get_response().model_version == "3"


# --- infer ---------------------------------------------------------------------------------


def test_infer_raw_records(client: Any) -> None:
    reply = infer(client, RECORDS, request_id="r-7")
    click = expected_click(RECORDS)
    np.testing.assert_array_equal(reply.as_numpy("click"), click)
    np.testing.assert_array_equal(reply.as_numpy("like"), 1 - click)
    response = reply.get_response()
    assert (response.model_name, response.model_version, response.id) == ("ranker", "3", "r-7")
    assert response.parameters["dense_version"].int64_param == 11
    assert [o.datatype for o in response.outputs] == ["FP32", "FP32"]


def test_infer_records_of_shape_n_by_1(client: Any) -> None:
    tensor = records_input(RECORDS, shape=[2, 1])
    reply = client.infer("ranker", [tensor], client_timeout=30)
    np.testing.assert_array_equal(reply.as_numpy("click"), expected_click(RECORDS))


def test_infer_records_in_contents(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    reply = stub.ModelInfer(contents_request(RECORDS), timeout=30)
    assert [o.name for o in reply.outputs] == ["click", "like"]
    click = np.frombuffer(reply.raw_output_contents[0], "<f4")
    np.testing.assert_array_equal(click, expected_click(RECORDS))


def test_requested_outputs(client: Any) -> None:
    wanted = [tritonclient_grpc.InferRequestedOutput("like")]
    reply = infer(client, RECORDS, outputs=wanted)
    assert [o.name for o in reply.get_response().outputs] == ["like"]
    np.testing.assert_array_equal(reply.as_numpy("like"), 1 - expected_click(RECORDS))
    status, message = refused(
        infer, client, RECORDS, outputs=[tritonclient_grpc.InferRequestedOutput("ctr")]
    )
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert (
        message
        == 'outputs[0].name: unknown output "ctr"; this model\'s outputs are "click", "like"'
    )
    classify = [tritonclient_grpc.InferRequestedOutput("click", class_count=2)]
    status, message = refused(infer, client, RECORDS, outputs=classify)
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(
        "outputs[0].parameters.classification: the classification extension is not supported"
    )


def test_priority_is_accepted(client: Any) -> None:
    reply = infer(client, RECORDS, priority=1)
    np.testing.assert_array_equal(reply.as_numpy("click"), expected_click(RECORDS))


# --- refusals ------------------------------------------------------------------------------


def test_bad_records_are_each_named(client: Any) -> None:
    status, message = refused(infer, client, [RECORDS[0], b"nope", b"{}"])
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith("bad record at index 1: not_json (Expecting value")
    assert 'bad record at index 2, field "user": missing_field (no key user)' in message
    assert message.endswith("2 of 3 records bad")
    assert infer(client, RECORDS).as_numpy("click") is not None


def test_many_bad_records_fit_in_a_status(client: Any) -> None:
    # Listed up to 4 KiB: a status's message travels in a trailer, limited to 8 KiB.
    status, message = refused(infer, client, [b"x"] * 900)
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith("bad record at index 0: not_json")
    assert message.endswith(" listed)")
    assert "900 of 900 records bad (the first " in message
    assert len(message) <= 4096


def test_a_model_failure_is_internal_and_logged(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="streamrec.serve"):
        status, message = refused(infer, client, [b'{"user": "boom"}'])
    assert status == "StatusCode.INTERNAL"
    assert message == 'model "ranker" failed on 1 records (RuntimeError); see the server log'
    assert "the model broke" in caplog.text
    assert "Traceback" in caplog.text
    status, message = refused(infer, client, [b'{"user": "gone"}'])
    assert status == "StatusCode.UNAVAILABLE"
    assert message == (
        'model "ranker" cannot answer now: no serving replica of shard 1 answers; retry'
    )


@pytest.mark.parametrize(
    ("name", "datatype", "data", "expected"),
    [
        (
            "features",
            "BYTES",
            np.array([b"{}"], object),
            'inputs[0].name: unknown input "features"',
        ),
        ("records", "FP32", np.array([1.5], np.float32), 'inputs[0].datatype: expected "BYTES"'),
    ],
)
def test_a_wrong_input_is_invalid(
    client: Any, name: str, datatype: str, data: Any, expected: str
) -> None:
    tensor = tritonclient_grpc.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(data)
    status, message = refused(client.infer, "ranker", [tensor])
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(expected)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ([1000], "inputs[0].shape: gives 1000 elements, but its 51 bytes of binary data"),
        ([3], "inputs[0]: binary data holds 2 elements of the 3 its shape gives"),
        ([1], "inputs[0]: binary data has 36 bytes left after the 1 elements"),
        ([2, 2], "inputs[0].shape: expected [n] or [n, 1] with n >= 1, got [2,2]"),
    ],
)
def test_a_shape_lying_about_the_bytes_is_invalid(
    client: Any, shape: list[int], expected: str
) -> None:
    tensor = records_input(RECORDS)
    tensor.set_shape(shape)
    status, message = refused(client.infer, "ranker", [tensor])
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(expected), message
    assert infer(client, RECORDS).as_numpy("click") is not None


def test_shared_memory_is_refused(client: Any) -> None:
    tensor = tritonclient_grpc.InferInput("records", [1], "BYTES")
    tensor.set_shared_memory("region", 64)
    status, message = refused(client.infer, "ranker", [tensor])
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(
        "inputs[0].parameters.shared_memory_byte_size: shared memory is not supported"
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"parameters": {"temperature": 0.5}},
            "parameters.temperature: not supported by this server (value double_param 0.5); "
            "it knows timeout, priority",
        ),
        ({"sequence_id": 4}, "parameters.sequence_end: not supported by this server"),
        (
            {"timeout": -5},
            "parameters.timeout: expected a whole number of microseconds >= 0, got int64_param -5",
        ),
    ],
)
def test_unknown_or_bad_parameters_are_invalid(
    client: Any, kwargs: dict[str, Any], expected: str
) -> None:
    status, message = refused(infer, client, RECORDS, **kwargs)
    assert status == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(expected), message


def test_malformed_messages_are_invalid(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    both = contents_request(RECORDS, raw_input_contents=[encode_bytes_tensor(RECORDS)])
    none = contents_request(RECORDS)
    none.inputs[0].ClearField("contents")
    short = contents_request(RECORDS)
    short.inputs[0].shape[0] = 3
    cases = {
        "inputs[0]: both contents.bytes_contents and raw_input_contents[0] given": both,
        "inputs[0].contents.bytes_contents: missing": none,
        "inputs[0].contents.bytes_contents: 2 elements, but shape gives n = 3": short,
        "inputs: missing": pb.ModelInferRequest(model_name="ranker"),
    }
    for expected, request in cases.items():
        error = rpc_error(stub.ModelInfer, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(error.details()).startswith(expected), error.details()


def test_too_many_records_are_resource_exhausted(client: Any) -> None:
    status, message = refused(infer, client, [b"{}"] * 1001)
    assert status == "StatusCode.RESOURCE_EXHAUSTED"
    assert "over this server's limit of 1000 per request (serving.max_request_records)" in message


def test_a_message_over_max_request_bytes_is_refused_by_grpc(client: Any) -> None:
    status, _ = refused(infer, client, [b'{"user": "' + b"x" * (1 << 20) + b'"}'])
    assert status == "StatusCode.RESOURCE_EXHAUSTED"
    assert infer(client, RECORDS).as_numpy("click") is not None


# --- deadlines -----------------------------------------------------------------------------


def test_the_timeout_parameter_is_the_requests_deadline(client: Any, ranker: Ranker) -> None:
    # tritonclient's `timeout` (microseconds) is the request parameter; `client_timeout`
    # (seconds) the call's own deadline.
    status, message = refused(infer, client, [b'{"sleep": 0.3}'], timeout=100_000)
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    assert message.startswith("request timed out after 0.1s while scoring")
    assert ranker.timeouts[-1] == pytest.approx(0.1)
    assert infer(client, RECORDS).as_numpy("click") is not None


def test_the_calls_deadline_is_passed_on(client: Any, ranker: Ranker) -> None:
    client.infer("ranker", [records_input(RECORDS)], client_timeout=5)
    timeout = ranker.timeouts[-1]
    assert timeout is not None
    assert 4 < timeout <= 5.1  # grpc-timeout travels rounded up
    infer(client, RECORDS, timeout=2_000_000)  # the shorter of the two
    assert ranker.timeouts[-1] == pytest.approx(2)
    status, _ = refused(
        client.infer, "ranker", [records_input([b'{"sleep": 0.5}'])], client_timeout=0.1
    )
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    assert infer(client, RECORDS).as_numpy("click") is not None


# --- tokens, limits, the server's life -----------------------------------------------------


def test_a_token_is_needed_but_not_by_the_probes(http: InferenceServer) -> None:
    with GrpcInferenceServer(http, token=TOKEN) as guarded:
        c = tritonclient_grpc.InferenceServerClient(guarded.address)
        try:
            assert c.is_server_live()
            assert c.is_server_ready()
            for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                status, message = refused(
                    c.infer, "ranker", [records_input(RECORDS)], headers=headers
                )
                assert status == "StatusCode.UNAUTHENTICATED"
                assert message.startswith("missing or wrong bearer token")
                assert refused(c.get_server_metadata, headers=headers)[0] == status
            good = {"authorization": f"Bearer {TOKEN}"}
            reply = c.infer("ranker", [records_input(RECORDS)], headers=good)
            np.testing.assert_array_equal(reply.as_numpy("click"), expected_click(RECORDS))
            assert c.is_model_ready("ranker", headers=good)
        finally:
            c.close()


def test_calls_past_max_concurrent_rpcs_are_refused(http: InferenceServer, ranker: Ranker) -> None:
    with GrpcInferenceServer(http, max_concurrent_rpcs=1) as capped:
        c = tritonclient_grpc.InferenceServerClient(capped.address)
        try:
            done: list[Any] = []
            ranker.started.clear()
            c.async_infer(
                "ranker",
                [records_input([b'{"sleep": 0.5}'])],
                lambda result, error: done.append((result, error)),
            )
            assert ranker.started.wait(10)
            status, message = refused(c.infer, "ranker", [records_input(RECORDS)])
            assert status == "StatusCode.RESOURCE_EXHAUSTED"
            assert "Concurrent RPC limit exceeded" in message
            deadline = time.monotonic() + 10
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
            assert done
            assert done[0][1] is None
        finally:
            c.close()


def test_a_stopped_http_server_is_unavailable(ranker: Ranker) -> None:
    stopped = InferenceServer(ranker)
    with GrpcInferenceServer(stopped) as front:
        c = tritonclient_grpc.InferenceServerClient(front.address)
        try:
            status, message = refused(c.infer, "ranker", [records_input(RECORDS)])
        finally:
            c.close()
    assert status == "StatusCode.UNAVAILABLE"
    assert message == 'model "ranker" is not served now (InferenceServer: not started); retry'


def test_calls_are_counted(client: Any, http: InferenceServer) -> None:
    infer(client, RECORDS)
    refused(infer, client, [b"nope"])
    text = http.metrics.exposition().decode()
    assert 'streamrec_serve_requests_total{code="200",endpoint="grpc_infer"}' in text
    assert 'streamrec_serve_requests_total{code="400",endpoint="grpc_infer"}' in text
    assert 'streamrec_serve_errors_total{reason="bad_records"}' in text
    assert 'streamrec_serve_bad_records_total{reason="not_json"}' in text


def test_start_stop_and_arguments(http: InferenceServer) -> None:
    front = GrpcInferenceServer(http)
    address = front.start()
    with pytest.raises(RuntimeError, match=re.escape(f"already started at {address}")):
        front.start()
    with pytest.raises(OSError, match=re.escape(f"could not listen on {address}")):
        GrpcInferenceServer(http, port=int(address.rsplit(":", 1)[1])).start()
    front.stop()
    front.stop()  # twice is harmless
    assert isinstance(front.servicer, OipServicer)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"port": 70000}, "port: expected 0 (a free port) to 65535, got 70000"),
        ({"max_request_bytes": 0}, "max_request_bytes: expected a positive byte count, got 0"),
        ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs: expected a positive call count, got 0"),
        ({"grace_s": -1.0}, "grace_s: expected seconds >= 0, got -1.0"),
        ({"token": " "}, "token: empty; give None to serve without a token"),
    ],
)
def test_arguments_are_checked(
    http: InferenceServer, kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        GrpcInferenceServer(http, **kwargs)


def test_stop_cancels_the_calls_still_waiting(http: InferenceServer, ranker: Ranker) -> None:
    front = GrpcInferenceServer(http, grace_s=0.1)
    c = tritonclient_grpc.InferenceServerClient(front.start())
    try:
        done: list[Any] = []
        ranker.started.clear()
        c.async_infer(
            "ranker",
            [records_input([b'{"sleep": 0.8}'])],
            lambda result, error: done.append((result, error)),
        )
        assert ranker.started.wait(10)
        start = time.monotonic()
        front.stop()
        assert time.monotonic() - start < 0.6  # the grace, not the model's 0.8 s
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done
        assert done[0][1].status() in ("StatusCode.CANCELLED", "StatusCode.UNAVAILABLE")
    finally:
        c.close()
    with GrpcInferenceServer(http) as again:
        c = tritonclient_grpc.InferenceServerClient(again.address)
        try:
            assert infer(c, RECORDS).as_numpy("click") is not None
        finally:
            c.close()


class Broken(Ranker):
    name = "broken"

    def metadata(self) -> Mapping[str, object]:
        msg = "the secret path /etc/model"
        raise OSError(msg)


def test_an_error_outside_scoring_is_internal_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with GrpcInferenceServer(InferenceServer(Broken())) as front:
        c = tritonclient_grpc.InferenceServerClient(front.address)
        try:
            with caplog.at_level(logging.ERROR, logger="streamrec.serve"):
                status, message = refused(c.get_model_metadata, "broken")
            assert c.is_server_live()
        finally:
            c.close()
    assert status == "StatusCode.INTERNAL"
    assert message == "internal error answering ModelMetadata; see the server log"
    assert "the secret path /etc/model" in caplog.text
