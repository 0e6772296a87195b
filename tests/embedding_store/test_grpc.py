"""Store shards as real processes over gRPC on loopback, driven by the StoreClient."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from deploy.config import load_config
from embedding_store.client import StoreClient
from embedding_store.errors import (
    InvalidRequest,
    MessageTooLarge,
    StoreUnavailable,
    Unauthenticated,
    UnknownTable,
)
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
from embedding_store.transport.base import RetryPolicy
from embedding_store.types import PushOrigin
from embedding_store.wire import decode_row_state
from tests.support.processes import grpc_address, streamrec

RNG = np.random.default_rng(7)


def _train(client: StoreClient, steps: int, seed: int = 0) -> np.ndarray:
    """A few lookup+push steps on both tables; returns every id touched."""
    rng = np.random.default_rng(seed)
    touched = []
    for _ in range(steps):
        users = rng.integers(0, 5000, 300).astype(np.uint64)
        items = rng.integers(0, 800, 200).astype(np.uint64)
        client.lookup({"user": users, "item": items})
        client.push(
            {
                "user": (users, rng.normal(size=(300, 8)).astype(np.float32)),
                "item": (items, rng.normal(size=(200, 4)).astype(np.float32)),
            }
        )
        touched.append(users)
    return np.unique(np.concatenate(touched))


@pytest.mark.processes
def test_two_shards_match_an_in_process_store(write_job, token_file, start_shards) -> None:
    job = write_job()
    procs = start_shards(2, job, token_file)
    token = token_file.read_text().strip()
    cfg = load_config(job).store
    with (
        StoreClient.connect(grpc_address(procs), token=token, config=cfg) as remote,
        StoreClient.connect("inproc://2", config=cfg) as local,
    ):
        assert remote.num_shards == 2
        ids_r = _train(remote, 5)
        ids_l = _train(local, 5)
        np.testing.assert_array_equal(ids_r, ids_l)
        got = remote.lookup({"user": ids_r}, train=False)["user"]
        want = local.lookup({"user": ids_l}, train=False)["user"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        stats = remote.stats()
        rows = [s.table("user").rows for s in stats]
        assert all(r > 0 for r in rows), "both shards should own some ids"
        assert sum(rows) == ids_r.shape[0]


@pytest.mark.processes
def test_create_rows_bulk_loads_the_rows_a_lookup_would_make(
    write_job, token_file, start_shards
) -> None:
    job = write_job()
    procs = start_shards(2, job, token_file)
    token = token_file.read_text().strip()
    cfg = load_config(job).store
    ids = np.arange(20_000, dtype=np.uint64) * np.uint64(7919)
    with (
        StoreClient.connect(grpc_address(procs), token=token, config=cfg) as remote,
        StoreClient.connect("inproc://2", config=cfg) as local,
    ):
        remote.create_rows({"user": ids, "item": ids[:500]})
        assert sum(s.table("user").rows for s in remote.stats()) == ids.shape[0]
        assert sum(s.table("item").rows for s in remote.stats()) == 500
        want = local.lookup({"user": ids})["user"]
        got = remote.lookup({"user": ids}, train=False)["user"]
        np.testing.assert_array_equal(got, want)
        # The call's reply carries no rows, and a create without train is refused.
        channel = grpc.insecure_channel(procs[0].address)
        stub = pb_grpc.EmbeddingStoreStub(channel)
        meta = (("authorization", f"Bearer {token}"),)
        one = pb.TableIds(table="user", ids=np.arange(5, dtype="<u8").tobytes())
        reply = stub.Lookup(
            pb.LookupRequest(tables=[one], train=True, create_only=True), metadata=meta
        )
        assert len(reply.tables) == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(tables=[one], create_only=True), metadata=meta)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "create_only" in str(err.value.details())
        channel.close()


@pytest.mark.processes
def test_float16_rows_on_the_wire(write_job, token_file, start_shards) -> None:
    job = write_job(row_dtype="float16")
    procs = start_shards(1, job, token_file)
    cfg = load_config(job).store
    with StoreClient.connect(
        grpc_address(procs), token=token_file.read_text().strip(), config=cfg
    ) as c:
        rows = c.lookup({"user": np.arange(10, dtype=np.uint64)})["user"]
        assert rows.dtype == np.float16
        exact = c.lookup({"user": np.arange(10, dtype=np.uint64)}, train=False)["user"]
        np.testing.assert_array_equal(rows, exact)
        assert np.abs(rows).max() > 0


@pytest.mark.processes
def test_calls_without_the_token_are_refused(write_job, token_file, start_shards) -> None:
    job = write_job()
    procs = start_shards(1, job, token_file)
    with pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
        StoreClient.connect(grpc_address(procs), token=None)
    with pytest.raises(Unauthenticated):
        StoreClient.connect(grpc_address(procs), token="not-the-token")
    with grpc.insecure_channel(procs[0].address) as channel:
        stub = pb_grpc.EmbeddingStoreStub(channel)
        for call, req in [
            (stub.Health, pb.HealthRequest()),
            (stub.Stats, pb.StatsRequest()),
            (stub.Lookup, pb.LookupRequest()),
            (stub.Push, pb.PushRequest()),
            (stub.Checkpoint, pb.CheckpointRequest()),
            (stub.Restore, pb.RestoreRequest()),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.processes
def test_malformed_requests_get_clear_codes(write_job, token_file, start_shards) -> None:
    job = write_job()
    procs = start_shards(1, job, token_file)
    md = (("authorization", f"Bearer {token_file.read_text().strip()}"),)
    ids8 = np.arange(8, dtype="<u8").tobytes()
    with grpc.insecure_channel(procs[0].address) as channel:
        stub = pb_grpc.EmbeddingStoreStub(channel)

        def code_of(call, req) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as info:
                call(req, metadata=md, timeout=10)
            return info.value.code(), info.value.details()

        code, details = code_of(
            stub.Lookup, pb.LookupRequest(tables=[pb.TableIds(table="user", ids=b"1234567")])
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "7 bytes" in details
        code, details = code_of(
            stub.Lookup, pb.LookupRequest(tables=[pb.TableIds(table="nope", ids=ids8)])
        )
        assert code == grpc.StatusCode.NOT_FOUND
        assert "'nope'" in details
        code, details = code_of(
            stub.Push,
            pb.PushRequest(
                tables=[pb.TableGrads(table="user", ids=ids8, grads=b"\0" * (7 * 8 * 4))],
                dtype=pb.FLOAT32,
            ),
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "7 rows" in details
        code, details = code_of(
            stub.Lookup, pb.LookupRequest(tables=[pb.TableIds(table="user", ids=ids8)], dtype=7)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "dtype" in details
        code, details = code_of(
            stub.Checkpoint, pb.CheckpointRequest(directory="", metadata_json="[1")
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "metadata_json" in details
        code, details = code_of(stub.Restore, pb.RestoreRequest(directory="nonexistent/ckpt"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "nonexistent/ckpt" in details

    with StoreClient.connect(grpc_address(procs), token=token_file.read_text().strip()) as c:
        with pytest.raises(UnknownTable):
            c.lookup({"nope": np.arange(3)})
        with pytest.raises(InvalidRequest, match=r"grads\[user\]"):
            c.push({"user": (np.arange(3), np.zeros((3, 5), np.float32))})
        ids = np.arange(4, dtype=np.uint64)
        before = c.lookup({"user": ids})["user"].astype(np.float32)
        grads = np.ones((4, 8), np.float32)
        grads[1, 3] = np.nan
        grads[2, 0] = np.inf
        result = c.push({"user": (ids, grads)})
        assert (result.applied, result.rejected_nonfinite) == (2, 2)
        after = c.lookup({"user": ids}, train=False)["user"].astype(np.float32)
        np.testing.assert_array_equal(after[1:3], before[1:3])
        assert not np.allclose(after[[0, 3]], before[[0, 3]])
        assert c.stats()[0].table("user").rejected_nonfinite == 2


@pytest.mark.processes
def test_messages_over_the_size_limit_are_refused(write_job, token_file, start_shards) -> None:
    job = write_job(max_message_bytes=64 * 1024)
    procs = start_shards(1, job, token_file)
    token = token_file.read_text().strip()
    with StoreClient.connect(
        grpc_address(procs), token=token, max_message_bytes=64 << 20, row_dtype="float32"
    ) as c:
        # 10k ids = 80 KB of request: refused by the server's limit.
        with pytest.raises(MessageTooLarge, match="RESOURCE_EXHAUSTED"):
            c.lookup({"user": np.arange(10_000, dtype=np.uint64)})
        # 2k ids fit in, but 2k rows of dim 8 in float32 (64 KB + framing) do not fit out.
        with pytest.raises(MessageTooLarge):
            c.lookup({"user": np.arange(2_100, dtype=np.uint64)})
        assert c.lookup({"user": np.arange(100, dtype=np.uint64)})["user"].shape == (100, 8)


@pytest.mark.processes
def test_a_retried_push_is_applied_once(write_job, token_file, start_shards) -> None:
    procs = start_shards(1, write_job(), token_file)
    with StoreClient.connect(grpc_address(procs), token=token_file.read_text().strip()) as c:
        ids = np.arange(5, dtype=np.uint64)
        before = c.lookup({"item": ids})["item"].astype(np.float32)
        grads = {"item": (ids, np.ones((5, 4), np.float32))}
        first = c.push(grads, request_id="step-1")
        second = c.push(grads, request_id="step-1")
        assert not first.duplicate_request
        assert second.duplicate_request
        after = c.lookup({"item": ids}, train=False)["item"].astype(np.float32)
        np.testing.assert_allclose(after, before - 0.5, rtol=1e-6)
        assert c.stats()[0].duplicate_pushes == 1


@pytest.mark.processes
def test_a_push_id_is_forgotten_after_remembered_push_s(
    write_job, token_file, start_shards
) -> None:
    """A shard keeps a push's request id for ``remembered_push_s`` only: a retry within
    it is answered once more without applying it, one after it is applied again. With
    the count alone the ids filled a shard's memory (18 MB at 65,536 ids) for the
    hour of a 20-pushes-a-second soak: its RSS grew 7.6% after the warm-up."""
    procs = start_shards(1, write_job(remembered_push_s=1.0), token_file)
    with StoreClient.connect(grpc_address(procs), token=token_file.read_text().strip()) as c:
        ids = np.arange(5, dtype=np.uint64)
        c.lookup({"item": ids})  # the rows exist: a push applies to each
        grads = {"item": (ids, np.ones((5, 4), np.float32))}
        assert not c.push(grads, request_id="kept").duplicate_request
        assert c.push(grads, request_id="kept").duplicate_request
        assert not c.push(grads, request_id="old").duplicate_request
        time.sleep(1.5)
        c.push(grads, request_id="new")  # a push after the window forgets the old ids
        again = c.push(grads, request_id="old")
        assert not again.duplicate_request
        assert again.applied == 5
        assert c.stats()[0].duplicate_pushes == 1


def test_a_push_id_is_remembered_past_the_client_s_retries() -> None:
    from embedding_store.types import StoreConfig

    config = StoreConfig(tables={"t": {"dim": 2}})
    assert RetryPolicy().longest_s < config.remembered_push_s


@pytest.mark.processes
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "socket"])
def test_a_push_brings_back_the_rows_it_left(
    write_job, token_file, start_shards, shared_memory: bool
) -> None:
    """Two shards: each push's reply has the pushed rows as a lookup after it reads them,
    with their optimizer state, in the order of the pushed ids; the protobuf Push too."""
    procs = start_shards(2, write_job(), token_file)
    token = token_file.read_text().strip()
    with StoreClient.connect(grpc_address(procs), token=token, shared_memory=shared_memory) as c:
        ids = np.array([9, 3, 400, 7, 12], dtype=np.uint64)
        c.lookup({"item": ids, "user": ids})
        grads = {"item": (ids, np.ones((5, 4), np.float32)), "user": (ids[:2], np.ones((2, 8)))}
        result = c.push(grads, return_rows=True)
        assert result.rows is not None
        assert result.applied == 7
        now = c.lookup({"item": ids, "user": ids[:2]}, train=False)
        for name, n in (("item", 5), ("user", 2)):
            rows = result.rows[name]
            np.testing.assert_array_equal(rows.weights, now[name])
            assert rows.row_step.tolist() == [1] * n
            assert rows.state.shape[0] == n
        # The same through the plain protobuf Push, one shard at a time.
        steps = []
        for proc in procs:
            channel = grpc.insecure_channel(proc.address)
            stub = pb_grpc.EmbeddingStoreStub(channel)
            reply = stub.Push(
                pb.PushRequest(
                    request_id="pb-1",
                    tables=[
                        pb.TableGrads(
                            table="item",
                            ids=ids.tobytes(),
                            grads=np.ones((5, 4), np.float32).tobytes(),
                        )
                    ],
                    dtype=pb.FLOAT32,
                    return_rows=True,
                ),
                metadata=(("authorization", f"Bearer {token}"),),
            )
            channel.close()
            rows = decode_row_state(reply.rows, ["item"], [5])["item"]
            assert rows.weights.shape == (5, 4)
            steps.append(rows.row_step)  # -1: an id the other shard holds
            assert not reply.state  # all of it is in rows
            assert not reply.row_steps
        assert np.maximum.reduce(steps).tolist() == [2] * 5


@pytest.mark.processes
def test_a_push_whose_rows_are_too_large_to_send_back_is_still_applied(
    write_job, token_file, start_shards
) -> None:
    procs = start_shards(1, write_job(max_message_bytes=64 * 1024), token_file)
    with StoreClient.connect(grpc_address(procs), token=token_file.read_text().strip()) as c:
        ids = np.arange(1_500, dtype=np.uint64)
        c.lookup({"user": ids})
        # 1,500 rows of dim 8 fit in as float32 gradients (48 KB) but not out with state.
        result = c.push({"user": (ids, np.ones((1_500, 8), np.float32))}, return_rows=True)
        assert result.applied == 1_500
        assert result.rows is None
        assert c.push({"user": (ids[:10], np.ones((10, 8)))}, return_rows=True).rows is not None


@pytest.mark.processes
def test_checkpoint_of_two_shards_restores_onto_three(
    write_job, token_file, start_shards, tmp_path: Path
) -> None:
    job = write_job()
    token = token_file.read_text().strip()
    # The export folder is shared by every shard, outside their data dirs: allowed.
    two = start_shards(2, job, token_file, prefix="two", allow_dirs=(tmp_path / "ckpt",))
    with StoreClient.connect(grpc_address(two), token=token) as c2:
        ids = _train(c2, 4)
        c2.checkpoint(tmp_path / "ckpt", "full")
        _train(c2, 2, seed=1)  # a delta on top
        results = c2.checkpoint(tmp_path / "ckpt")
        assert [r.kind for r in results] == ["delta", "delta"]
        items = np.arange(800, dtype=np.uint64)
        want_users = c2.lookup({"user": ids}, train=False)["user"]
        want_items = c2.lookup({"item": items}, train=False)["item"]
        total_rows = sum(s.table("user").rows for s in c2.stats())
    three = start_shards(3, job, token_file, prefix="three", allow_dirs=(tmp_path / "ckpt",))
    with StoreClient.connect(grpc_address(three), token=token) as c3:
        restored = c3.restore(tmp_path / "ckpt")
        assert sum(r.rows_by_table["user"] for r in restored) == total_rows
        assert all(r.rows_by_table["user"] > 0 for r in restored)
        np.testing.assert_array_equal(c3.lookup({"user": ids}, train=False)["user"], want_users)
        np.testing.assert_array_equal(c3.lookup({"item": items}, train=False)["item"], want_items)


@pytest.mark.processes
def test_kill_9_then_restart_from_the_data_dir(write_job, token_file, start_shards) -> None:
    job = write_job()
    token = token_file.read_text().strip()
    (proc,) = start_shards(1, job, token_file)
    ids = np.arange(2000, dtype=np.uint64)
    with StoreClient.connect(grpc_address([proc]), token=token) as c:
        _train(c, 3)
        (first,) = c.checkpoint(metadata={"note": "into the data dir"})
        assert first.kind == "full"
        assert first.manifest.startswith(str(proc.data_dir))
        _train(c, 2, seed=5)
        (second,) = c.checkpoint()
        assert second.kind == "delta"
        at_checkpoint = c.lookup({"user": ids}, train=False)["user"]
        _train(c, 2, seed=9)  # acknowledged but never checkpointed: lost by kill -9
        assert not np.array_equal(c.lookup({"user": ids}, train=False)["user"], at_checkpoint)
    proc.kill()
    again = proc.restart()
    start_shards.track(again)
    assert "rows restored" in again.log()
    with StoreClient.connect(grpc_address([again]), token=token) as c:
        np.testing.assert_array_equal(c.lookup({"user": ids}, train=False)["user"], at_checkpoint)


@pytest.mark.processes
def test_sigterm_checkpoints_and_a_restart_has_everything(
    write_job, token_file, start_shards
) -> None:
    job = write_job()
    token = token_file.read_text().strip()
    (proc,) = start_shards(1, job, token_file)
    ids = np.arange(5000, dtype=np.uint64)
    with StoreClient.connect(grpc_address([proc]), token=token) as c:
        _train(c, 3)
        before = c.lookup({"user": ids}, train=False)["user"]
    assert proc.stop() == 0
    assert "wrote full checkpoint" in proc.log()
    again = proc.restart()
    start_shards.track(again)
    with StoreClient.connect(grpc_address([again]), token=token) as c:
        np.testing.assert_array_equal(c.lookup({"user": ids}, train=False)["user"], before)


@pytest.mark.processes
def test_client_retries_while_a_shard_restarts(write_job, token_file, start_shards) -> None:
    job = write_job()
    token = token_file.read_text().strip()
    (proc,) = start_shards(1, job, token_file)
    retry = RetryPolicy(attempts=40, initial_backoff_s=0.05, max_backoff_s=0.5, timeout_s=10)
    with StoreClient.connect(grpc_address([proc]), token=token, retry=retry) as c:
        ids = np.arange(100, dtype=np.uint64)
        before = c.lookup({"user": ids})["user"]
        assert proc.stop() == 0
        restarted: list = []
        timer = threading.Timer(0.5, lambda: restarted.append(proc.restart()))
        timer.start()
        t0 = time.monotonic()
        after = c.lookup({"user": ids}, train=False)["user"]  # waits out the restart
        timer.join()
        start_shards.track(restarted[0])
        assert time.monotonic() - t0 >= 0.4
        np.testing.assert_array_equal(after, before)


@pytest.mark.processes
def test_cli_help_and_errors(tmp_path: Path, write_job: Callable[..., Path]) -> None:
    out = streamrec("--help", check=True).stdout
    assert "store" in out
    out = streamrec("store", "serve", "--help", check=True).stdout
    assert "--token-file" in out
    assert "--data-dir" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  tables:\n    user: {dim: 8, optimiser: sgd}\n")

    def serve(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
        data_dir = str(tmp_path / "d")
        return streamrec("store", "serve", "--config", str(config), "--data-dir", data_dir, *args)

    r = serve(bad, "--no-auth")
    assert r.returncode == 2
    assert "store.tables.user.optimiser" in r.stderr
    r = serve(write_job())
    assert r.returncode == 2
    assert "give the job's token with --token-file or $STREAMREC_STORE_TOKEN" in r.stderr


@pytest.mark.processes
def test_a_shard_back_after_a_long_outage_answers_the_default_retries(
    write_job, token_file, start_shards
) -> None:
    """A client that kept calling a dead shard for seconds takes its restart once it is back.

    gRPC's channel waits between connection attempts, 1 s at first, then 1.6
    times longer each time, up to 120 s by default; the client's own retries
    span 1.55 s. A shard restarted on the same port after a few seconds'
    outage (a loaded machine) was then refused past them: a trainer rank
    taking the restart ended the job on "connection refused" with the shard
    serving again. ``accept_restarts`` now waits for the channel.
    """
    job = write_job()
    token = token_file.read_text().strip()
    (proc,) = start_shards(1, job, token_file)
    with StoreClient.connect(grpc_address([proc]), token=token) as c:
        c.accept_restarts()
        proc.kill()
        # Calls meet the dead shard for 6 s, as a rank's pushes and polls would.
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreUnavailable):
                c.stats()
        again = proc.restart()
        start_shards.track(again)
        c.accept_restarts()  # the default retries: about 1.5 s
        assert c.stats() is not None


@pytest.mark.processes
def test_a_push_reply_says_which_pushes_of_each_rank_its_rows_include(
    write_job, token_file, start_shards
) -> None:
    """Two writers of one group push the same rows from two threads at once: each reply
    says what every writer had applied on its shard, and its rows are exactly those
    pushes' sum (SGD), whatever order they landed in."""
    job = write_job(tables={"user": {"dim": 2, "optimizer": {"kind": "sgd", "lr": 1.0}}})
    procs = start_shards(2, job, token_file)
    token = token_file.read_text().strip()
    cfg = load_config(job).store
    ids = np.arange(1, 41, dtype=np.uint64)
    with StoreClient.connect(grpc_address(procs), token=token, config=cfg) as first:
        start = first.lookup({"user": ids})["user"].astype(np.float32)
    replies: dict[tuple[int, int], Any] = {}
    together = threading.Barrier(2)

    def writer(rank: int) -> None:
        with StoreClient.connect(grpc_address(procs), token=token, config=cfg) as client:
            for step in range(1, 11):
                together.wait(timeout=30)  # both push each step at once
                origin = PushOrigin("job", rank=rank, ranks=2, seq=step)
                grads = np.full((ids.shape[0], 2), 10.0**rank, np.float32)
                replies[(rank, step)] = client.push(
                    {"user": (ids, grads)}, request_id=origin.request_id, return_rows=True
                ).rows

    reads: list[Any] = []
    writing = threading.Event()

    def reader() -> None:
        """Reads of a rank of the group while both push: each says what its rows include
        (asked with one request id again and again: a read is never a retry)."""
        with StoreClient.connect(grpc_address(procs), token=token, config=cfg) as client:
            origin = PushOrigin("job", rank=1, ranks=2, seq=0, read=True)
            while writing.is_set():
                reads.append(client.read_pushed({"user": ids}, origin=origin))

    threads = [threading.Thread(target=writer, args=(r,)) for r in (0, 1)]
    writing.set()
    reading = threading.Thread(target=reader)
    reading.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writing.clear()
    reading.join()
    read_orders = set()
    for rows in reads:
        for part in rows.parts:
            n0, n1 = part.seen
            read_orders.add((n0, n1))
            want = start[part.where["user"]] - (n0 * 1.0 + n1 * 10.0)
            np.testing.assert_allclose(part.rows["user"].weights, want, rtol=1e-6)
    assert len(read_orders) > 1, read_orders  # the reads saw the pushes land
    # The reads applied nothing: the rows are the twenty pushes' and no more.
    with StoreClient.connect(grpc_address(procs), token=token, config=cfg) as last:
        now = last.lookup({"user": ids}, train=False)["user"].astype(np.float32)
    np.testing.assert_allclose(now, start - 110.0, rtol=1e-6)
    orders = set()
    for (rank, step), rows in replies.items():
        assert len(rows.parts) == 2  # one per shard
        for part in rows.parts:
            assert part.seen is not None
            assert part.seen[rank] == step, part.seen
            n0, n1 = part.seen
            orders.add((n0, n1))
            where = part.where["user"]
            # Each applied push subtracted its gradient: 1 per rank-0 push, 10 per rank-1.
            want = start[where] - (n0 * 1.0 + n1 * 10.0)
            np.testing.assert_allclose(part.rows["user"].weights, want, rtol=1e-6)
    # The first push of a step to land has seen the other rank's previous one only.
    assert any(n0 != n1 for n0, n1 in orders), orders
