"""The Open Inference Protocol (KServe v2) of ``streamrec serve``: pure parsing and encoding.

No I/O here: ``http.py`` reads the request, calls these functions, writes what
they return. A model takes exactly one input, ``records``, of datatype ``BYTES``
and shape ``[n]`` (or ``[n, 1]``); each element is one record in the job's own
format (e.g. one JSON object as text). Every head is an ``FP32`` output of shape
``[n]``. Whatever is wrong with a request raises :class:`OipError` naming the
field and the value, never anything else.

>>> req = parse_infer_request(
...     b'{"id": "r1", "inputs": [{"name": "records", "datatype": "BYTES",'
...     b' "shape": [2], "data": ["{\\\\"user\\\\": 1}", "{}"]}]}',
...     heads=("click", "like"))
>>> req.id, req.records
('r1', [b'{"user": 1}', b'{}'])
>>> import numpy as np
>>> pred = Prediction({"click": np.array([0.5, 0.25], np.float32),
...                    "like": np.array([0.125, 1.0], np.float32)}, {"dense_version": 3})
>>> infer_response("ranker", ("click", "like"), req, pred).body.decode()[:96]
'{"model_name":"ranker","id":"r1","parameters":{"dense_version":3},"outputs":[{"name":"click","da'
>>> parse_infer_request(b'{"inputs": [{"name": "records", "datatype": "FP32", "shape": [1],'
...                     b' "data": [1.0]}]}', heads=("click",))
Traceback (most recent call last):
...
serving.types.OipError: inputs[0].datatype: expected "BYTES", got "FP32"

**Binary tensor data extension: implemented.** A request may carry its tensor
after the JSON (the ``Inference-Header-Content-Length`` header gives the JSON's
length, ``parameters.binary_data_size`` the tensor's; a ``BYTES`` element is a
4-byte little-endian length and the bytes), and outputs come back as raw
little-endian float32 when asked for (``binary_data_output`` on the request,
``binary_data`` on a requested output). Why: it is what tritonclient does by
default (``InferInput.set_data_from_numpy`` sends binary; a request naming no
outputs asks for binary ones), so the stock client works without options;
binary outputs skip formatting floats as text; and it costs about 60 lines here.
The server's metadata therefore lists ``"binary_tensor_data"`` in its extensions.
Shared-memory and classification extensions are not implemented, and asking
for them is a 400 that says so.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple, cast

import numba as nb
import numpy as np
import numpy.typing as npt

from connectors.codecs.joined import JoinedPayloads, spans_utf8
from serving.types import (
    EncodedResponse,
    InferRequest,
    OipError,
    Prediction,
    RecordError,
    RequestedOutput,
)

__all__ = [
    "EXTENSIONS",
    "HEADER_LENGTH",
    "INPUT_DATATYPE",
    "INPUT_NAME",
    "OUTPUT_DATATYPE",
    "PLATFORM",
    "OipError",
    "bad_records_body",
    "decode_bytes_tensor",
    "dumps",
    "encode_bytes_tensor",
    "error_body",
    "infer_response",
    "loads",
    "model_metadata",
    "parse_infer_request",
    "server_metadata",
]

PLATFORM: Final = "streamrec"
INPUT_NAME: Final = "records"
INPUT_DATATYPE: Final = "BYTES"
OUTPUT_DATATYPE: Final = "FP32"
EXTENSIONS: Final = ("binary_tensor_data",)
# The HTTP header of the binary tensor data extension: the length of the JSON part.
HEADER_LENGTH: Final = "Inference-Header-Content-Length"

_REQUEST_KEYS: Final = frozenset({"id", "parameters", "inputs", "outputs"})
_INPUT_KEYS: Final = frozenset({"name", "shape", "datatype", "data", "parameters"})
_OUTPUT_KEYS: Final = frozenset({"name", "parameters"})
_REQUEST_PARAMETERS: Final = ("binary_data_output", "timeout", "priority")
_INPUT_TEMPLATE: Final = '{"name": "records", "datatype": "BYTES", "shape": [n], "data": [...]}'
_MISSING: Final = object()
_LENGTH: Final = struct.Struct("<I")
_U8 = npt.NDArray[np.uint8]
_I64 = npt.NDArray[np.int64]


# --- JSON ---------------------------------------------------------------------------------

# The standard library's, whatever else is installed: orjson (the `bench` extra) refuses
# a body that is not UTF-8 and a lone surrogate with messages that name neither the byte
# nor the record, and side by side beside a training job it made no difference to a
# request's CPU.
_ENCODE: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def dumps(obj: object) -> bytes:
    """Compact JSON bytes; ``ValueError`` for a NaN or an infinity."""
    return _ENCODE(obj).encode()


def loads(data: bytes) -> object:
    """The JSON value of UTF-8 bytes (``ValueError`` for bad JSON, ``UnicodeDecodeError``
    for bytes that are not UTF-8)."""
    return json.loads(data.decode("utf-8"))


# --- messages ----------------------------------------------------------------------------


def _kind(value: object) -> str:
    """The JSON name of a decoded value's type.

    >>> _kind([1]), _kind({}), _kind("a"), _kind(True), _kind(None), _kind(2.5)
    ('array', 'object', 'string', 'boolean', 'null', 'number')
    """
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


def _show(value: object, limit: int = 60) -> str:
    """A short JSON rendering of ``value`` for an error message (long values are cut).

    >>> _show("FP32"), _show([1, 2]), _show(list(range(100)))
    ('"FP32"', '[1,2]', '[0,1,2,3,4,5,6,7, ... (100 elements)]')
    >>> _show("x" * 100)
    '"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..." (100 characters)'
    """
    if isinstance(value, list) and len(value) > 8:
        head = ",".join(_show(v, 16) for v in value[:8])
        return f"[{head}, ... ({len(value)} elements)]"
    if isinstance(value, dict) and len(value) > 8:
        keys = ", ".join(_show(k, 16) for k in list(value)[:8])
        return f"{{{keys}, ... ({len(value)} keys)}}"
    if isinstance(value, str) and len(value) > limit:
        return json.dumps(value[: limit - 3])[:-1] + f'..." ({len(value)} characters)'
    try:
        text = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(message: str, reason: str = "invalid_request", *, status: int = 400) -> OipError:
    return OipError(status, message, reason)


def error_body(message: str) -> bytes:
    """The JSON body of an error response (the protocol's ``{"error": ...}``).

    >>> error_body('model "x" is not ready')
    b'{"error":"model \\\\"x\\\\" is not ready"}'
    """
    return dumps({"error": message})


def bad_records_body(errors: Sequence[RecordError], n: int) -> tuple[str, bytes]:
    """The message and 400 body for records a model refused: every error is listed.

    The message names the first bad record's index, field and reason.

    >>> msg, body = bad_records_body([RecordError(1, "item_id", "missing_field", "")], 2)
    >>> msg
    'bad record at index 1, field "item_id": missing_field; 1 of 2 records bad (see "records")'
    >>> loads(body)["records"]
    [{'index': 1, 'field': 'item_id', 'reason': 'missing_field', 'detail': ''}]
    """
    if not errors:
        msg = "bad_records_body: errors is empty; give at least one RecordError"
        raise ValueError(msg)
    message = f'{errors[0].describe()}; {len(errors)} of {n} records bad (see "records")'
    return message, dumps({"error": message, "records": [e.to_json() for e in errors]})


# --- the binary tensor data extension -------------------------------------------------


def encode_bytes_tensor(items: Sequence[bytes]) -> bytes:
    """A BYTES tensor as binary data: each element a 4-byte little-endian length, then bytes.

    >>> encode_bytes_tensor([b"ab", b""])
    b'\\x02\\x00\\x00\\x00ab\\x00\\x00\\x00\\x00'
    >>> list(decode_bytes_tensor(encode_bytes_tensor([b"ab", b""]), 2, "inputs[0]"))
    [b'ab', b'']
    """
    return b"".join(_LENGTH.pack(len(item)) + item for item in items)


def decode_bytes_tensor(data: bytes | memoryview, n: int, where: str) -> JoinedPayloads:
    """The ``n`` elements of a BYTES tensor sent as binary data, where they lie in
    ``data`` (one kernel pass, see :mod:`connectors.codecs.joined`); ``where`` names
    the input.

    >>> decode_bytes_tensor(b"\\x05\\x00\\x00\\x00ab", 1, "inputs[0]")
    Traceback (most recent call last):
    ...
    serving.types.OipError: inputs[0]: binary element 0 claims 5 bytes at offset 4, but 2 remain
    """
    buffer = np.frombuffer(data, dtype=np.uint8)
    end = len(buffer)
    if n > end // 4:  # checked before anything of the shape's size is allocated
        msg = (
            f"{where}.shape: gives {n} elements, but its {end} bytes of binary data hold at "
            f"most {end // 4} (each element starts with a 4-byte length)"
        )
        raise _bad(msg)
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    status, i, offset, size, utf8 = _split_elements(buffer, starts, ends)
    if status == 1:
        msg = (
            f"{where}: binary data holds {i} elements of the {n} its shape gives "
            f"(it ends at byte {end}, inside element {i}'s 4-byte length)"
        )
        raise _bad(msg)
    if status == 2:
        msg = (
            f"{where}: binary element {i} claims {size} bytes at offset {offset}, "
            f"but {end - offset} remain"
        )
        raise _bad(msg)
    if status == 3:
        msg = (
            f"{where}: binary data has {end - offset} bytes left after the {n} elements "
            f"its shape gives"
        )
        raise _bad(msg)
    return JoinedPayloads(buffer, starts, ends, utf8)


@nb.njit(nogil=True, cache=True)
def _split_elements(data: _U8, starts: _I64, ends: _I64) -> tuple[int, int, int, int, bool]:
    """Where each of the ``len(starts)`` length-prefixed elements of ``data`` starts and
    ends, and whether they are all UTF-8 (in the same call: one kernel call less per
    request). Returns (status, element, offset, size, utf8): status 0, or 1 (``data``
    ends inside the element's length), 2 (the element's ``size`` bytes at ``offset``
    run past the end), 3 (bytes are left from ``offset`` on)."""
    end = data.shape[0]
    offset = 0
    for i in range(starts.shape[0]):
        if offset + 4 > end:
            return 1, i, offset, 0, False
        size = 0
        for k in range(4):  # little-endian
            size |= int(np.int64(data[offset + k]) << np.int64(8 * k))
        offset += 4
        if offset + size > end:
            return 2, i, offset, size, False
        starts[i] = offset
        offset += size
        ends[i] = offset
    if offset != end:
        return 3, starts.shape[0], offset, 0, False
    return 0, starts.shape[0], offset, 0, spans_utf8(data, starts, ends)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview | None]:
    """The JSON part and the binary part (``None`` without the extension's header)."""
    if header_length is None:
        return body, None
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > len(body):
        msg = (
            f"{HEADER_LENGTH} header: expected the JSON part's length in bytes, "
            f"0 to {len(body)} (the body's length), got {_show(header_length)}"
        )
        raise _bad(msg)
    n = int(text)
    if n == len(body):
        return body, memoryview(b"")
    return body[:n], memoryview(body)[n:]


# --- parsing an infer request ------------------------------------------------------------


def _decode(json_part: bytes) -> object:
    try:
        return loads(json_part)
    except UnicodeDecodeError as e:
        msg = (
            f"request body: not UTF-8 ({e.reason} at byte {e.start}); "
            f"send JSON text, records as JSON strings"
        )
        raise _bad(msg, "not_json") from None
    except (ValueError, RecursionError) as e:
        msg = f'request body: not valid JSON ({e}); send {{"inputs": [{_INPUT_TEMPLATE}]}}'
        raise _bad(msg, "not_json") from None


def _check_keys(obj: Mapping[str, object], allowed: frozenset[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            known = ", ".join(f'"{k}"' for k in sorted(allowed))
            msg = f"{where}: unknown key {_show(key)}; expected some of {known}"
            raise _bad(msg)


class _RequestParameters(NamedTuple):
    binary_output: bool = False
    timeout_s: float | None = None
    priority: int = 0


def _request_parameters(parameters: object) -> _RequestParameters:
    """A request's ``parameters``: ``binary_data_output``, and Triton's ``timeout`` (in
    microseconds) and ``priority`` (1 the highest, 0 the default)."""
    if parameters is None:
        return _RequestParameters()
    if not isinstance(parameters, dict):
        msg = f"parameters: expected an object, got {_kind(parameters)} {_show(parameters)}"
        raise _bad(msg)
    binary = False
    timeout_s: float | None = None
    priority = 0
    for key, value in parameters.items():
        if key == "binary_data_output":
            if not isinstance(value, bool):
                msg = f"parameters.binary_data_output: expected true or false, got {_show(value)}"
                raise _bad(msg)
            binary = value
        elif key in ("timeout", "priority"):
            number = scheduling_parameter(key, value, _show(value))
            if key == "priority":
                priority = number
            elif number > 0:  # Triton's 0: no timeout of the request's own
                timeout_s = number / 1e6
        else:
            msg = (
                f"parameters.{key}: not supported by this server (value {_show(value)}); "
                f"it knows {', '.join(_REQUEST_PARAMETERS)}"
            )
            raise _bad(msg)
    return _RequestParameters(binary, timeout_s, priority)


def scheduling_parameter(key: str, value: object, shown: str) -> int:
    """Triton's ``timeout`` (microseconds) or ``priority`` request parameter, checked;
    ``shown``: the value as the refusal quotes it.

    >>> scheduling_parameter("priority", -1, "-1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    serving.types.OipError: parameters.priority: expected a whole number (1 the highest, ...
    """
    if type(value) is not int or value < 0:
        unit = " of microseconds" if key == "timeout" else " (1 the highest, 0 the default)"
        msg = f"parameters.{key}: expected a whole number{unit} >= 0, got {shown}"
        raise _bad(msg)
    return value


def _shape(tensor: Mapping[str, object], where: str) -> int:
    shape = tensor.get("shape", _MISSING)
    if shape is _MISSING:
        msg = f"{where}.shape: missing; expected [n] or [n, 1], n the number of records"
        raise _bad(msg)
    if (
        not isinstance(shape, list)
        or len(shape) not in (1, 2)
        or any(type(d) is not int for d in shape)
        or shape[0] < 1
        or (len(shape) == 2 and shape[1] != 1)
    ):
        msg = f"{where}.shape: expected [n] or [n, 1] with n >= 1, got {_show(shape)}"
        raise _bad(msg)
    return cast(int, shape[0])


def _input_binary_size(tensor: Mapping[str, object], where: str) -> int | None:
    parameters = tensor.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        msg = f"{where}.parameters: expected an object, got {_kind(parameters)} {_show(parameters)}"
        raise _bad(msg)
    size: int | None = None
    for key, value in parameters.items():
        if key == "binary_data_size":
            if type(value) is not int or value < 0:
                got = _show(value)
                msg = f"{where}.parameters.binary_data_size: expected a byte count, got {got}"
                raise _bad(msg)
            size = value
        elif key.startswith("shared_memory_"):
            msg = (
                f"{where}.parameters.{key}: shared memory is not supported "
                f"(got {_show(value)}); send the records in the request"
            )
            raise _bad(msg)
        else:
            msg = (
                f"{where}.parameters.{key}: not supported (value {_show(value)}); "
                f"an input knows binary_data_size"
            )
            raise _bad(msg)
    return size


def _json_records(data: object, n: int, where: str) -> list[bytes]:
    if data is _MISSING:
        msg = f"{where}.data: missing; expected a list of {n} strings, one record each"
        raise _bad(msg)
    if not isinstance(data, list):
        msg = f"{where}.data: expected a list of {n} strings, got {_kind(data)} {_show(data)}"
        raise _bad(msg)
    if len(data) != n:
        msg = f"{where}.data: {len(data)} elements, but shape gives n = {n}"
        raise _bad(msg)
    out: list[bytes] = []
    for j, item in enumerate(data):
        text = item[0] if type(item) is list and len(item) == 1 else item  # [n, 1] nested
        if type(text) is not str:
            msg = (
                f"{where}.data[{j}]: expected a string (one record as text), "
                f"got {_kind(item)} {_show(item)}"
            )
            raise _bad(msg)
        try:
            out.append(text.encode())
        except UnicodeEncodeError as e:
            msg = f"{where}.data[{j}]: not encodable as UTF-8 ({e.reason} at character {e.start})"
            raise _bad(msg) from None
    return out


def _records(
    inputs: object, binary: memoryview | None, max_records: int | None = None
) -> Sequence[bytes]:
    if inputs is _MISSING:
        msg = f"inputs: missing; send [{_INPUT_TEMPLATE}]"
        raise _bad(msg, "missing_input")
    if not isinstance(inputs, list) or not inputs:
        msg = f"inputs: expected a list holding {_INPUT_TEMPLATE}, got {_show(inputs)}"
        raise _bad(msg, "missing_input")
    found: tuple[int, dict[str, object]] | None = None
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            msg = f"{where}: expected an object {_INPUT_TEMPLATE}, got {_show(tensor)}"
            raise _bad(msg)
        name = tensor.get("name", _MISSING)
        if type(name) is not str:
            shown = "missing" if name is _MISSING else f"expected a string, got {_show(name)}"
            msg = f'{where}.name: {shown}; this model takes one input, "{INPUT_NAME}"'
            raise _bad(msg)
        if name != INPUT_NAME:
            msg = (
                f"{where}.name: unknown input {_show(name)}; this model takes one input, "
                f'"{INPUT_NAME}" (BYTES, shape [n])'
            )
            raise _bad(msg, "unknown_input")
        if found is not None:
            msg = f'{where}.name: input "{INPUT_NAME}" given twice (also inputs[{found[0]}])'
            raise _bad(msg)
        found = (i, tensor)
    if found is None:  # unreachable: inputs is non-empty and each one is "records"
        msg = f"inputs: no input named {INPUT_NAME!r}"
        raise _bad(msg, "missing_input")
    i, tensor = found
    where = f"inputs[{i}]"
    _check_keys(tensor, _INPUT_KEYS, where)
    datatype = tensor.get("datatype", _MISSING)
    if datatype != INPUT_DATATYPE:
        got = "missing" if datatype is _MISSING else f"got {_show(datatype)}"
        msg = f'{where}.datatype: expected "{INPUT_DATATYPE}", {got}'
        raise _bad(msg)
    n = _shape(tensor, where)
    if max_records is not None and n > max_records:  # before any of it is decoded
        msg = (
            f"{where}.shape: {n} records, over this server's limit of {max_records} per "
            f"request (serving.max_request_records); send them in several requests"
        )
        raise _bad(msg, "too_many_records", status=413)
    size = _input_binary_size(tensor, where)
    if size is None:
        if binary:
            msg = (
                f"request body: {len(binary)} bytes follow the JSON part ({HEADER_LENGTH}), "
                f"but no input has parameters.binary_data_size"
            )
            raise _bad(msg)
        return _json_records(tensor.get("data", _MISSING), n, where)
    if "data" in tensor:
        msg = f'{where}: both "data" and parameters.binary_data_size given; send one of them'
        raise _bad(msg)
    if binary is None:
        msg = (
            f"{where}.parameters.binary_data_size: {size} given, but the request has no "
            f"{HEADER_LENGTH} header saying where the JSON part ends"
        )
        raise _bad(msg)
    if size != len(binary):
        msg = (
            f"{where}.parameters.binary_data_size: {size}, but {len(binary)} bytes "
            f"follow the JSON part"
        )
        raise _bad(msg)
    return decode_bytes_tensor(binary, n, where)


def _requested_outputs(
    outputs: object, heads: Sequence[str], binary_default: bool
) -> tuple[RequestedOutput, ...] | None:
    if outputs is _MISSING or outputs == []:
        return None
    known = ", ".join(f'"{h}"' for h in heads)
    if not isinstance(outputs, list):
        msg = f'outputs: expected a list of {{"name": head}} objects, got {_show(outputs)}'
        raise _bad(msg)
    wanted: list[RequestedOutput] = []
    for i, output in enumerate(outputs):
        where = f"outputs[{i}]"
        if not isinstance(output, dict):
            msg = f'{where}: expected an object {{"name": head}}, got {_show(output)}'
            raise _bad(msg)
        _check_keys(output, _OUTPUT_KEYS, where)
        name = output.get("name", _MISSING)
        if type(name) is not str or name not in heads:
            got = "missing" if name is _MISSING else f"unknown output {_show(name)}"
            msg = f"{where}.name: {got}; this model's outputs are {known}"
            raise _bad(msg, "unknown_output")
        if any(w.name == name for w in wanted):
            msg = f"{where}.name: output {_show(name)} requested twice"
            raise _bad(msg)
        binary = binary_default
        parameters = output.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                msg = f"{where}.parameters: expected an object, got {_show(parameters)}"
                raise _bad(msg)
            for key, value in parameters.items():
                if key == "binary_data" and isinstance(value, bool):
                    binary = value
                elif key == "binary_data":
                    got = _show(value)
                    msg = f"{where}.parameters.binary_data: expected true or false, got {got}"
                    raise _bad(msg)
                else:
                    msg = (
                        f"{where}.parameters.{key}: not supported (value {_show(value)}); "
                        f"an output knows binary_data"
                    )
                    raise _bad(msg)
        wanted.append(RequestedOutput(name, binary))
    return tuple(wanted)


def parse_infer_request(
    body: bytes,
    heads: Sequence[str],
    header_length: str | None = None,
    max_records: int | None = None,
) -> InferRequest:
    """Check an infer request body and return its id, records and requested outputs.

    ``header_length`` is the ``Inference-Header-Content-Length`` header's value, if sent
    (the binary tensor data extension). Raises :class:`OipError` (status 400; 413 for
    more than ``max_records`` records, found from the shape before any is decoded).

    >>> tensor = encode_bytes_tensor([b'{"user": 7}'])
    >>> head = (b'{"inputs": [{"name": "records", "datatype": "BYTES", "shape": [1, 1],'
    ...         b' "parameters": {"binary_data_size": 15}}],'
    ...         b' "outputs": [{"name": "like", "parameters": {"binary_data": true}}]}')
    >>> req = parse_infer_request(head + tensor, ("click", "like"), str(len(head)))
    >>> list(req.records), req.outputs
    ([b'{"user": 7}'], (RequestedOutput(name='like', binary=True),))
    >>> parse_infer_request(b'{"inputs": [{"name": "records", "datatype": "BYTES",'
    ...                     b' "shape": [3], "data": ["{}"]}]}', ("click",))
    Traceback (most recent call last):
    ...
    serving.types.OipError: inputs[0].data: 1 elements, but shape gives n = 3
    """
    json_part, binary = _split_body(body, header_length)
    doc = _decode(json_part)
    if not isinstance(doc, dict):
        msg = f'request body: expected a JSON object {{"inputs": [...]}}, got {_kind(doc)}'
        raise _bad(msg)
    _check_keys(doc, _REQUEST_KEYS, "request body")
    request_id = doc.get("id")
    if request_id is not None and type(request_id) is not str:
        msg = f"id: expected a string, got {_show(request_id)}"
        raise _bad(msg)
    parameters = _request_parameters(doc.get("parameters"))
    records = _records(doc.get("inputs", _MISSING), binary, max_records)
    outputs = _requested_outputs(doc.get("outputs", _MISSING), heads, parameters.binary_output)
    return InferRequest(
        request_id,
        records,
        outputs,
        parameters.binary_output,
        timeout_s=parameters.timeout_s,
        priority=parameters.priority,
    )


# --- responses ------------------------------------------------------------------------


def _jsonable(value: object, depth: int = 0) -> object:
    """``value`` with numpy scalars, tuples and mappings made JSON types (else its str)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if depth < 8 and isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, list | tuple):
        return [_jsonable(v, depth + 1) for v in value]
    return str(value)


def infer_response(
    model_name: str,
    heads: Sequence[str],
    request: InferRequest,
    prediction: Prediction,
    model_version: str | None = None,
) -> EncodedResponse:
    """The infer response: one FP32 output of shape ``[n]`` per requested head.

    Raises ``ValueError`` when ``prediction`` does not fit the request (a head
    missing, a wrong length, a value not finite): a bug of the model, not the client's.

    >>> req = InferRequest("r", [b"{}"], (RequestedOutput("like", binary=True),))
    >>> pred = Prediction({"click": np.array([0.5], np.float32),
    ...                    "like": np.array([0.25], np.float32)})
    >>> out = infer_response("ranker", ("click", "like"), req, pred)
    >>> out.body[out.header_length:], out.content_type
    (b'\\x00\\x00\\x80>', 'application/octet-stream')
    >>> loads(out.body[:out.header_length])["outputs"]
    [{'name': 'like', 'datatype': 'FP32', 'shape': [1], 'parameters': {'binary_data_size': 4}}]
    """
    n = len(request.records)
    wanted = request.outputs
    if wanted is None:
        wanted = tuple(RequestedOutput(h, request.binary_output) for h in heads)
    outputs: list[dict[str, object]] = []
    raw: list[bytes] = []
    for output in wanted:
        array = head_values(model_name, prediction, output.name, n)
        tensor: dict[str, object] = {"name": output.name, "datatype": OUTPUT_DATATYPE, "shape": [n]}
        if output.binary:
            data = array.astype("<f4", copy=False).tobytes()
            tensor["parameters"] = {"binary_data_size": len(data)}
            raw.append(data)
        else:
            tensor["data"] = array.tolist()
        outputs.append(tensor)
    doc: dict[str, object] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    doc["id"] = request.id if request.id is not None else ""
    doc["parameters"] = {k: _jsonable(v) for k, v in prediction.parameters.items()}
    doc["outputs"] = outputs
    header = dumps(doc)
    if not raw:
        return EncodedResponse(header)
    return EncodedResponse(header + b"".join(raw), len(header))


def head_values(
    model_name: str, prediction: Prediction, head: str, n: int
) -> npt.NDArray[np.float32]:
    """A head's ``n`` probabilities as float32, checked: a model that returns none, the
    wrong shape or a non-finite value is a ``ValueError`` (the server's 500).

    >>> p = Prediction({"click": np.array([0.5, np.nan])})
    >>> head_values("m", p, "click", 2)
    Traceback (most recent call last):
    ...
    ValueError: predictor of 'm': head 'click' is nan at record 1; probabilities must be finite
    """
    values = prediction.probabilities.get(head)
    if values is None:
        msg = f"predictor of {model_name!r} returned no probabilities for head {head!r}"
        raise ValueError(msg)
    array = np.asarray(values, dtype=np.float32)
    if array.shape != (n,):
        msg = (
            f"predictor of {model_name!r}: head {head!r} has shape "
            f"{list(array.shape)} for {n} records; expected [{n}]"
        )
        raise ValueError(msg)
    if not np.isfinite(array).all():
        bad = int(np.flatnonzero(~np.isfinite(array))[0])
        msg = (
            f"predictor of {model_name!r}: head {head!r} is {array[bad]} "
            f"at record {bad}; probabilities must be finite"
        )
        raise ValueError(msg)
    return array


def model_metadata(
    name: str, heads: Sequence[str], extra: Mapping[str, object] | None = None
) -> dict[str, object]:
    """The model metadata response (``GET /v2/models/{name}``).

    ``extra`` (``Predictor.metadata()``) comes back as ``parameters``; its
    ``"version"``, if any, as ``versions``.

    >>> meta = model_metadata("ranker", ("click",), {"version": 4, "dense_version": 9})
    >>> meta["versions"], meta["inputs"], meta["outputs"]
    (['4'], [{'name': 'records', 'datatype': 'BYTES', 'shape': [-1]}], \
[{'name': 'click', 'datatype': 'FP32', 'shape': [-1]}])
    """
    extra = extra or {}
    version = extra.get("version")
    doc: dict[str, object] = {
        "name": name,
        "versions": [] if version is None else [str(version)],
        "platform": PLATFORM,
        "inputs": [{"name": INPUT_NAME, "datatype": INPUT_DATATYPE, "shape": [-1]}],
        "outputs": [{"name": h, "datatype": OUTPUT_DATATYPE, "shape": [-1]} for h in heads],
    }
    if extra:
        doc["parameters"] = _jsonable(extra)
    return doc


def server_metadata(version: str) -> dict[str, object]:
    """The server metadata response (``GET /v2``).

    >>> server_metadata("0.1.0")
    {'name': 'streamrec', 'version': '0.1.0', 'extensions': ['binary_tensor_data']}
    """
    return {"name": PLATFORM, "version": version, "extensions": list(EXTENSIONS)}
