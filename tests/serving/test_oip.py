"""The pure Open Inference Protocol functions: parsing, every refusal, responses, metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from connectors.codecs.joined import JoinedPayloads
from serving import oip
from serving.types import (
    BadRecords,
    InferRequest,
    OipError,
    Prediction,
    RecordError,
    RequestedOutput,
)

HEADS = ("click", "like")
ROOT = Path(__file__).resolve().parents[2]


def records_input(**overrides: Any) -> dict[str, Any]:
    tensor: dict[str, Any] = {
        "name": "records",
        "datatype": "BYTES",
        "shape": [2],
        "data": ['{"user": 1}', '{"user": 2}'],
    }
    tensor.update(overrides)
    return {k: v for k, v in tensor.items() if v is not ...}


def body(**doc: Any) -> bytes:
    doc.setdefault("inputs", [records_input()])
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def refusal(raw: bytes, header_length: str | None = None) -> OipError:
    with pytest.raises(OipError) as info:
        oip.parse_infer_request(raw, HEADS, header_length)
    assert info.value.status == 400
    assert str(info.value) == info.value.message
    return info.value


def binary_request(items: list[bytes], size: int | None = None, **tensor: Any) -> tuple[bytes, str]:
    raw = oip.encode_bytes_tensor(items)
    params = {"binary_data_size": len(raw) if size is None else size}
    head = body(inputs=[records_input(shape=[len(items)], data=..., parameters=params, **tensor)])
    return head + raw, str(len(head))


# --- accepted requests ---------------------------------------------------------------------


def test_parses_id_records_and_defaults() -> None:
    req = oip.parse_infer_request(body(id="req-7"), HEADS)
    assert req == InferRequest("req-7", [b'{"user": 1}', b'{"user": 2}'], None, False)


def test_records_are_utf8_bytes_of_the_strings() -> None:
    req = oip.parse_infer_request(body(inputs=[records_input(shape=[1], data=["é€😀"])]), HEADS)
    assert req.records == ["é€😀".encode()]


def test_shape_n_by_1_flat_or_nested() -> None:
    flat = oip.parse_infer_request(body(inputs=[records_input(shape=[2, 1])]), HEADS)
    nested = body(inputs=[records_input(shape=[2, 1], data=[["{}"], ["[]"]])])
    assert flat.records == [b'{"user": 1}', b'{"user": 2}']
    assert oip.parse_infer_request(nested, HEADS).records == [b"{}", b"[]"]


def test_requested_outputs_and_binary_flags() -> None:
    raw = body(
        parameters={"binary_data_output": True},
        outputs=[{"name": "like"}, {"name": "click", "parameters": {"binary_data": False}}],
    )
    req = oip.parse_infer_request(raw, HEADS)
    assert req.binary_output is True
    assert req.outputs == (RequestedOutput("like", True), RequestedOutput("click", False))
    assert oip.parse_infer_request(body(outputs=[]), HEADS).outputs is None


def test_binary_input_round_trip() -> None:
    raw, header = binary_request([b'{"user": 1}', b"", b"\xff\x00 raw"])
    req = oip.parse_infer_request(raw, HEADS, header)
    assert list(req.records) == [b'{"user": 1}', b"", b"\xff\x00 raw"]
    assert [req.records[i] for i in (-1, 0)] == [b"\xff\x00 raw", b'{"user": 1}']
    assert isinstance(req.records, JoinedPayloads)
    assert not req.records.utf8
    raw, header = binary_request([b'{"u": "\xc3\xa9"}', b"{}"])
    utf8 = oip.parse_infer_request(raw, HEADS, header)
    assert isinstance(utf8.records, JoinedPayloads)
    assert utf8.records.utf8


def test_header_length_equal_to_body_means_json_only() -> None:
    raw = body()
    assert oip.parse_infer_request(raw, HEADS, str(len(raw))).records[0] == b'{"user": 1}'


# --- refused requests: each message names the field and the value --------------------------

CASES: list[tuple[str, bytes, str]] = [
    ("not json", b"{nope", "request body: not valid JSON"),
    (
        "not utf-8",
        b'{"inputs": "\xff\xfe"}',
        "request body: not UTF-8 (invalid start byte at byte 12)",
    ),
    ("empty", b"", "request body: not valid JSON"),
    ("deep nesting", b"[" * 100_000, "request body: not valid JSON"),
    ("huge integer", b'{"id": ' + b"9" * 5000 + b"}", "request body: not valid JSON"),
    ("array", b"[1, 2]", 'request body: expected a JSON object {"inputs": [...]}, got array'),
    ("unknown key", body(input=[]), 'request body: unknown key "input"; expected some of "id"'),
    ("id type", body(id=5), "id: expected a string, got 5"),
    ("parameters type", body(parameters=[1]), "parameters: expected an object, got array [1]"),
    (
        "binary_data_output type",
        body(parameters={"binary_data_output": "yes"}),
        'parameters.binary_data_output: expected true or false, got "yes"',
    ),
    (
        "unknown parameter",
        body(parameters={"sequence_id": 3}),
        "parameters.sequence_id: not supported by this server (value 3); it knows "
        "binary_data_output, timeout, priority",
    ),
    (
        "negative timeout",
        body(parameters={"timeout": -1}),
        "parameters.timeout: expected a whole number of microseconds >= 0, got -1",
    ),
    (
        "priority not a number",
        body(parameters={"priority": "high"}),
        "parameters.priority: expected a whole number (1 the highest, 0 the default) >= 0, "
        'got "high"',
    ),
    ("no inputs", body(inputs=...), 'inputs: missing; send [{"name": "records"'),
    ("inputs empty", body(inputs=[]), "inputs: expected a list holding"),
    ("inputs type", body(inputs={"name": "records"}), 'got {"name":"records"}'),
    ("input type", body(inputs=["records"]), 'inputs[0]: expected an object {"name": "records"'),
    ("input name missing", body(inputs=[records_input(name=...)]), "inputs[0].name: missing"),
    (
        "input name type",
        body(inputs=[records_input(name=3)]),
        "inputs[0].name: expected a string, got 3",
    ),
    (
        "unknown input",
        body(inputs=[records_input(), records_input(name="dense")]),
        'inputs[1].name: unknown input "dense"; this model takes one input, "records"',
    ),
    (
        "records twice",
        body(inputs=[records_input(), records_input()]),
        'inputs[1].name: input "records" given twice (also inputs[0])',
    ),
    (
        "unknown input key",
        body(inputs=[records_input(dtype="x")]),
        'inputs[0]: unknown key "dtype"',
    ),
    (
        "datatype",
        body(inputs=[records_input(datatype="FP32")]),
        'inputs[0].datatype: expected "BYTES", got "FP32"',
    ),
    ("datatype missing", body(inputs=[records_input(datatype=...)]), 'expected "BYTES", missing'),
    ("shape missing", body(inputs=[records_input(shape=...)]), "inputs[0].shape: missing"),
    (
        "shape 2-d",
        body(inputs=[records_input(shape=[2, 3])]),
        "inputs[0].shape: expected [n] or [n, 1] with n >= 1, got [2,3]",
    ),
    ("shape zero", body(inputs=[records_input(shape=[0])]), "got [0]"),
    ("shape negative", body(inputs=[records_input(shape=[-1])]), "got [-1]"),
    ("shape float", body(inputs=[records_input(shape=[2.0])]), "got [2.0]"),
    ("shape bool", body(inputs=[records_input(shape=[True])]), "got [true]"),
    ("shape string", body(inputs=[records_input(shape="2")]), 'got "2"'),
    ("shape 3-d", body(inputs=[records_input(shape=[2, 1, 1])]), "got [2,1,1]"),
    (
        "huge shape",
        body(inputs=[records_input(shape=[10**12])]),
        "inputs[0].data: 2 elements, but shape gives n = 1000000000000",
    ),
    ("long shape", body(inputs=[records_input(shape=[1] * 10_000)]), "(10000 elements)]"),
    (
        "data missing",
        body(inputs=[records_input(data=...)]),
        "inputs[0].data: missing; expected a list of 2 strings",
    ),
    (
        "data type",
        body(inputs=[records_input(data="{}")]),
        'inputs[0].data: expected a list of 2 strings, got string "{}"',
    ),
    (
        "data short",
        body(inputs=[records_input(shape=[3])]),
        "inputs[0].data: 2 elements, but shape gives n = 3",
    ),
    (
        "element type",
        body(inputs=[records_input(data=['{"user": 1}', {"user": 2}])]),
        'inputs[0].data[1]: expected a string (one record as text), got object {"user":2}',
    ),
    (
        "element null",
        body(inputs=[records_input(data=["{}", None])]),
        "inputs[0].data[1]: expected a string (one record as text), got null",
    ),
    (
        "nested under [n]",
        body(inputs=[records_input(shape=[2], data=[["{}", "{}"], ["{}"]])]),
        'inputs[0].data[0]: expected a string (one record as text), got array ["{}","{}"]',
    ),
    (
        "lone surrogate",
        body(inputs=[records_input(shape=[1], data=["\ud800"])]),
        "inputs[0].data[0]: not encodable as UTF-8 (surrogates not allowed at character 0)",
    ),
    (
        "input parameters type",
        body(inputs=[records_input(parameters=1)]),
        "inputs[0].parameters: expected an object, got number 1",
    ),
    (
        "shared memory",
        body(inputs=[records_input(parameters={"shared_memory_region": "r0"})]),
        'inputs[0].parameters.shared_memory_region: shared memory is not supported (got "r0")',
    ),
    (
        "unknown input parameter",
        body(inputs=[records_input(parameters={"content_type": "str"})]),
        'inputs[0].parameters.content_type: not supported (value "str")',
    ),
    (
        "binary size without header",
        body(inputs=[records_input(data=..., parameters={"binary_data_size": 4})]),
        "inputs[0].parameters.binary_data_size: 4 given, but the request has no "
        "Inference-Header-Content-Length header",
    ),
    (
        "binary size type",
        body(inputs=[records_input(data=..., parameters={"binary_data_size": -4})]),
        "inputs[0].parameters.binary_data_size: expected a byte count, got -4",
    ),
    (
        "both data and binary",
        body(inputs=[records_input(parameters={"binary_data_size": 4})]),
        'inputs[0]: both "data" and parameters.binary_data_size given',
    ),
    (
        "outputs type",
        body(outputs={"name": "click"}),
        'outputs: expected a list of {"name": head} objects',
    ),
    (
        "output type",
        body(outputs=["click"]),
        'outputs[0]: expected an object {"name": head}, got "click"',
    ),
    (
        "unknown output",
        body(outputs=[{"name": "dwell"}]),
        'outputs[0].name: unknown output "dwell"; this model\'s outputs are "click", "like"',
    ),
    (
        "output name missing",
        body(outputs=[{}]),
        'outputs[0].name: missing; this model\'s outputs are "click"',
    ),
    (
        "output twice",
        body(outputs=[{"name": "like"}, {"name": "like"}]),
        'outputs[1].name: output "like" requested twice',
    ),
    (
        "output key",
        body(outputs=[{"name": "like", "shape": [1]}]),
        'outputs[0]: unknown key "shape"',
    ),
    (
        "output parameters type",
        body(outputs=[{"name": "like", "parameters": 0}]),
        "outputs[0].parameters: expected an object, got 0",
    ),
    (
        "binary_data type",
        body(outputs=[{"name": "like", "parameters": {"binary_data": 1}}]),
        "outputs[0].parameters.binary_data: expected true or false, got 1",
    ),
    (
        "classification",
        body(outputs=[{"name": "like", "parameters": {"classification": 2}}]),
        "outputs[0].parameters.classification: not supported (value 2)",
    ),
]


@pytest.mark.processes
def test_refusals_do_not_depend_on_other_json_libraries(tmp_path: Path) -> None:
    # An "orjson" that refuses everything, importable: the protocol's JSON must not
    # change with what else is installed (orjson's messages named neither the byte of a
    # body that is not UTF-8 nor the record with a lone surrogate).
    (tmp_path / "orjson.py").write_text(
        "def loads(data):\n    raise ValueError('strict')\n"
        "def dumps(obj):\n    raise TypeError('strict')\n"
    )
    good, not_utf8 = body(), b'{"inputs": "\xff\xfe"}'
    script = (
        "from serving import oip\n"
        f"req = oip.parse_infer_request({good!r}, ('click',))\n"
        "print(req.records)\n"
        "try:\n"
        f"    oip.parse_infer_request({not_utf8!r}, ('click',))\n"
        "except oip.OipError as e:\n"
        "    print(e.message)\n"
        "print(oip.error_body('x').decode())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "[b'{\"user\": 1}', b'{\"user\": 2}']"
    assert out[1].startswith("request body: not UTF-8 (invalid start byte at byte 12)")
    assert out[2] == '{"error":"x"}'


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusal_names_field_and_value(raw: bytes, expected: str) -> None:
    assert expected in refusal(raw).message


def test_error_reasons_for_the_metrics() -> None:
    assert refusal(b"{").reason == "not_json"
    assert refusal(body(inputs=...)).reason == "missing_input"
    assert refusal(body(inputs=[records_input(name="x")])).reason == "unknown_input"
    assert refusal(body(outputs=[{"name": "x"}])).reason == "unknown_output"
    assert refusal(body(id=1)).reason == "invalid_request"


@pytest.mark.parametrize("header", ["abc", "-1", "1e3", "+5", "99999", ""])
def test_bad_header_length(header: str) -> None:
    message = refusal(body(), header).message
    assert message.startswith("Inference-Header-Content-Length header: expected the JSON part's")
    assert f'got "{header}"' in message


def test_binary_refusals() -> None:
    raw, header = binary_request([b"abc", b"de"], size=100)
    assert (
        "binary_data_size: 100, but 13 bytes follow the JSON part" in refusal(raw, header).message
    )
    raw, header = binary_request([b"abc", b"de"])
    truncated = raw[:-1]
    head_len = int(header)
    fixed = truncated.replace(b'"binary_data_size": 13', b'"binary_data_size": 12')
    assert (
        "binary element 1 claims 2 bytes at offset 11, but 1 remain"
        in refusal(fixed, str(head_len)).message
    )
    extra_head = body(
        inputs=[records_input(shape=[1], data=..., parameters={"binary_data_size": 11})]
    )
    extra = extra_head + oip.encode_bytes_tensor([b"abc"]) + b"\x00" * 4
    message = refusal(extra, str(len(extra_head))).message
    assert message == "inputs[0]: binary data has 4 bytes left after the 1 elements its shape gives"
    plain = body()
    message = refusal(plain + b"junk", str(len(plain))).message
    assert message == (
        "request body: 4 bytes follow the JSON part (Inference-Header-Content-Length), "
        "but no input has parameters.binary_data_size"
    )


def test_decode_bytes_tensor_refusals() -> None:
    with pytest.raises(OipError, match=r"inputs\[0\].shape: gives 2 elements, but its 5 bytes"):
        oip.decode_bytes_tensor(oip.encode_bytes_tensor([b"a"]), 2, "inputs[0]")
    # Room for two lengths, but the second is cut short.
    with pytest.raises(OipError, match=r"inputs\[0\]: binary data holds 1 elements of the 2"):
        oip.decode_bytes_tensor(oip.encode_bytes_tensor([b"abcd"]) + b"\x01\x00", 2, "inputs[0]")
    with pytest.raises(OipError, match="has 2 bytes left after the 1 elements"):
        oip.decode_bytes_tensor(oip.encode_bytes_tensor([b"a"]) + b"zz", 1, "inputs[0]")


# --- responses ---------------------------------------------------------------------------


def prediction(n: int = 2) -> Prediction:
    click = np.linspace(0.25, 0.75, n, dtype=np.float32)
    return Prediction(
        {"click": click, "like": 1 - click},
        # A model may hand over numpy scalars: they go out as JSON numbers.
        {"dense_version": 3, "sparse_version": np.int64(4), "note": "x"},  # type: ignore[dict-item]
    )


def test_json_response() -> None:
    req = InferRequest("r1", [b"{}", b"{}"])
    out = oip.infer_response("ranker", HEADS, req, prediction(), "2")
    assert out.header_length is None
    assert out.content_type == "application/json"
    assert json.loads(out.body) == {
        "model_name": "ranker",
        "model_version": "2",
        "id": "r1",
        "parameters": {"dense_version": 3, "sparse_version": 4, "note": "x"},
        "outputs": [
            {"name": "click", "datatype": "FP32", "shape": [2], "data": [0.25, 0.75]},
            {"name": "like", "datatype": "FP32", "shape": [2], "data": [0.75, 0.25]},
        ],
    }


def test_binary_response_follows_requested_order() -> None:
    req = InferRequest(
        None, [b"{}", b"{}"], (RequestedOutput("like", True), RequestedOutput("click", False))
    )
    out = oip.infer_response("ranker", HEADS, req, prediction())
    assert out.header_length is not None
    head = json.loads(out.body[: out.header_length])
    assert head["id"] == ""
    assert [o["name"] for o in head["outputs"]] == ["like", "click"]
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert "data" not in head["outputs"][0]
    assert head["outputs"][1]["data"] == [0.25, 0.75]
    raw = np.frombuffer(out.body[out.header_length :], "<f4")
    np.testing.assert_array_equal(raw, [0.75, 0.25])


def test_binary_output_default_applies_to_every_head() -> None:
    out = oip.infer_response("m", HEADS, InferRequest(None, [b"{}"], None, True), prediction(1))
    assert out.header_length is not None
    assert len(out.body) == out.header_length + 8


@pytest.mark.parametrize(
    ("probabilities", "expected"),
    [
        ({"click": np.zeros(2, np.float32)}, "returned no probabilities for head 'like'"),
        (
            {"click": np.zeros(3, np.float32), "like": np.zeros(2, np.float32)},
            "head 'click' has shape [3] for 2 records; expected [2]",
        ),
        (
            {"click": np.array([0.5, np.nan], np.float32), "like": np.zeros(2, np.float32)},
            "head 'click' is nan at record 1; probabilities must be finite",
        ),
    ],
)
def test_prediction_that_does_not_fit_is_a_model_bug(
    probabilities: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        oip.infer_response("m", HEADS, InferRequest(None, [b"", b""]), Prediction(probabilities))


def test_bad_records_body_lists_every_record() -> None:
    errors = [
        RecordError(1, None, "not_json", "Expecting value"),
        RecordError(4, "user", "nan", "user is NaN"),
    ]
    message, raw = oip.bad_records_body(errors, 5)
    assert message == (
        'bad record at index 1: not_json (Expecting value); 2 of 5 records bad (see "records")'
    )
    assert json.loads(raw) == {"error": message, "records": [e.to_json() for e in errors]}
    with pytest.raises(ValueError, match="errors is empty"):
        oip.bad_records_body([], 1)
    assert str(BadRecords(errors)).endswith("(and 1 more bad records)")
    with pytest.raises(ValueError, match="errors is empty"):
        BadRecords([])


def test_metadata() -> None:
    meta = oip.model_metadata("ranker", HEADS, {"dense_version": np.int32(5), "v": (1, 2)})
    assert meta == {
        "name": "ranker",
        "versions": [],
        "platform": "streamrec",
        "inputs": [{"name": "records", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "click", "datatype": "FP32", "shape": [-1]},
            {"name": "like", "datatype": "FP32", "shape": [-1]},
        ],
        "parameters": {"dense_version": 5, "v": [1, 2]},
    }
    json.dumps(meta)  # JSON-serializable as it stands
    assert "parameters" not in oip.model_metadata("m", HEADS, {})
    assert oip.server_metadata("1.2") == {
        "name": "streamrec",
        "version": "1.2",
        "extensions": ["binary_tensor_data"],
    }


def test_error_body_is_json() -> None:
    assert json.loads(oip.error_body('a "quoted" name')) == {"error": 'a "quoted" name'}


def test_triton_timeout_and_priority_are_read() -> None:
    raw = body(parameters={"timeout": 250_000, "priority": 2, "binary_data_output": True})
    request = oip.parse_infer_request(raw, HEADS)
    assert (request.timeout_s, request.priority, request.binary_output) == (0.25, 2, True)
    plain = oip.parse_infer_request(body(parameters={"timeout": 0}), HEADS)
    assert (plain.timeout_s, plain.priority) == (None, 0)  # Triton's 0: no timeout of its own


def test_too_many_records_are_refused_from_the_shape() -> None:
    many = body(inputs=[records_input(shape=[5], data=["{}"] * 5)])
    with pytest.raises(OipError) as info:
        oip.parse_infer_request(many, HEADS, max_records=4)
    assert (info.value.status, info.value.reason) == (413, "too_many_records")
    assert info.value.message.startswith(
        "inputs[0].shape: 5 records, over this server's limit of 4 per request"
    )
    assert len(oip.parse_infer_request(many, HEADS, max_records=5).records) == 5
    # A binary tensor's shape is read before its bytes: nothing of it is decoded.
    head = body(inputs=[records_input(shape=[10**9], data=..., parameters={"binary_data_size": 4})])
    with pytest.raises(OipError) as info:
        oip.parse_infer_request(head + b"\x00" * 4, HEADS, str(len(head)), max_records=4)
    assert info.value.status == 413
