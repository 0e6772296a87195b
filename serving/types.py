"""The types a prediction server and the model behind it share.

>>> err = RecordError(index=2, field="user", reason="sparse_wrong_type", detail="...")
>>> str(BadRecords([err]))
"record 2: field 'user': sparse_wrong_type (...)"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class RecordError:
    """One bad record of a request: its index, the field at fault and the reason."""

    index: int
    field: str | None
    reason: str  # the dead-letter reasons: "not_json", "sparse_wrong_type", ...
    detail: str


class BadRecords(ValueError):
    """A request's records that cannot be scored (every one, in request order)."""

    def __init__(self, errors: Sequence[RecordError]) -> None:
        self.errors = list(errors)
        first = self.errors[0]
        where = f"field {first.field!r}: " if first.field else ""
        more = f" and {len(self.errors) - 1} more" if len(self.errors) > 1 else ""
        super().__init__(f"record {first.index}: {where}{first.reason} ({first.detail}){more}")


@dataclass(frozen=True)
class Prediction:
    """One probability per record for each label head, and the versions that made them."""

    probabilities: Mapping[str, npt.NDArray[np.float32]]
    parameters: Mapping[str, int | float | str]


class Predictor(Protocol):
    """What a prediction server serves."""

    name: str
    heads: tuple[str, ...]

    def ready(self) -> bool: ...

    def predict(self, records: Sequence[bytes]) -> Prediction: ...

    def metadata(self) -> Mapping[str, object]: ...
