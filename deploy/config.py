"""The job configuration: one schema, loaded from one YAML file.

Every section rejects unknown keys, and a validation error names the field
path and the offending value.

>>> cfg = JobConfig.model_validate({"store": {"tables": {"user": {"dim": 8}}}})
>>> cfg.store.tables["user"].dim
8
>>> JobConfig.model_validate({"store": {"tables": {"user": {"dim": 0}}}})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for JobConfig
store.tables.user.dim
  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, ...
...
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from embedding_store.types import StoreConfig


class ConfigError(ValueError):
    """A job YAML file that cannot be read or does not validate."""


class JobConfig(BaseModel):
    """A streamrec job. Sections are added as the system grows; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: StoreConfig


def load_config(path: Path | str) -> JobConfig:
    """Read and validate a job YAML file; errors name the file, the field and the value."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        msg = f"{p}: cannot read the job config ({exc.strerror})"
        raise ConfigError(msg) from exc
    except yaml.YAMLError as exc:
        msg = f"{p}: not valid YAML ({exc})"
        raise ConfigError(msg) from exc
    if not isinstance(raw, dict):
        msg = f"{p}: expected a mapping at the top level, got {type(raw).__name__}"
        raise ConfigError(msg)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{p}: invalid job config"]
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("\n".join(lines)) from exc
