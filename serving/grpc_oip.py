"""The Open Inference Protocol over gRPC: pure checking and encoding of its messages.

The gRPC twin of :mod:`serving.oip`, with no I/O: ``grpc_service.py`` receives a
message, calls these functions, sends what they return. A model takes one input,
``records``, datatype ``BYTES``, shape ``[n]`` or ``[n, 1]``, its elements in
``contents.bytes_contents`` or in ``raw_input_contents`` (each a 4-byte
little-endian length, then the bytes: what ``tritonclient.grpc`` sends). Each head
is an ``FP32`` output of shape ``[n]``, always in ``raw_output_contents``: Triton
does the same, and ``tritonclient.grpc`` reads nothing else for numbers. Whatever is
wrong with a request raises :class:`~serving.types.OipError` naming the field and
the value, in the words of the HTTP side where they apply.

>>> from serving.proto import grpc_predict_v2_pb2 as pb
>>> tensor = pb.ModelInferRequest.InferInputTensor(name="records", datatype="BYTES",
...     shape=[2], contents=pb.InferTensorContents(bytes_contents=[b'{"user": 1}', b"{}"]))
>>> request = parse_infer(pb.ModelInferRequest(model_name="ranker", inputs=[tensor]),
...                       heads=("click",))
>>> request.records
[b'{"user": 1}', b'{}']
>>> tensor.datatype = "FP32"
>>> parse_infer(pb.ModelInferRequest(inputs=[tensor]), heads=("click",))
Traceback (most recent call last):
...
serving.types.OipError: inputs[0].datatype: expected "BYTES", got "FP32"
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Final, TypeVar

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from serving import oip
from serving.oip import INPUT_DATATYPE, INPUT_NAME, OUTPUT_DATATYPE
from serving.proto import grpc_predict_v2_pb2 as pb
from serving.types import InferRequest, OipError, Prediction, RecordError, RequestedOutput

__all__ = [
    "bad_records_message",
    "infer_response",
    "model_metadata",
    "parse_infer",
    "server_metadata",
]

_REQUEST_PARAMETERS: Final = ("timeout", "priority")
_INPUT_TEMPLATE: Final = '{name: "records", datatype: "BYTES", shape: [n]}'
_INT64_MAX: Final = (1 << 63) - 1
# A status's message travels in a trailer, and gRPC clients refuse trailers past 8 KiB
# by default (grpc.max_metadata_size): bad records are listed up to this many characters.
BAD_RECORDS_MESSAGE_LIMIT: Final = 4096
_DETAIL_LIMIT: Final = 200
_M = TypeVar("_M", bound=Message)


def _bad(message: str, reason: str = "invalid_request", *, status: int = 400) -> OipError:
    return OipError(status, message, reason)


def _show(value: object, limit: int = 60) -> str:
    """A short rendering of ``value`` for an error message (long values are cut).

    >>> _show("FP32"), _show([2, 3]), _show(b"ab"), _show("x" * 80)[-15:]
    ('"FP32"', '[2,3]', "b'ab'", '(80 characters)')
    """
    if isinstance(value, bytes):
        text = repr(value)
    elif isinstance(value, str) and len(value) > limit:
        return json.dumps(value[: limit - 3])[:-1] + f'..." ({len(value)} characters)'
    else:
        text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(parameter: pb.InferParameter) -> str:
    """A parameter's kind and value, for an error message.

    >>> _describe(pb.InferParameter(string_param="soon")), _describe(pb.InferParameter())
    ('string_param "soon"', 'no value')
    """
    kind = parameter.WhichOneof("parameter_choice")
    return "no value" if kind is None else f"{kind} {_show(getattr(parameter, kind))}"


def _whole(parameter: pb.InferParameter) -> int | None:
    kind = parameter.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(parameter, kind))
    return None


def _request_parameters(parameters: Mapping[str, pb.InferParameter]) -> tuple[float | None, int]:
    """A request's Triton ``timeout`` (int64, microseconds: seconds here, None for none)
    and ``priority`` (uint64 or int64: 1 the highest, 0 the default)."""
    timeout_s: float | None = None
    priority = 0
    for key in sorted(parameters):  # a map's order is the sender's: the first error, always
        parameter = parameters[key]
        if key in _REQUEST_PARAMETERS:
            value = _whole(parameter)
            value = oip.scheduling_parameter(key, value, _describe(parameter))
            if key == "priority":
                priority = value
            elif value > 0:  # Triton's 0: no timeout of the request's own
                timeout_s = value / 1e6
        else:
            msg = (
                f"parameters.{key}: not supported by this server (value "
                f"{_describe(parameter)}); it knows {', '.join(_REQUEST_PARAMETERS)}"
            )
            raise _bad(msg)
    return timeout_s, priority


def _refuse_parameters(
    parameters: Mapping[str, pb.InferParameter], where: str, extension: str | None = None
) -> None:
    """Refuse a tensor's parameters: none is supported (``extension``: the one that
    ``classification`` would ask for, on an output)."""
    for key in sorted(parameters):
        shown = _describe(parameters[key])
        if key.startswith("shared_memory_"):
            msg = (
                f"{where}.parameters.{key}: shared memory is not supported "
                f"(got {shown}); send the records in the request"
            )
        elif key == extension:
            msg = (
                f"{where}.parameters.{key}: the classification extension is not supported "
                f"(got {shown}); ask for the output itself"
            )
        else:
            msg = f"{where}.parameters.{key}: not supported (value {shown}); send no parameters"
        raise _bad(msg)


def _shape(shape: Sequence[int], where: str) -> int:
    if not shape:
        msg = f"{where}.shape: missing; expected [n] or [n, 1], n the number of records"
        raise _bad(msg)
    if len(shape) > 2 or shape[0] < 1 or (len(shape) == 2 and shape[1] != 1):
        msg = f"{where}.shape: expected [n] or [n, 1] with n >= 1, got {_show(list(shape))}"
        raise _bad(msg)
    return int(shape[0])


def _find_input(inputs: Sequence[pb.ModelInferRequest.InferInputTensor]) -> int:
    """The index of the ``records`` input, the only one a model takes."""
    if not inputs:
        msg = f"inputs: missing; send [{_INPUT_TEMPLATE}]"
        raise _bad(msg, "missing_input")
    found: int | None = None
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not tensor.name:
            msg = f'{where}.name: missing; this model takes one input, "{INPUT_NAME}"'
            raise _bad(msg)
        if tensor.name != INPUT_NAME:
            msg = (
                f"{where}.name: unknown input {_show(tensor.name)}; this model takes one input, "
                f'"{INPUT_NAME}" (BYTES, shape [n])'
            )
            raise _bad(msg, "unknown_input")
        if found is not None:
            msg = f'{where}.name: input "{INPUT_NAME}" given twice (also inputs[{found}])'
            raise _bad(msg)
        found = i
    assert found is not None  # inputs is not empty, and each one is "records"
    return found


def _records(request: pb.ModelInferRequest) -> Sequence[bytes]:
    i = _find_input(request.inputs)
    tensor = request.inputs[i]
    where = f"inputs[{i}]"
    if tensor.datatype != INPUT_DATATYPE:
        got = "missing" if not tensor.datatype else f"got {_show(tensor.datatype)}"
        msg = f'{where}.datatype: expected "{INPUT_DATATYPE}", {got}'
        raise _bad(msg)
    n = _shape(tensor.shape, where)
    _refuse_parameters(tensor.parameters, where)
    contents = tensor.contents
    given = [field.name for field, _ in contents.ListFields()]
    raw = request.raw_input_contents
    if raw:
        if len(raw) != len(request.inputs):
            msg = (
                f"raw_input_contents: {len(raw)} entries, but the request has "
                f"{len(request.inputs)} input; send one entry per input"
            )
            raise _bad(msg)
        if given:
            msg = (
                f"{where}: both contents.{given[0]} and raw_input_contents[{i}] given; "
                f"send one of them"
            )
            raise _bad(msg)
        return oip.decode_bytes_tensor(raw[i], n, where)
    other = [name for name in given if name != "bytes_contents"]
    if other:
        msg = (
            f"{where}.contents.{other[0]}: a BYTES input sends its records in "
            f"contents.bytes_contents (or raw_input_contents)"
        )
        raise _bad(msg)
    items = contents.bytes_contents
    if not items:
        msg = (
            f"{where}.contents.bytes_contents: missing; expected {n} records, one each "
            f"(or the tensor in raw_input_contents)"
        )
        raise _bad(msg)
    if len(items) != n:
        msg = f"{where}.contents.bytes_contents: {len(items)} elements, but shape gives n = {n}"
        raise _bad(msg)
    return list(items)


def _requested_outputs(
    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor], heads: Sequence[str]
) -> tuple[RequestedOutput, ...] | None:
    if not outputs:
        return None
    known = ", ".join(f'"{h}"' for h in heads)
    wanted: list[RequestedOutput] = []
    for i, output in enumerate(outputs):
        where = f"outputs[{i}]"
        if output.name not in heads:
            got = "missing" if not output.name else f"unknown output {_show(output.name)}"
            msg = f"{where}.name: {got}; this model's outputs are {known}"
            raise _bad(msg, "unknown_output")
        if any(w.name == output.name for w in wanted):
            msg = f"{where}.name: output {_show(output.name)} requested twice"
            raise _bad(msg)
        _refuse_parameters(output.parameters, where, extension="classification")
        wanted.append(RequestedOutput(output.name, binary=True))
    return tuple(wanted)


def parse_infer(request: pb.ModelInferRequest, heads: Sequence[str]) -> InferRequest:
    """Check a ``ModelInferRequest``'s parameters, records and requested outputs (its
    model name and version are the caller's to check). Raises :class:`OipError` (400).

    >>> raw = oip.encode_bytes_tensor([b"{}", b"{}", b"{}"])
    >>> tensor = pb.ModelInferRequest.InferInputTensor(name="records", datatype="BYTES",
    ...                                                shape=[3, 1])
    >>> request = pb.ModelInferRequest(inputs=[tensor], raw_input_contents=[raw],
    ...     outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="like")])
    >>> request.parameters["timeout"].int64_param = 250_000
    >>> parsed = parse_infer(request, ("click", "like"))
    >>> len(parsed.records), parsed.outputs, parsed.timeout_s
    (3, (RequestedOutput(name='like', binary=True),), 0.25)
    >>> request.parameters["sequence_id"].int64_param = 7
    >>> parse_infer(request, ("click", "like"))
    Traceback (most recent call last):
    ...
    serving.types.OipError: parameters.sequence_id: not supported by this server \
(value int64_param 7); it knows timeout, priority
    """
    timeout_s, priority = _request_parameters(request.parameters)
    records = _records(request)
    outputs = _requested_outputs(request.outputs, heads)
    return InferRequest(
        request.id or None,
        records,
        outputs,
        binary_output=True,
        timeout_s=timeout_s,
        priority=priority,
    )


def _set(parameter: pb.InferParameter, value: object) -> None:
    """``value`` into the parameter's field of its type (a string when none fits)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and -_INT64_MAX - 1 <= value <= _INT64_MAX:
        parameter.int64_param = value
    elif isinstance(value, int) and 0 <= value < 1 << 64:
        parameter.uint64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def infer_response(
    model_name: str,
    model_version: str | None,
    heads: Sequence[str],
    request: InferRequest,
    prediction: Prediction,
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse``: one FP32 output of shape ``[n]`` per requested head,
    its data in ``raw_output_contents``; ``prediction.parameters`` as its parameters.

    Raises ``ValueError`` when ``prediction`` does not fit the request (a head
    missing, a wrong length, a value not finite): a bug of the model, not the client's.

    >>> request = InferRequest("r1", [b"{}"], (RequestedOutput("like", binary=True),))
    >>> prediction = Prediction({"click": np.array([0.5], np.float32),
    ...                          "like": np.array([0.25], np.float32)}, {"dense_version": 3})
    >>> response = infer_response("ranker", "3", ("click", "like"), request, prediction)
    >>> response.outputs[0].name, list(response.outputs[0].shape), response.raw_output_contents
    ('like', [1], [b'\\x00\\x00\\x80>'])
    >>> response.parameters["dense_version"].int64_param, response.id
    (3, 'r1')
    """
    n = len(request.records)
    names = [o.name for o in request.outputs] if request.outputs is not None else list(heads)
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version or "", id=request.id or ""
    )
    for key, value in prediction.parameters.items():
        _set(response.parameters[str(key)], value)
    for name in names:
        array = oip.head_values(model_name, prediction, name, n)
        response.outputs.add(name=name, datatype=OUTPUT_DATATYPE, shape=[n])
        response.raw_output_contents.append(array.astype("<f4", copy=False).tobytes())
    return response


def bad_records_message(errors: Sequence[RecordError], n: int) -> str:
    """The message of a request whose records a model refused: every bad record named
    (index, field, reason), up to :data:`BAD_RECORDS_MESSAGE_LIMIT` characters.

    >>> bad_records_message([RecordError(1, "user", "missing_field", "no key user"),
    ...                      RecordError(3, None, "not_json", "")], 4)
    'bad record at index 1, field "user": missing_field (no key user); bad record at \
index 3: not_json; 2 of 4 records bad'
    >>> many = [RecordError(i, None, "not_json", "") for i in range(1000)]
    >>> bad_records_message(many, 1000).split("; ")[-2:]
    ['bad record at index 119: not_json', '1000 of 1000 records bad (the first 120 listed)']
    """
    if not errors:
        msg = "bad_records_message: errors is empty; give at least one RecordError"
        raise ValueError(msg)
    lines: list[str] = []
    size = 0
    for error in errors:
        line = error.describe()
        if len(line) > _DETAIL_LIMIT:
            line = line[: _DETAIL_LIMIT - 3] + "..."
        if size + len(line) + 2 > BAD_RECORDS_MESSAGE_LIMIT:
            break
        lines.append(line)
        size += len(line) + 2
    tail = f"{len(errors)} of {n} records bad"
    if len(lines) < len(errors):
        tail += f" (the first {len(lines)} listed)"
    return "; ".join([*lines, tail])


def server_metadata(version: str) -> pb.ServerMetadataResponse:
    """The ``ServerMetadataResponse``: the HTTP side's ``GET /v2``, as a message.

    >>> server_metadata("0.1.0").extensions
    ['binary_tensor_data']
    """
    return _from_doc(pb.ServerMetadataResponse(), oip.server_metadata(version))


def model_metadata(
    name: str, heads: Sequence[str], extra: Mapping[str, object] | None = None
) -> pb.ModelMetadataResponse:
    """The ``ModelMetadataResponse``: the HTTP side's ``GET /v2/models/{name}`` (less its
    ``parameters``, which the message has no field for).

    >>> meta = model_metadata("ranker", ("click",), {"version": 4})
    >>> list(meta.versions), meta.inputs[0].datatype, list(meta.outputs[0].shape)
    (['4'], 'BYTES', [-1])
    """
    doc = dict(oip.model_metadata(name, heads, extra))
    doc.pop("parameters", None)
    return _from_doc(pb.ModelMetadataResponse(), doc)


def _from_doc(message: _M, doc: dict[str, object]) -> _M:
    return json_format.ParseDict(doc, message)
