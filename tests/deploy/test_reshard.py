"""`streamrec store reshard`: a job checkpointed on 2 shards goes on with 3, losing nothing.

Real processes throughout: `streamrec run` with its own shard processes, the
reshard command, then `streamrec run` again with one shard more. The oracle is
the checkpoint files themselves: the rows of the old shards' checkpoints
(each at the seq the job manifest named) must be exactly the rows of the new
shards', each on the shard a client routes its id to.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from connectors.synthetic import synthetic_store_section
from embedding_store import persistence
from embedding_store.hashing import shard_of
from tests.support.jobs import write_synthetic_job
from tests.support.processes import streamrec
from trainer.checkpoint import CheckpointBook
from trainer.ledger import learned_ranges

pytestmark = pytest.mark.processes


def rows_at(directory: Path, seq: int) -> dict[str, dict[int, np.ndarray]]:
    """table -> id -> weights of the checkpoint ``seq`` in ``directory``."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for manifest in persistence.plan_restore(directory, seq):
        for name, info in manifest.tables.items():
            table = out.setdefault(name, {})
            for f in info["files"]:
                path = manifest.directory / f["path"]
                if f["role"] == "tombstones":
                    for i in persistence.read_tombstones(path).tolist():
                        table.pop(int(i), None)
                    continue
                rows = persistence.read_rows(path, info["dim"], info["state_width"])
                for i, w in zip(rows.ids.tolist(), rows.weights, strict=True):
                    table[int(i)] = w
    return out


def test_a_job_on_two_shards_goes_on_with_three_after_a_reshard(tmp_path: Path) -> None:
    job = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4),
        source={"kind": "synthetic", "seed": 5, "partitions": 2, "events": 1000},
        trainer={
            "batch_size": 100,
            "model": {"kind": "ffnn", "hidden": [16]},
            "torch_threads": 1,
            "checkpoint": {"every_steps": 4, "every_s": None},
        },
        cluster={"workers": 1, "store_shards": 2, "dashboard_address": ":0"},
    )
    run_dir = tmp_path / "run"
    first = streamrec("run", str(job), "--max-events", "1200")
    assert first.returncode == 0, first.stdout + first.stderr
    book = CheckpointBook(run_dir / "checkpoints")
    old = book.latest()
    assert old is not None
    assert old.samples == 1200
    assert len(old.shard_seqs) == 2
    store = run_dir / "store"
    before = [rows_at(store / f"shard-{i:03d}", seq) for i, seq in enumerate(old.shard_seqs)]

    olds = [str(store / f"shard-{i:03d}") for i in range(2)]
    news = [str(store / f"shard-{i:03d}") for i in range(3)]  # in place, one more
    out = streamrec("store", "reshard", "--config", str(job), "--from", *olds, "--to", *news)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "now names 3 shards" in out.stdout
    new = book.latest()
    assert new is not None
    assert (new.step, new.samples, new.positions) == (old.step, old.samples, old.positions)
    assert len(new.shard_seqs) == 3
    after = [rows_at(store / f"shard-{j:03d}", seq) for j, seq in enumerate(new.shard_seqs)]

    tables = set(before[0]) | set(before[1])
    assert tables
    for name in tables:
        want = {**before[0].get(name, {}), **before[1].get(name, {})}
        got: dict[int, np.ndarray] = {}
        for j, shard in enumerate(after):
            ids = np.array(list(shard.get(name, {})), dtype=np.uint64)
            assert (shard_of(ids, 3) == j).all(), f"{name}: a row on the wrong shard {j}"
            got.update(shard.get(name, {}))
        assert set(got) == set(want), name
        for i, w in want.items():
            np.testing.assert_array_equal(got[i], w)
    assert all(after), "every new shard holds rows"

    # The job goes on with three shards from where it stopped.
    raw = yaml.safe_load(job.read_text())
    raw["cluster"]["store_shards"] = 3
    job.write_text(yaml.safe_dump(raw))
    second = streamrec("run", str(job), "--max-events", "800")
    assert second.returncode == 0, second.stdout + second.stderr
    final = book.latest()
    assert final is not None
    assert final.samples == 2000
    assert len(final.shard_seqs) == 3
    for partition, spans in learned_ranges(run_dir / "learned-rank0.log").items():
        assert spans[0][0] == 0, partition
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (partition, spans)
        assert spans[-1][1] == 1000, (partition, spans)


def test_reshard_says_what_is_missing(tmp_path: Path) -> None:
    job = write_synthetic_job(tmp_path, store=synthetic_store_section(dim=4))
    out = streamrec("store", "reshard", "--config", str(job), "--from", "a", "--to", "b", "c")
    assert out.returncode == 1
    assert "no job checkpoint to reshard" in out.stderr
    assert "Traceback" not in out.stderr
