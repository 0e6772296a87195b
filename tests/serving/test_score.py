"""`streamrec score` and `streamrec evaluate` on files, after a real backfill job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from connectors.codecs import make_codec
from connectors.synthetic import SyntheticConfig, iter_json_lines, write_parquet
from connectors.types import Chunk, RawChunk
from deploy.config import load_config
from embedding_store.shard import StoreShard
from pipeline.batch import build_batch
from tests.support.processes import streamrec
from trainer.checkpoint import CheckpointBook
from trainer.dense_model import DenseModel
from trainer.pooling import pool, to_tensors

pytestmark = pytest.mark.processes


def _trainer_forward(job_path: Path, lines: list[bytes]) -> np.ndarray:
    """The trainer's own forward: its dense state and the shard's rows, restored as a
    resumed job restores them."""
    job = load_config(job_path)
    assert job.features is not None
    book = CheckpointBook(job.run_dir / "checkpoints")
    manifest = book.latest()
    assert manifest is not None
    dims = {n: t.dim for n, t in job.store.tables.items()}
    dense = DenseModel(job.trainer, job.features, dims, torch.device("cpu"))
    dense.load(book.load_dense(manifest)["ranks"][0])
    shard = StoreShard(job.store)
    [seq] = manifest.shard_seqs
    shard.restore_sources([(job.run_dir / "store" / "shard-000", seq)], shard_index=0, num_shards=1)
    spec = job.features.for_scoring()
    raw = RawChunk(Chunk("s", "p", 0, len(lines)), np.arange(len(lines)), lines)
    table, bad = make_codec("json").decode(raw, spec)
    assert not bad
    batch = build_batch(table, spec)
    for name, tb in batch.tables.items():
        # As the trainer's next step reads them: an id never seen gets its initial row.
        tb.rows = shard.lookup({name: tb.unique_ids}, train=True)[name]
    with torch.no_grad():
        bt = to_tensors(batch, spec)
        return torch.sigmoid(dense.module(bt.dense, pool(bt, spec))).numpy()


def test_score_writes_one_probability_per_head_as_the_trainer_computes_it(
    trained: Path, tmp_path: Path
) -> None:
    lines = list(iter_json_lines(SyntheticConfig(seed=9), 300))
    unlabelled = [json.dumps({k: v for k, v in json.loads(x).items() if k != "click"}).encode()
                  for x in lines]  # fmt: skip
    records = tmp_path / "requests.jsonl"
    records.write_bytes(b"\n".join([*unlabelled[:150], b"{not json", *unlabelled[150:]]) + b"\n")
    out = tmp_path / "scores.parquet"
    result = streamrec("score", str(trained), "--from", str(records), "--to", str(out),
                       "--batch", "64")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "300 of 301 records scored" in result.stdout, result.stdout
    assert "100%" in result.stdout
    table = pq.read_table(out)
    assert table.column_names == ["position", "click"]
    positions = table.column("position").to_pylist()
    assert positions == [*range(150), *range(151, 301)]
    want = _trainer_forward(trained, unlabelled)
    np.testing.assert_allclose(table.column("click").to_numpy(), want[:, 0], atol=1e-5)
    [rejected] = [
        json.loads(x) for x in (tmp_path / "scores.parquet.rejected.jsonl").read_text().splitlines()
    ]
    assert (rejected["position"], rejected["reason"]) == (150, "not_json")


def test_evaluate_gives_auc_logloss_and_calibration_on_a_parquet_file(
    trained: Path, tmp_path: Path
) -> None:
    # The same stream (seed) as the training, another partition: events never learned.
    held_out = write_parquet(tmp_path / "held_out.parquet", SyntheticConfig(seed=2), 2000, 1000, 1)
    # One row without its label: left out and counted, not scored as 0 or 1.
    t = pq.read_table(held_out)
    clicks = t.column("click").to_pylist()
    clicks[0] = None
    pq.write_table(t.set_column(t.schema.get_field_index("click"), "click", pa.array(clicks)),
                   held_out)  # fmt: skip
    figures = tmp_path / "eval.json"
    result = streamrec("evaluate", str(trained), "--from", str(held_out), "--json", str(figures))
    assert result.returncode == 0, result.stdout + result.stderr
    body: dict[str, Any] = json.loads(figures.read_text())
    click = body["heads"]["click"]
    assert click["samples"] == 1999
    assert 0.5 < click["auc"] < 1.0, click
    assert 0.0 < click["logloss"] < 1.0
    assert 0.5 < click["calibration"] < 2.0
    assert body["bad"] == {"null_label": 1}
    assert f"click: AUC {click['auc']:.4f}" in result.stdout


def test_score_names_a_checkpoint_that_is_not_there(trained: Path, tmp_path: Path) -> None:
    records = tmp_path / "r.jsonl"
    records.write_text("{}\n")
    result = streamrec("score", str(trained), "--from", str(records), "--to",
                       str(tmp_path / "o.parquet"), "--checkpoint", "99999")  # fmt: skip
    assert result.returncode == 2
    assert "--checkpoint 99999: no such checkpoint" in result.stderr
    assert "steps: [" in result.stderr


def test_score_and_evaluate_on_a_dask_cluster_agree_with_one_process(
    trained: Path, tmp_path: Path
) -> None:
    lines = list(iter_json_lines(SyntheticConfig(seed=9), 300))
    records = tmp_path / "requests.jsonl"
    # No newline after the last record: the last part ends with the file.
    records.write_bytes(b"\n".join([*lines[:150], b"{not json", *lines[150:]]))
    here, there = tmp_path / "here.parquet", tmp_path / "there.parquet"
    alone = streamrec("score", str(trained), "--from", str(records), "--to", str(here))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    spread = streamrec("score", str(trained), "--from", str(records), "--to", str(there),
                       "--workers", "2", "--part-records", "70", "--batch", "32")  # fmt: skip
    assert spread.returncode == 0, spread.stdout + spread.stderr
    assert "5 parts on 2 workers" in spread.stdout
    assert "300 of 301 records scored" in spread.stdout
    mine, theirs = pq.read_table(here), pq.read_table(there)
    assert theirs.column("position").equals(mine.column("position"))
    # Other batch sizes: the forward's sums in another order, the same to float32 rounding.
    np.testing.assert_allclose(theirs.column("click"), mine.column("click"), atol=1e-6)
    assert (tmp_path / "there.parquet.rejected.jsonl").read_text() == (
        tmp_path / "here.parquet.rejected.jsonl"
    ).read_text()
    # Parquet parts are whole row groups; evaluate gives the same figures.
    held_out = write_parquet(tmp_path / "held_out.parquet", SyntheticConfig(seed=2), 900, 100, 1)
    assert pq.ParquetFile(held_out).metadata.num_row_groups == 9
    figures = [tmp_path / "one.json", tmp_path / "many.json"]
    for out, extra in zip(figures, ([], ["--workers", "2", "--part-records", "250"]), strict=True):
        result = streamrec("evaluate", str(trained), "--from", str(held_out), "--json",
                           str(out), *extra)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    one, many = (json.loads(f.read_text()) for f in figures)
    assert (many["records"], many["bad"]) == (one["records"], one["bad"]) == (900, {})
    for key, value in one["heads"]["click"].items():
        assert many["heads"]["click"][key] == pytest.approx(value, abs=1e-6), key
