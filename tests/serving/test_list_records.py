"""Score, evaluate and serve records with lists, as a rating log holds them; and a
server whose store stops answering.

Real processes: a backfill job learns the records, then ``streamrec score``,
``streamrec evaluate`` and ``streamrec serve`` read them back. Every call runs
under a time limit: a scan must end even when a record's list elements run
past the end of the scanner's first scratch store (1,024 strings), as they do
in these records at every chunk size used here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deploy.config import load_config
from deploy.local.shards import ShardProcess
from tests.serving.server import Server
from tests.support.jobs import write_job_yaml
from tests.support.processes import streamrec
from tests.support.waits import wait_until

pytestmark = pytest.mark.processes

RECORDS = 1500  # about 5,000 genre strings: past the scanner's first store several times
# A call that used to spin is given this long; the whole test takes seconds.
LIMIT_S = 180


def rating_records(n: int, seed: int = 8) -> list[dict[str, Any]]:
    """Records of a rating log's shape: ints, short strings, a list of 1-6 strings.

    With seed 8 a record's list straddles the end of the scanner's first store
    both in one chunk of all 1,500 records and in the second chunk of 700.
    """
    rng = random.Random(seed)
    genres = ["drama", "comedy", "action", "thriller", "romance", "horror", "sci-fi", "war"]
    out = []
    for _ in range(n):
        user = rng.randrange(300)
        out.append({
            "liked": rng.randrange(2),
            "user_id": user,
            "movie_id": rng.randrange(900),
            "gender": "mf"[user % 2],
            "occupation": f"occ{user % 21}",
            "zip3": f"{user % 97:03d}",
            "year": str(1950 + rng.randrange(50)),
            "genres": rng.sample(genres, rng.randrange(1, 7)),
            "age": round(rng.random(), 2),
        })  # fmt: skip
    return out


@pytest.fixture(scope="module")
def rated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A job that learned the records (a Parquet backfill), and the records as JSON lines."""
    tmp = tmp_path_factory.mktemp("lists")
    records = rating_records(RECORDS)
    history = tmp / "history.parquet"
    pq.write_table(pa.Table.from_pylist(records), history)
    lines = tmp / "records.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records))
    tables = ("users", "movies", "gender", "occupation", "zip3", "year", "genres")
    job = write_job_yaml(
        tmp / "job.yaml",
        run_dir=str(tmp / "run"),
        source={"kind": "parquet", "paths": [str(history)]},
        features={
            "labels": ["liked"],
            "dense": [{"name": "age", "min_value": 0, "max_value": 1}],
            "sparse": [
                {"name": "user_id", "table": "users", "type": "int"},
                {"name": "movie_id", "table": "movies", "type": "int"},
                {"name": "gender", "table": "gender"},
                {"name": "occupation", "table": "occupation"},
                {"name": "zip3", "table": "zip3"},
                {"name": "year", "table": "year"},
                {"name": "genres", "table": "genres", "type": "list_string", "pooling": "mean"},
            ],
        },
        store={"tables": {t: {"dim": 4, "capacity": 2000} for t in tables}},
        trainer={
            "mode": "hybrid", "batch_size": 250, "torch_threads": 1,
            "model": {"kind": "ffnn", "hidden": [8]},
            "checkpoint": {"every_steps": 3, "every_s": None},
        },
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
    )  # fmt: skip
    out = streamrec("backfill", str(job))
    assert out.returncode == 0, out.stdout + out.stderr
    return job, lines


def test_score_reads_every_record_with_lists(rated: tuple[Path, Path], tmp_path: Path) -> None:
    job, lines = rated
    out = tmp_path / "scores.parquet"
    for batch in ("4096", "700"):  # one chunk of all records, and chunks that cross the store
        result = streamrec("score", str(job), "--from", str(lines), "--to", str(out),
                           "--batch", batch, timeout=LIMIT_S)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{RECORDS:,} of {RECORDS:,} records scored" in result.stdout, result.stdout
        liked = pq.read_table(out).column("liked").to_numpy()
        assert liked.shape == (RECORDS,)
        assert ((liked > 0) & (liked < 1)).all()


def test_evaluate_reads_every_record_with_lists(rated: tuple[Path, Path], tmp_path: Path) -> None:
    job, lines = rated
    figures = tmp_path / "eval.json"
    result = streamrec("evaluate", str(job), "--from", str(lines), "--json", str(figures),
                       timeout=LIMIT_S)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    liked = json.loads(figures.read_text())["heads"]["liked"]
    assert liked["samples"] == RECORDS
    assert 0.0 < liked["auc"] < 1.0


def test_serve_answers_a_request_of_records_with_lists(
    rated: tuple[Path, Path], tmp_path: Path
) -> None:
    job, lines = rated
    run_dir = load_config(job).run_dir
    token_file = run_dir / "store.token"
    shard = ShardProcess.start(job, run_dir / "store" / "shard-000", token_file=token_file)
    follow = ["--follow", f"grpc://{shard.address}", "--store-token-file", str(token_file)]
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(job), "--port", "0", *follow]
    server = Server(argv, tmp_path / "serve.log")
    try:
        url = f"http://{server.address}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        wait_until(ready, "ready")
        records = lines.read_text().splitlines()
        body = json.dumps({
            "inputs": [{"name": "records", "datatype": "BYTES", "shape": [len(records)],
                        "data": records}],
        }).encode()  # fmt: skip
        request = urllib.request.Request(f"{url}/v2/models/streamrec/infer", body)
        with urllib.request.urlopen(request, timeout=LIMIT_S) as reply:
            answer = json.loads(reply.read())
        [liked] = answer["outputs"]
        assert liked["shape"] == [RECORDS]
        assert all(0 < p < 1 for p in liked["data"])
    finally:
        try:
            assert server.stop() in (0, -15), server.log()
        finally:
            server.proc.kill()  # a server whose core is held does not stop on SIGTERM
            shard.kill()


def test_a_request_whose_rows_do_not_come_gets_504_in_time(
    rated: tuple[Path, Path], tmp_path: Path
) -> None:
    """``streamrec serve --store`` reads rows from a shard process over gRPC: while the
    shard is frozen (SIGSTOP) a request is answered 504 within its deadline instead
    of holding the server's loop for the store client's retries, readiness turns
    503 (the rows' store does not answer), and the server is ready and answers again
    once the shard does."""
    job, lines = rated
    raw = yaml.safe_load(job.read_text())
    raw.setdefault("serving", {})["request_timeout_s"] = 2.0
    timed = tmp_path / "job.yaml"
    timed.write_text(yaml.safe_dump(raw))
    run_dir = load_config(job).run_dir
    token_file = run_dir / "store.token"
    shard = ShardProcess.start(job, run_dir / "store" / "shard-000", token_file=token_file)
    store = ["--store", f"grpc://{shard.address}", "--store-token-file", str(token_file)]
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(timed), "--port", "0", *store]
    server = Server(argv, tmp_path / "serve.log")
    url = f"http://{server.address}"
    records = lines.read_text().splitlines()[:64]
    body = json.dumps({
        "inputs": [{"name": "records", "datatype": "BYTES", "shape": [len(records)],
                    "data": records}],
    }).encode()  # fmt: skip

    def ready() -> int:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=30) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as e:
            return e.code

    def infer() -> tuple[int, dict[str, Any], float]:
        request = urllib.request.Request(f"{url}/v2/models/streamrec/infer", body)
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read()), time.monotonic() - started
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), time.monotonic() - started

    try:
        wait_until(lambda: infer()[0] == 200, "a first answer")
        os.kill(shard.proc.pid, signal.SIGSTOP)
        try:
            code, answer, took = infer()
            assert code == 504, answer
            assert "request timed out after 2s while reading rows" in answer["error"], answer
            assert took < 10, took  # the deadline, not the client's 6 x 30 s of retries
            with urllib.request.urlopen(f"{url}/v2/health/live", timeout=10) as reply:
                assert reply.status == 200
            wait_until(lambda: ready() == 503, "not ready while the store does not answer")
        finally:
            os.kill(shard.proc.pid, signal.SIGCONT)
        wait_until(lambda: ready() == 200, "ready once the shard answers")
        wait_until(lambda: infer()[0] == 200, "an answer once the shard is back")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            assert 'streamrec_serve_errors_total{reason="timeout"} 1.0' in reply.read().decode()
    finally:
        try:
            assert server.stop() in (0, -15), server.log()
        finally:
            server.proc.kill()
            shard.kill()


def test_serve_answers_over_grpc_as_over_http(rated: tuple[Path, Path], tmp_path: Path) -> None:
    """``streamrec serve --grpc-port 0``: tritonclient's gRPC client gets the same
    probabilities as an HTTP request of the same records."""
    import re

    import numpy as np
    import tritonclient.grpc as triton_grpc

    job, lines = rated
    run_dir = load_config(job).run_dir
    token_file = run_dir / "store.token"
    shard = ShardProcess.start(job, run_dir / "store" / "shard-000", token_file=token_file)
    follow = ["--follow", f"grpc://{shard.address}", "--store-token-file", str(token_file)]
    argv = [sys.executable, "-m", "deploy.cli", "serve", str(job), "--port", "0",
            "--grpc-port", "0", *follow]  # fmt: skip
    server = Server(argv, tmp_path / "serve.log")
    try:
        url = f"http://{server.address}"
        wait_until(lambda: "gRPC (KServe v2" in server.log(), "the gRPC address")
        found = re.search(r"GRPCInferenceService\) on (\S+)", server.log())
        assert found is not None, server.log()

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        wait_until(ready, "ready")
        records = lines.read_text().splitlines()[:64]
        body = json.dumps({
            "inputs": [{"name": "records", "datatype": "BYTES", "shape": [len(records)],
                        "data": records}],
        }).encode()  # fmt: skip
        request = urllib.request.Request(f"{url}/v2/models/streamrec/infer", body)
        with urllib.request.urlopen(request, timeout=60) as reply:
            over_http = json.loads(reply.read())["outputs"][0]["data"]
        client = triton_grpc.InferenceServerClient(found.group(1))
        assert client.is_server_ready()
        tensor = triton_grpc.InferInput("records", [len(records)], "BYTES")
        tensor.set_data_from_numpy(np.array([r.encode() for r in records], dtype=object))
        answer = client.infer("streamrec", [tensor], timeout=5_000_000)
        over_grpc = answer.as_numpy("liked")
        assert over_grpc is not None
        assert over_grpc.shape == (len(records),)
        assert np.allclose(over_grpc, over_http, atol=1e-6)
        client.close()
    finally:
        try:
            assert server.stop() in (0, -15), server.log()
        finally:
            server.proc.kill()
            shard.kill()
