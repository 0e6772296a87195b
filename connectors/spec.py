"""The record schema, ``FeatureSpec``: which fields are labels, dense and sparse features.

A sparse field feeds a named embedding table; several fields may share one.
Validation rejects unknown keys and names the offending field.

The schema lives in ``connectors`` because the connectors are its first users
(codecs decode to it, :mod:`connectors.validate` checks against it, the
synthetic source generates it) and they sit below ``pipeline`` in the package
order.

>>> spec = FeatureSpec.model_validate({
...     "labels": ["click"],
...     "dense": [{"name": "price", "transform": "log1p", "min_value": 0}],
...     "sparse": [
...         {"name": "user", "table": "users"},
...         {"name": "tags", "table": "tags", "type": "list_string", "pooling": "mean"},
...     ],
... })
>>> spec.tables()
{'users': ('user',), 'tags': ('tags',)}
>>> FeatureSpec.model_validate({"labels": ["y"], "sparse": [{"name": "u", "tabel": "t"}]})
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 2 validation errors for FeatureSpec
sparse.0.table
  Field required ...
sparse.0.tabel
  Extra inputs are not permitted ...
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from embedding_store.types import TABLE_NAME_PATTERN

FIELD_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DenseField(_Strict):
    """A numeric feature: missing values are filled, then transformed and clipped.

    A value outside ``[min_value, max_value]`` (before the transform), NaN or
    Inf makes the record bad (dead-lettered), as does a missing value when
    ``fill`` is None.
    """

    name: str = Field(pattern=FIELD_NAME, description="the record's field")
    fill: float | None = Field(0.0, description="a missing value's; None: missing is bad")
    min_value: float | None = Field(None, description="smaller values are bad (before transform)")
    max_value: float | None = Field(None, description="larger values are bad (before transform)")
    transform: Literal["none", "log1p", "signed_log1p"] = Field(
        "none", description="log1p(x), or sign(x) * log1p(|x|)"
    )
    clip_min: float | None = Field(None, description="after the transform, clamp to at least")
    clip_max: float | None = Field(None, description="after the transform, clamp to at most")


class SparseField(_Strict):
    """A categorical feature feeding the embedding table ``table``.

    ``string`` and ``int`` fields are single-hot (a missing value is an empty
    bag); ``list_*`` fields are multi-hot with at most ``max_len`` values (more
    makes the record bad).
    """

    name: str = Field(pattern=FIELD_NAME, description="the record's field")
    table: str = Field(
        pattern=TABLE_NAME_PATTERN.pattern, description="the store table its ids look up"
    )
    type: Literal["string", "int", "list_string", "list_int"] = Field(
        "string", description="one value, or a list of values (multi-hot)"
    )
    pooling: Literal["sum", "mean"] = Field("sum", description="how a bag's rows combine")
    max_len: int = Field(256, ge=1, le=1 << 16, description="list_*: more values are bad")


class FeatureSpec(_Strict):
    """Labels, dense and sparse fields of the records a job trains on."""

    labels: list[str] = Field(min_length=1, description="label fields, one head each")
    dense: list[DenseField] = Field(default_factory=list, description="numeric features")
    sparse: list[SparseField] = Field(default_factory=list, description="categorical features")
    max_record_bytes: int = Field(1 << 20, ge=64, description="larger records are bad")
    labels_required: bool = Field(
        True,
        description="a record without a label is bad; False when records are scored, not "
        "learned (a prediction server's): an absent or null label then reads as NaN",
    )

    def for_scoring(self) -> FeatureSpec:
        """This spec for records that are scored: their labels may be absent.

        >>> FeatureSpec(labels=["y"]).for_scoring().labels_required
        False
        """
        return self.model_copy(update={"labels_required": False})

    def example_record(self) -> dict[str, object]:
        """A record every field of which is present and valid: label 0, each dense value
        its fill (else 0) within its bounds, each sparse value ``"a"``, ``1``, or a bag of
        one of them. For warming up a server's kernels and for example requests.

        >>> FeatureSpec.model_validate({
        ...     "labels": ["y"],
        ...     "dense": [{"name": "age", "min_value": 18}],
        ...     "sparse": [{"name": "u", "table": "t"}, {"name": "c", "table": "t",
        ...                "type": "list_int"}],
        ... }).example_record()
        {'y': 0, 'age': 18.0, 'u': 'a', 'c': [1]}
        """
        record: dict[str, object] = dict.fromkeys(self.labels, 0)
        for d in self.dense:
            value = d.fill if d.fill is not None else 0.0
            if d.min_value is not None:
                value = max(value, d.min_value)
            if d.max_value is not None:
                value = min(value, d.max_value)
            record[d.name] = float(value)
        for s in self.sparse:
            one: object = 1 if s.type.endswith("int") else "a"
            record[s.name] = [one] if s.type.startswith("list") else one
        return record

    @model_validator(mode="after")
    def _unique_names(self) -> FeatureSpec:
        names = [*self.labels, *(d.name for d in self.dense), *(s.name for s in self.sparse)]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                msg = f"field {n!r} is named twice (labels, dense and sparse names must differ)"
                raise ValueError(msg)
            seen.add(n)
        return self

    def tables(self) -> dict[str, tuple[str, ...]]:
        """Each table and the sparse fields that feed it, in spec order."""
        out: dict[str, list[str]] = {}
        for s in self.sparse:
            out.setdefault(s.table, []).append(s.name)
        return {t: tuple(f) for t, f in out.items()}

    def field(self, name: str) -> SparseField:
        """The sparse field called ``name``."""
        for s in self.sparse:
            if s.name == name:
                return s
        msg = f"no sparse field {name!r} (sparse fields: {[s.name for s in self.sparse]})"
        raise KeyError(msg)
