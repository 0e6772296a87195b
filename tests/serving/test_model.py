"""The serving model against the trainer's own forward, and published dense versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from connectors.codecs import make_codec
from connectors.codecs.joined import JoinedPayloads
from connectors.spec import FeatureSpec
from connectors.types import Chunk, RawChunk
from embedding_store.client import StoreClient
from embedding_store.location import Location
from embedding_store.replica import ShardFollower
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from pipeline.batch import build_batch
from serving.model import DenseFollower, ServingModel
from serving.oip import decode_bytes_tensor, encode_bytes_tensor
from serving.replicas import StoreRows
from serving.types import BadRecords
from trainer.config import TrainerConfig
from trainer.dense_model import DenseModel
from trainer.pooling import pool, to_tensors
from trainer.publish import DensePublisher, published

SPEC = FeatureSpec.model_validate(
    {
        "labels": ["click", "like"],
        "dense": [{"name": "price"}],
        "sparse": [
            {"name": "user", "table": "users"},
            {"name": "tags", "table": "tags", "type": "list_string", "pooling": "mean"},
        ],
    }
)
STORE = StoreConfig(
    tables={
        "users": {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.5}},
        "tags": {"dim": 3, "optimizer": {"kind": "sgd", "lr": 0.5}},
    }
)
RECORDS = [
    b'{"user": "u1", "price": 2.5, "tags": ["a", "b"]}',
    b'{"user": "u2", "price": 0.5, "tags": []}',
    b'{"user": "u1", "price": 1.0, "tags": ["c"], "click": 1}',
]


def _trainer_forward(dense: DenseModel, training: StoreShard, records: list[bytes]) -> np.ndarray:
    """What the trainer computes for these records: its batch, its rows, its module."""
    n = len(records)
    raw = RawChunk(Chunk("s", "p", 0, n), np.arange(n), records)
    table, bad = make_codec("json").decode(raw, SPEC.for_scoring())
    assert not bad
    batch = build_batch(table, SPEC.for_scoring())
    for name, tb in batch.tables.items():
        tb.rows = training.peek({name: tb.unique_ids})[name].weights
    with torch.no_grad():
        bt = to_tensors(batch, SPEC)
        return torch.sigmoid(dense.module(bt.dense, pool(bt, SPEC))).numpy()


def test_serving_agrees_with_the_trainers_forward_and_follows_new_versions(
    tmp_path: Path,
) -> None:
    config = TrainerConfig()
    training = StoreShard(STORE)
    replica = StoreShard(STORE, read_only=True)
    follower = ShardFollower(replica, training)
    dims = {n: t.dim for n, t in STORE.tables.items()}
    dense = DenseModel(config, SPEC, dims, torch.device("cpu"))
    where = Location.parse(tmp_path / "serving")
    publisher = DensePublisher(where, every_s=0.0)
    dense_follower = DenseFollower(where, config, SPEC, dims)
    with StoreClient.from_shards([replica]) as rows:
        model = ServingModel("m", SPEC, make_codec("json"), rows, dense_follower)
        assert not model.ready()
        publisher.maybe_publish(step=3, samples=30, module=dense.module)
        publisher.close()
        assert dense_follower.refresh()
        assert model.ready()

        # Learn the records' rows on the training shard; the replica follows.
        n = len(RECORDS)
        raw = RawChunk(Chunk("s", "p", 0, n), np.arange(n), RECORDS)
        batch = build_batch(
            make_codec("json").decode(raw, SPEC.for_scoring())[0], SPEC.for_scoring()
        )
        for name, tb in batch.tables.items():
            training.lookup({name: tb.unique_ids})
            grads = np.ones((tb.unique_ids.shape[0], STORE.tables[name].dim), np.float32)
            training.push({name: (tb.unique_ids, grads * 0.3)})
        assert follower.sync_once()

        got = model.predict(RECORDS)
        want = _trainer_forward(dense, training, RECORDS)
        for j, head in enumerate(SPEC.labels):
            np.testing.assert_allclose(got.probabilities[head], want[:, j], atol=1e-5)
        assert got.parameters["dense_version"] == 1
        assert got.parameters["dense_step"] == 3
        assert got.parameters["samples_learned"] == 30

        # A newer version is swapped in whole; an older one never comes back.
        with torch.no_grad():
            for p in dense.module.parameters():
                p.add_(0.1)
        publisher = DensePublisher(where, every_s=0.0)
        publisher.maybe_publish(step=9, samples=90, module=dense.module)
        publisher.close()
        assert dense_follower.refresh()
        after = model.predict(RECORDS)
        assert after.parameters["dense_version"] == 2
        want = _trainer_forward(dense, training, RECORDS)
        np.testing.assert_allclose(after.probabilities["click"], want[:, 0], atol=1e-5)
        assert not np.allclose(after.probabilities["click"], got.probabilities["click"])
        assert [d.version for d in published(where)] == [1, 2]


def _one_published_version(
    tmp_path: Path, spec: FeatureSpec = SPEC, store: StoreConfig = STORE
) -> DenseFollower:
    """A follower of a location where one version of a fresh dense network is published."""
    config = TrainerConfig()
    dims = {n: t.dim for n, t in store.tables.items()}
    dense = DenseModel(config, spec, dims, torch.device("cpu"))
    where = Location.parse(tmp_path / "serving")
    publisher = DensePublisher(where, every_s=0.0)
    publisher.maybe_publish(step=1, samples=1, module=dense.module)
    publisher.close()
    follower = DenseFollower(where, config, spec, dims)
    assert follower.refresh()
    return follower


def test_bad_records_name_their_index_field_and_reason(tmp_path: Path) -> None:
    follower = _one_published_version(tmp_path)
    bad = [RECORDS[0], b'{"user": 5}', b"{not json", b"", b'{"user": "\xff"}']
    with StoreClient.from_shards([StoreShard(STORE, read_only=True)]) as rows:
        model = ServingModel("m", SPEC, make_codec("json"), rows, follower)
        # As a list, joined, and where a binary tensor's records lie (length prefixes
        # between them).
        tensor = encode_bytes_tensor(bad)
        for records in (bad, JoinedPayloads.of(bad), decode_bytes_tensor(tensor, 5, "in")):
            with pytest.raises(BadRecords) as caught:
                model.predict(records)
            assert [(e.index, e.field, e.reason) for e in caught.value.errors] == [
                (1, "user", "sparse_wrong_type"),
                (2, None, "not_json"),
                (3, None, "empty_payload"),
                (4, None, "not_utf8"),
            ]


def test_one_record_at_a_time_scores_as_the_whole_request_does(tmp_path: Path) -> None:
    """Small requests take the plain path, large ones the columnar: the same answers."""
    follower = _one_published_version(tmp_path)
    shard = StoreShard(STORE)
    records = [
        json.dumps(
            {"user": f"u{i % 7}", "price": i / 3, "tags": [f"t{j}" for j in range(i % 4)]}
        ).encode()
        for i in range(100)
    ]
    for name, tb in build_batch(
        make_codec("json").decode(
            RawChunk(Chunk("s", "p", 0, 100), np.arange(100), records), SPEC.for_scoring()
        )[0],
        SPEC.for_scoring(),
    ).tables.items():
        shard.lookup({name: tb.unique_ids})  # learned rows, not initial values
        grads = np.full((tb.unique_ids.shape[0], STORE.tables[name].dim), 0.2, np.float32)
        shard.push({name: (tb.unique_ids, grads)})
    with StoreClient.from_shards([shard]) as rows:
        model = ServingModel("m", SPEC, make_codec("json"), rows, follower)
        assert len(records) > model.plain_max_records
        whole = model.predict(records).probabilities  # the columnar path
        # Trailing blanks, and records where a binary tensor's lie: the same answers.
        padded = [r + b" \t" * (i % 3) for i, r in enumerate(records)]
        for same in (
            JoinedPayloads.of(records),
            JoinedPayloads.of(padded),
            decode_bytes_tensor(encode_bytes_tensor(padded), len(padded), "inputs[0]"),
        ):
            joined = model.predict(same).probabilities
            for head in SPEC.labels:
                np.testing.assert_array_equal(joined[head], whole[head])
        alone = [model.predict([r]).probabilities for r in records]  # the plain path
        for head in SPEC.labels:
            np.testing.assert_allclose(
                np.concatenate([a[head] for a in alone]), whole[head], rtol=0, atol=1e-6
            )
        # A bad record in a small request still gets the columnar path's verdict.
        with pytest.raises(BadRecords) as caught:
            model.predict([records[0], b'{"user": 5}'])
        assert [(e.index, e.field, e.reason) for e in caught.value.errors] == [
            (1, "user", "sparse_wrong_type")
        ]


def test_a_publisher_started_again_counts_on_from_the_newest_version(tmp_path: Path) -> None:
    where = Location.parse(tmp_path)
    module = torch.nn.Linear(2, 1)
    for step in (5, 6):
        publisher = DensePublisher(where, every_s=0.0, keep=1)
        assert publisher.maybe_publish(step=step, samples=step, module=module)
        publisher.close()
    [only] = published(where)
    assert (only.version, only.step) == (2, 6)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["DENSE-000000000002.json", "dense-000000000002.pt"], names
    assert json.loads((tmp_path / names[0]).read_text())["file"] == names[1]


def test_two_publishers_into_one_place_never_reuse_a_version(tmp_path: Path) -> None:
    where = Location.parse(tmp_path)
    first = DensePublisher(where, every_s=0.0)
    second = DensePublisher(where, every_s=0.0)  # made before the first published
    for step, publisher in enumerate([first, second, first, second]):
        publisher.maybe_publish(step=step, samples=step, module=torch.nn.Linear(2, 1), force=True)
        publisher.flush()  # one after the other
    first.close()
    second.close()
    assert [(d.version, d.step) for d in published(where)][-3:] == [(2, 1), (3, 2), (4, 3)]


def test_a_version_collected_between_listing_and_reading_is_skipped(tmp_path: Path) -> None:
    """The publisher deletes old versions while a server lists them: not an error."""
    where = Location.parse(tmp_path)
    publisher = DensePublisher(where, every_s=0.0)
    for step in range(2):
        publisher.maybe_publish(step=step, samples=step, module=torch.nn.Linear(2, 1), force=True)
        publisher.flush()
    publisher.close()

    class Collecting:
        """The folder as listed, with the oldest manifest gone before it is read."""

        def names(self) -> list[str]:
            return where.names()

        def read_bytes(self, name: str) -> bytes:
            if name == "DENSE-000000000001.json":
                raise FileNotFoundError(name)
            return where.read_bytes(name)

    assert [d.version for d in published(Collecting())] == [2]  # type: ignore[arg-type]


class _TableByTable:
    """The same replicas read only through ``lookup``: the per-table path."""

    def __init__(self, rows: object) -> None:
        self._rows = rows

    def lookup(self, ids: object, *, train: bool = False) -> object:
        return self._rows.lookup(ids, train=train)  # type: ignore[attr-defined]


class _Flat(_TableByTable):
    """The same replicas with their flat read too, counted."""

    flat_reads = 0

    def read_flat(self, *args: object) -> object:
        self.flat_reads += 1
        return self._rows.read_flat(*args)  # type: ignore[attr-defined]


class _CountedStoreRows(StoreRows):
    flat_reads = 0

    def read_flat(self, *args: Any) -> Any:
        self.flat_reads += 1
        return super().read_flat(*args)


@pytest.mark.parametrize("row_dtype", ["float32", "float16"])
def test_the_flat_path_scores_as_the_per_table_path_bit_for_bit(
    tmp_path: Path, row_dtype: str
) -> None:
    """Replicas of one dim take the flat path (one read, one kernel for the model's
    input); it must give the per-table path's answer exactly, over two shards, sum and
    mean pools, lists and fields that share a table."""
    from serving.replicas import LocalReplicas

    spec = FeatureSpec.model_validate(
        {
            "labels": ["click"],
            "dense": [{"name": "price", "transform": "log1p"}],
            "sparse": [
                {"name": "user", "table": "ids"},
                {"name": "item", "table": "ids", "type": "int"},
                {"name": "tags", "table": "tags", "type": "list_string", "pooling": "mean"},
                {"name": "cats", "table": "cats", "type": "list_int"},
            ],
        }
    )
    sgd = {"kind": "sgd", "lr": 0.5}
    store = StoreConfig(
        tables={name: {"dim": 4, "optimizer": sgd} for name in ("ids", "tags", "cats")},
        row_dtype=row_dtype,
    )
    training = [StoreShard(store), StoreShard(store)]
    rng = np.random.default_rng(3)
    records = [
        json.dumps(
            {
                "user": f"u{rng.integers(20)}",
                "item": int(rng.integers(-50, 50)),
                "price": float(rng.integers(0, 9)),
                "tags": [f"t{x}" for x in rng.integers(0, 9, rng.integers(0, 4))],
                "cats": [int(x) for x in rng.integers(0, 30, rng.integers(0, 3))],
            }
        ).encode()
        for _ in range(70)
    ]
    with StoreClient.from_shards(training) as trainer:
        raw = RawChunk(Chunk("s", "p", 0, 40), np.arange(40), records[:40])
        scoring = spec.for_scoring()
        batch = build_batch(make_codec("json").decode(raw, scoring)[0], scoring)
        for name, tb in batch.tables.items():  # rows learned for some ids, initial for others
            trainer.lookup({name: tb.unique_ids})
            trainer.push({name: (tb.unique_ids, rng.normal(size=(len(tb.unique_ids), 4)))})
    replicas = LocalReplicas(store, training, poll_s=0.02)
    try:
        assert replicas.wait_caught_up(timeout_s=30)
        follower = _one_published_version(tmp_path, spec, store)
        codec = make_codec("json")
        flat_rows = _Flat(replicas.rows)
        flat = ServingModel("m", spec, codec, flat_rows, follower)
        by_table = ServingModel("m", spec, codec, _TableByTable(replicas.rows), follower)
        # The flat read of a store client (replicas in processes of their own), here
        # over the replicas above.
        client = StoreClient.from_shards(replicas.rows.shards)
        client_rows = _CountedStoreRows(client)
        via_client = ServingModel("m", spec, codec, client_rows, follower)
        for size in (1, 2, 17, 70):
            request = records[:size]
            got = flat.predict(request).probabilities["click"]
            want = by_table.predict(request).probabilities["click"]
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(via_client.predict(request).probabilities["click"], want)
        assert flat_rows.flat_reads == 4  # every request took the flat path
        assert client_rows.flat_reads == 4
    finally:
        replicas.close()


@pytest.mark.parametrize(
    ("codec", "paths"),
    [("json", ("scan", "plain", "columns")), ("criteo_tsv", ("columns",)),
     ("arrow", ("columns",))],
)  # fmt: skip
def test_the_warm_up_scores_an_example_record_by_every_path_of_its_codec(
    tmp_path: Path, codec: str, paths: tuple[str, ...]
) -> None:
    """Every field type the codec reads, and dense fields whose bounds exclude the fill:
    the example record is good, so each path runs its kernels to the end."""
    spec = FeatureSpec.model_validate(
        {
            "labels": ["click"],
            "dense": [{"name": "price", "min_value": 1.0, "transform": "log1p"},
                      {"name": "age", "fill": None, "max_value": -2.0}],
            "sparse": [
                {"name": "user", "table": "users"},
                {"name": "n", "table": "users", "type": "int"},
                {"name": "tags", "table": "tags", "type": "list_string", "pooling": "mean"},
                {"name": "ns", "table": "tags", "type": "list_int"},
            ],
        }
    )  # fmt: skip
    if codec == "criteo_tsv":  # a TSV column holds one value: no bags
        spec = spec.model_copy(update={"sparse": spec.sparse[:2]})
    follower = _one_published_version(tmp_path, spec)
    with StoreClient.from_shards([StoreShard(STORE, read_only=True)]) as rows:
        model = ServingModel("m", spec, make_codec(codec), rows, follower)
        assert model.warm_up() == paths
