"""Types of the prediction server, all in one module: the model protocol, its results, errors.

A model is anything with the shape of :class:`Predictor`; the protocol layer
(``oip.py``) and the HTTP shell (``http.py``) know nothing else about it.

>>> import numpy as np
>>> p = Prediction({"click": np.array([0.25], np.float32)}, {"dense_version": 7})
>>> p.n, p.parameters["dense_version"]
(1, 7)
>>> err = BadRecords([RecordError(2, "user_id", "missing_field", "no key 'user_id'")])
>>> str(err)
'bad record at index 2, field "user_id": missing_field (no key \\'user_id\\')'
>>> OipError(400, 'inputs[0].datatype: expected "BYTES", got "FP32"').status
400
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "BadRecords",
    "Deadline",
    "DeadlineExceeded",
    "EncodedResponse",
    "InferRequest",
    "OipError",
    "Overloaded",
    "Prediction",
    "Predictor",
    "RecordError",
    "RequestedOutput",
]


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a model returns for ``n`` records.

    ``probabilities`` holds one float32 array of shape ``[n]`` per label head;
    ``parameters`` travels to the client as the response's ``parameters``
    (e.g. ``dense_version``, ``sparse_version``, ``samples_learned``).
    """

    probabilities: Mapping[str, npt.NDArray[np.float32]]
    parameters: Mapping[str, int | float | str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """The number of records scored (the length of the first head's array; 0 if none)."""
        for values in self.probabilities.values():
            return int(values.shape[0])
        return 0


@dataclass(frozen=True, slots=True)
class RecordError:
    """Why one record of a request could not be scored.

    ``reason`` is a short machine-readable kind (``"not_json"``, ``"missing_field"``,
    ``"nan"``, ...); ``field`` is ``None`` when the record as a whole is bad.
    """

    index: int
    field: str | None
    reason: str
    detail: str

    def to_json(self) -> dict[str, object]:
        """The record's entry in a 400 response's ``records`` list.

        >>> RecordError(0, None, "not_json", "Expecting value").to_json()
        {'index': 0, 'field': None, 'reason': 'not_json', 'detail': 'Expecting value'}
        """
        return {
            "index": self.index,
            "field": self.field,
            "reason": self.reason,
            "detail": self.detail,
        }

    def describe(self) -> str:
        """One line naming the record's index, field and reason.

        >>> RecordError(3, None, "not_json", "Expecting value").describe()
        'bad record at index 3: not_json (Expecting value)'
        """
        where = (
            f"index {self.index}"
            if self.field is None
            else (f'index {self.index}, field "{self.field}"')
        )
        detail = f" ({self.detail})" if self.detail else ""
        return f"bad record at {where}: {self.reason}{detail}"


class ModelUnavailable(RuntimeError):
    """The model cannot answer now (its rows' replicas do not answer): the server says
    503, which clients and load balancers retry, never 500."""


class BadRecords(ValueError):
    """``Predictor.predict`` raises it when records of the request cannot be scored.

    The server answers 400 listing every error; nothing of the request is scored.
    """

    def __init__(self, errors: Sequence[RecordError]) -> None:
        if not errors:
            msg = "BadRecords: errors is empty; raise it with at least one RecordError"
            raise ValueError(msg)
        self.errors: list[RecordError] = list(errors)
        super().__init__(
            self.errors[0].describe()
            + (f" (and {len(self.errors) - 1} more bad records)" if len(self.errors) > 1 else "")
        )


class OipError(Exception):
    """A request the protocol layer refuses: ``status`` is the HTTP status to answer.

    ``message`` names the field and the value at fault; ``reason`` is the label
    the server counts the error under (``streamrec_serve_errors_total``).
    """

    def __init__(self, status: int, message: str, reason: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


class DeadlineExceeded(OipError):
    """A request's time ran out before its answer was ready: the server says 504.

    ``stage`` names where it was found out (``"waiting in the queue"``,
    ``"decoding"``, ``"reading rows"``, ...).
    """

    def __init__(self, timeout_s: float, stage: str) -> None:
        message = (
            f"request timed out after {timeout_s:g}s while {stage} (serving.request_timeout_s, "
            f"or the request's timeout parameter); retry, or send fewer records per request"
        )
        super().__init__(504, message, "timeout")
        self.timeout_s = timeout_s
        self.stage = stage


class Overloaded(OipError):
    """The server's queue is full: the request is shed with 503 and ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(503, message, "overloaded")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a request's answer must be under way: ``at``, a ``time.perf_counter()``.

    Work that can stop checks it between its stages (:meth:`check`); a compiled
    kernel's call cannot be interrupted, so a request is late by at most the
    stage that was running.

    >>> d = Deadline.after(0.5, start=100.0)
    >>> d.at, d.left(now=100.2) > 0.29, d.passed(now=100.6)
    (100.5, True, True)
    >>> d.check("decoding", now=100.6)
    Traceback (most recent call last):
    ...
    serving.types.DeadlineExceeded: request timed out after 0.5s while decoding ...
    """

    at: float
    timeout_s: float

    @classmethod
    def after(cls, timeout_s: float, start: float | None = None) -> Deadline:
        """``timeout_s`` seconds after ``start`` (a ``perf_counter()``; None: now)."""
        begin = time.perf_counter() if start is None else start
        return cls(begin + timeout_s, timeout_s)

    def left(self, now: float | None = None) -> float:
        """Seconds left, never below 0."""
        return max(0.0, self.at - (time.perf_counter() if now is None else now))

    def passed(self, now: float | None = None) -> bool:
        """Whether the deadline is behind us."""
        return (time.perf_counter() if now is None else now) >= self.at

    def check(self, stage: str, now: float | None = None) -> None:
        """Raise :class:`DeadlineExceeded` naming ``stage`` when the deadline has passed."""
        if self.passed(now):
            raise DeadlineExceeded(self.timeout_s, stage)


@runtime_checkable
class Predictor(Protocol):
    """The model behind the server (read-only properties accept plain attributes too)."""

    @property
    def name(self) -> str:
        """The model name in URLs (``/v2/models/{name}/infer``)."""
        ...

    @property
    def heads(self) -> tuple[str, ...]:
        """Label heads, one output each."""
        ...

    def ready(self) -> bool:
        """False until the parameters are loaded, or while they are catching up."""
        ...

    def predict(self, records: Sequence[bytes]) -> Prediction:
        """Score records (each in the job's own format); raises :class:`BadRecords`.

        A model whose ``predict`` also takes ``deadline: Deadline | None`` (a keyword)
        is given the request's, and stops between its stages once it has passed
        (:class:`DeadlineExceeded`)."""
        ...

    def metadata(self) -> Mapping[str, object]:
        """Extra model metadata (versions etc.); a ``"version"`` key names the model version."""
        ...


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """One entry of a request's ``outputs``: a head, and whether to send it as binary data."""

    name: str
    binary: bool = False


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A checked infer request.

    ``outputs`` is ``None`` when the request named none (every head is sent,
    as binary data when ``binary_output``, the request's ``binary_data_output``).
    ``timeout_s`` (shorter than the server's ``request_timeout_s``) and ``priority``
    come from Triton's request parameters.
    """

    id: str | None
    records: Sequence[bytes]  # a list, or the binary tensor's JoinedPayloads
    outputs: tuple[RequestedOutput, ...] | None = None
    binary_output: bool = False
    timeout_s: float | None = None  # the request's own (Triton's ``timeout`` parameter)
    priority: int = 0  # Triton's: 1 is the highest, 0 the default


@dataclass(frozen=True, slots=True)
class EncodedResponse:
    """A response body; ``header_length`` is the JSON part's length when binary data follows."""

    body: bytes
    header_length: int | None = None

    @property
    def content_type(self) -> str:
        """``application/json``, or ``application/octet-stream`` when binary data follows."""
        return "application/json" if self.header_length is None else "application/octet-stream"
