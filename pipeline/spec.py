"""The record schema, re-exported from :mod:`connectors.spec`, where it lives.

``FeatureSpec`` and its field types moved down to ``connectors`` (the codecs,
the validation and the synthetic source read it, and ``connectors`` sits below
``pipeline``); the names stay importable from here.

>>> from connectors.spec import FeatureSpec as Moved
>>> FeatureSpec is Moved
True
"""

from __future__ import annotations

from connectors.spec import FIELD_NAME, DenseField, FeatureSpec, SparseField

__all__ = ["FIELD_NAME", "DenseField", "FeatureSpec", "SparseField"]
