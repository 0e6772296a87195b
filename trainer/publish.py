"""Dense weights published for prediction servers while the job trains.

Rank 0 writes its dense network's weights every ``serving.publish_every_s``
into the serving location: ``dense-<version>.pt`` first, then the small
``DENSE-<version>.json`` that names it, so a server that lists the JSON files
never finds one whose weights are not whole. Versions count up across the
job's restarts (a new publisher starts after the newest it finds), so a
server that only ever swaps to a newer version never goes back, even when the
job rolled back to an older checkpoint. Serialising and uploading run on a
thread of their own: the step only pays for copying the weights.

>>> import tempfile, torch
>>> where = tempfile.mkdtemp()
>>> pub = DensePublisher(where, every_s=0.0)
>>> pub.maybe_publish(step=7, samples=70, module=torch.nn.Linear(2, 1))
True
>>> pub.close()
>>> [(d.version, d.step, d.samples) for d in published(Location.parse(where))]
[(1, 7, 70)]
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from embedding_store.errors import CheckpointError
from embedding_store.location import Location

log = logging.getLogger(__name__)

_MANIFEST = re.compile(r"^DENSE-(\d{12})\.json$")


@dataclass(frozen=True)
class PublishedDense:
    """One published version of the dense weights."""

    version: int
    step: int  # the trainer's step when it was published
    samples: int  # samples the model had learned
    file: str  # the weights, next to the manifest
    created: float  # wall time of the publish


def published(location: Location) -> list[PublishedDense]:
    """The versions in ``location``, oldest first (only whole ones are listed)."""
    out = []
    for name in sorted(n for n in location.names() if _MANIFEST.match(n)):
        try:
            out.append(PublishedDense(**json.loads(location.read_bytes(name))))
        except FileNotFoundError:
            continue  # collected by the publisher since it was listed: an older version
        except (CheckpointError, OSError, ValueError, TypeError) as exc:
            log.warning("skipping unreadable %s/%s: %s", location, name, exc)
    return out


def load_weights(location: Location, entry: PublishedDense) -> dict[str, torch.Tensor]:
    """The state dict of one published version."""
    data = location.read_bytes(entry.file)
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        msg = f"{location}/{entry.file}: expected a state dict, got {type(state).__name__}"
        raise CheckpointError(msg)
    return state


class DensePublisher:
    """Publishes a module's weights every ``every_s`` seconds, keeping the newest ``keep``."""

    def __init__(self, where: Location | Path | str, *, every_s: float, keep: int = 3) -> None:
        self.location = where if isinstance(where, Location) else Location.parse(where)
        self.every_s = every_s
        self.keep = max(1, keep)
        existing = published(self.location)
        self.version = existing[-1].version if existing else 0
        self._last = float("-inf")
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="streamrec-publish")
        self._pending: cf.Future[None] | None = None
        self.failures = 0
        self.step = -1  # of the newest version published by this publisher

    def maybe_publish(
        self, *, step: int, samples: int, module: torch.nn.Module, force: bool = False
    ) -> bool:
        """Publish now when ``every_s`` has passed and the previous one is written.

        ``force``: publish in any case, after the one in flight (the job's last state).
        """
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return False
        if self._pending is not None and not self._pending.done():
            if not force:
                return False  # a slow store: skip, never queue up copies of the weights
            self._pending.result()
        self._last = now
        self.step = step
        state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        self._pending = self._pool.submit(self._write, step, samples, time.time(), state)
        return True

    def _write(self, step: int, samples: int, created: float, state: dict[str, Any]) -> None:
        try:
            # After the newest there, whoever wrote it: a second publisher into the same
            # place (a job restarted while its old rank 0 still writes) never reuses one.
            newest = published(self.location)
            self.version = max(self.version, newest[-1].version if newest else 0) + 1
            entry = PublishedDense(
                version=self.version,
                step=step,
                samples=samples,
                file=f"dense-{self.version:012d}.pt",
                created=created,
            )
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self.location.write_bytes(entry.file, buffer.getvalue())
            body = json.dumps(asdict(entry), sort_keys=True).encode()
            self.location.write_bytes(f"DENSE-{entry.version:012d}.json", body)
            for old in published(self.location)[: -self.keep]:
                # The manifest first: a server never finds one whose weights are gone.
                self.location.delete(f"DENSE-{old.version:012d}.json")
                self.location.delete(old.file)
        except (OSError, CheckpointError) as exc:
            self.failures += 1
            log.warning("publishing the dense weights of step %d failed: %s", step, exc)

    def flush(self) -> None:
        """Wait until the publish in flight is written (or has failed)."""
        if self._pending is not None:
            self._pending.result()

    def close(self) -> None:
        """Wait for the publish in flight."""
        self._pool.shutdown(wait=True)
