"""`streamrec serve` as a user runs it: a training shard, a replica, the server, tritonclient.

Real processes throughout: the shard restores the trained job's checkpoint, a
serving replica follows it, and ``streamrec serve`` reads rows from the
replica and the dense weights the job published.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import tritonclient.http as triton
import yaml
from tritonclient.utils import InferenceServerException

from connectors.codecs import make_codec
from connectors.synthetic import SyntheticConfig, iter_json_lines
from connectors.types import Chunk, RawChunk
from deploy.config import load_config
from deploy.job import serving_location
from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from pipeline.batch import build_batch
from serving.model import DenseFollower
from tests.serving.server import Server
from tests.support.processes import streamrec
from tests.support.waits import wait_until
from trainer.publish import DensePublisher, published

pytestmark = pytest.mark.processes


def _with_follow_poll(job: Path, poll_s: float, out: Path) -> Path:
    """``job`` written to ``out`` with its ``serving.follow_poll_s`` set to ``poll_s``."""
    raw = yaml.safe_load(job.read_text())
    raw.setdefault("serving", {})["follow_poll_s"] = poll_s
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.fixture(params=["replica", "follow"])
def services(
    trained: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ShardProcess, Server]]:
    """The training shard and a server that reads its rows from a replica process
    (``--store``), or follows the shard itself (``--follow``, every 0.05 s as the
    job's ``serving.follow_poll_s`` says)."""
    job = load_config(trained)
    token_file = job.run_dir / "store.token"
    shard_dir = job.run_dir / "store" / "shard-000"
    training = ShardProcess.start(trained, shard_dir, token_file=token_file)
    replica = None
    served_job = trained
    if request.param == "replica":
        replica = ShardProcess.start(
            trained, tmp_path / "replica", token_file=token_file, follow=training.address,
            snapshots=str(shard_dir),
        )  # fmt: skip
        rows = ["--store", f"grpc://{replica.address}"]
    else:
        rows = ["--follow", f"grpc://{training.address}"]
        served_job = _with_follow_poll(trained, 0.05, tmp_path / "follow.yaml")
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(served_job), "--port", "0", *rows,
            "--store-token-file", str(token_file)]  # fmt: skip
    where = serving_location(job)
    before = set(where.names())
    server = Server(argv, tmp_path / "serve.log")
    try:
        yield training, server
    finally:
        server.stop()
        for name in set(where.names()) - before:  # the next test serves the job's own
            where.delete(name)
        if replica is not None:
            replica.kill()
        training.kill()  # no checkpoint: the trained job's shard folder stays as it was


def _records(n: int, seed: int = 9) -> list[bytes]:
    out = []
    for line in iter_json_lines(SyntheticConfig(seed=seed), n):
        record = json.loads(line)
        record.pop("click")
        out.append(json.dumps(record).encode())
    return out


def _infer(client: triton.InferenceServerClient, records: list[bytes], binary: bool = False):  # type: ignore[no-untyped-def]
    inp = triton.InferInput("records", [len(records)], "BYTES")
    inp.set_data_from_numpy(np.array(records, dtype=np.object_), binary_data=binary)
    out = triton.InferRequestedOutput("click", binary_data=binary)
    return client.infer("streamrec", [inp], outputs=[out])


def test_serve_answers_as_score_does_and_follows_training(
    trained: Path, services: tuple[ShardProcess, Server], tmp_path: Path
) -> None:
    training, server = services
    client = triton.InferenceServerClient(server.address)
    wait_until(client.is_server_ready, "ready")
    assert client.is_server_live()
    assert client.is_model_ready("streamrec")
    meta = client.get_model_metadata("streamrec")
    assert [o["name"] for o in meta["outputs"]] == ["click"]

    records = _records(200)
    served = _infer(client, records)
    params = served.get_response()["parameters"]
    job = load_config(trained)
    newest = published(serving_location(job))[-1]
    assert params["dense_version"] == newest.version
    assert params["samples_learned"] == 3000
    # The rows' version: the Unix milliseconds up to which the replica was current.
    assert abs(params["sparse_version"] / 1000 - time.time()) < 60

    # `streamrec score` with the job's last checkpoint: the same rows and weights (the
    # job publishes its last weights when it ends), so the same answers.
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"\n".join(records) + b"\n")
    scored = streamrec("score", str(trained), "--from", str(requests), "--to",
                       str(tmp_path / "s.parquet"))  # fmt: skip
    assert scored.returncode == 0, scored.stdout + scored.stderr
    offline = pq.read_table(tmp_path / "s.parquet").column("click").to_numpy()
    np.testing.assert_allclose(served.as_numpy("click"), offline, atol=1e-5)
    # The binary tensor extension (tritonclient's default) gives the same answers.
    np.testing.assert_allclose(_infer(client, records, binary=True).as_numpy("click"), offline,
                               atol=1e-6)  # fmt: skip

    # A bad record: 400 naming its index, field and reason; the server goes on.
    with pytest.raises(InferenceServerException) as caught:
        _infer(client, [records[0], b'{"I1": "many"}'])
    message = str(caught.value)
    assert message.startswith("[400] bad record at index 1"), message
    assert 'field "I1": dense_wrong_type' in message
    assert client.is_server_ready()

    # Training moves a row: the replica follows the shard, the server answers with it.
    token = (job.run_dir / "store.token").read_text().strip()
    before = served.as_numpy("click")
    assert job.features is not None
    spec = job.features.for_scoring()
    raw = RawChunk(Chunk("s", "p", 0, 1), np.arange(1), records[:1])
    batch = build_batch(make_codec("json").decode(raw, spec)[0], spec)  # the trainer's ids
    with StoreClient.connect(f"grpc://{training.address}", token=token) as store:
        for table, tb in batch.tables.items():
            store.lookup({table: tb.unique_ids})  # as a training step does: rows are made
            grads = np.full((tb.unique_ids.shape[0], job.store.tables[table].dim), 50.0)
            store.push({table: (tb.unique_ids, grads.astype(np.float32))})

    def moved() -> bool:
        now = _infer(client, records[:1]).as_numpy("click")
        return not np.isclose(now[0], before[0], atol=1e-6)

    wait_until(moved, "a pushed row served")
    if "--follow" in server.argv:  # the job's poll, not the default, reached the followers
        assert f"following grpc://{training.address} every 0.05s" in server.log()

    # A new dense version is published: swapped in, and named in the answers.
    dims = {n: t.dim for n, t in job.store.tables.items()}
    assert job.features is not None
    follower = DenseFollower(serving_location(job), job.trainer, job.features, dims)
    assert follower.refresh()
    assert follower.current is not None
    module = follower.current.module
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)
    publisher = DensePublisher(serving_location(job), every_s=0.0)
    publisher.maybe_publish(step=newest.step + 1, samples=3001, module=module)
    publisher.close()

    def swapped() -> bool:
        response = _infer(client, records[:1]).get_response()
        return bool(response["parameters"]["dense_version"] == newest.version + 1)

    wait_until(swapped, "the new dense version served")
    with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert "streamrec_serve_records_scored_total" in metrics
    assert f"streamrec_serve_dense_version {float(newest.version + 1)}" in metrics
    [age] = re.findall(r"^streamrec_serve_sparse_age_seconds (\S+)$", metrics, re.M)
    assert 0.0 <= float(age) < 60
    assert server.stop() == 0
    assert "stopped" in server.log()


def test_serve_without_a_store_says_what_to_give(trained: Path) -> None:
    out = streamrec("serve", str(trained), "--port", "0")
    assert out.returncode == 2
    assert "--store grpc://HOST:PORT" in out.stderr
    both = streamrec("serve", str(trained), "--store", "grpc://a:1", "--follow", "grpc://b:2")
    assert both.returncode == 2
    assert "give --store or --follow, not both" in both.stderr
    bad = streamrec("serve", str(trained), "--port", "0", "--follow", "shard:1")
    assert bad.returncode == 2
    assert "--follow shard:1: 'shard:1' is not grpc://HOST:PORT" in bad.stderr
    never = _with_follow_poll(trained, 0, trained.with_name("never-follows.yaml"))
    zero = streamrec("serve", str(never), "--port", "0", "--follow", "grpc://b:2")
    assert zero.returncode == 2
    assert "serving.follow_poll_s" in zero.stderr, zero.stderr
    assert "greater than 0" in zero.stderr, zero.stderr


def test_a_server_is_ready_only_once_its_kernels_answer_within_a_deadline(
    trained: Path, tmp_path: Path
) -> None:
    """numba compiles the scoring kernels on their first call in a process, tens of
    seconds when its cache is cold (a fresh image): readiness waits for the warm-up,
    so the first request after it is answered within a 3 s deadline, not refused 504."""
    job = load_config(trained)
    token_file = job.run_dir / "store.token"
    training = ShardProcess.start(trained, job.run_dir / "store" / "shard-000",
                                  token_file=token_file)  # fmt: skip
    raw = yaml.safe_load(trained.read_text())
    raw.setdefault("serving", {})["request_timeout_s"] = 3
    served_job = tmp_path / "deadline.yaml"
    served_job.write_text(yaml.safe_dump(raw))
    follow = f"grpc://{training.address}"
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(served_job), "--port", "0",
            "--follow", follow, "--store-token-file", str(token_file)]  # fmt: skip
    cold = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}  # nothing cached
    server = Server(argv, tmp_path / "serve.log", env=cold)
    try:
        client = triton.InferenceServerClient(server.address)
        wait_until(client.is_server_ready, "ready", timeout_s=240)
        served = _infer(client, _records(64))
        assert served.as_numpy("click").shape == (64,)
        wait_until(lambda: "ready with dense version" in server.log(), "the ready line")
        assert re.search(r"scoring kernels warmed up in \d+\.\ds", server.log()), server.log()
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        training.kill()
