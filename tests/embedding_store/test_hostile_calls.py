"""Calls no shard should obey, sent to a real `streamrec store serve` process over gRPC.

Found by trying to break a shard on purpose: finite gradients that overflow a
row into NaN for good, a Checkpoint aimed at any path, a step clock of 2**62,
and a Lookup whose reply cannot be sent computed (and its rows created) first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.errors import MessageTooLarge
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
from tests.support.processes import grpc_address

pytestmark = pytest.mark.processes

U64 = np.uint64


def connect(procs: list[ShardProcess], token_file: Path) -> StoreClient:
    return StoreClient.connect(
        grpc_address(procs), token=token_file.read_text().strip(), row_dtype="float32"
    )


def test_no_push_leaves_a_non_finite_row_not_even_after_a_restart(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    [proc] = start_shards(1, write_job(), token_file)
    ids = np.arange(3, dtype=U64)
    with connect([proc], token_file) as c:
        c.lookup({"item": ids, "user": ids})
        # One id twice in one push: 2e38 + 2e38 overflows float32 when summed.
        r = c.push({"item": (np.array([0, 0], U64), np.full((2, 4), 2e38, np.float32))})
        assert r.rejected_nonfinite == 2
        # Across pushes (sgd, lr 0.5): -1.5e38, -3e38, then -4.5e38 would be -inf.
        rejected = [
            c.push({"item": (ids[1:2], np.full((1, 4), 3e38, np.float32))}).rejected_nonfinite
            for _ in range(3)
        ]
        assert rejected == [0, 0, 1]
        # Adagrad: the squared gradient overflows the row's accumulator.
        assert c.push({"user": (ids[2:], np.full((1, 8), 2e38, np.float32))}).rejected_nonfinite
        rows = c.lookup({"item": ids, "user": ids}, train=False)
        assert all(np.isfinite(r).all() for r in rows.values()), rows
        np.testing.assert_allclose(rows["item"][1], -3e38, rtol=1e-6)  # the last good value
        stats = c.stats()[0]
        assert stats.table("item").rejected_nonfinite == 3
        assert stats.table("user").rejected_nonfinite == 1
        c.checkpoint(None)
    proc.kill()
    again = proc.restart()
    start_shards.track(again)
    with connect([again], token_file) as c:
        restored = c.lookup({"item": ids, "user": ids}, train=False)
    for name, r in restored.items():
        np.testing.assert_array_equal(r, rows[name], err_msg=name)


def call(proc: ShardProcess, token_file: Path, method: str, request: Any) -> tuple[Any, str]:
    md = (("authorization", f"Bearer {token_file.read_text().strip()}"),)
    with grpc.insecure_channel(proc.address) as channel:
        stub = pb_grpc.EmbeddingStoreStub(channel)
        try:
            getattr(stub, method)(request, metadata=md, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("where", ["/tmp/streamrec-elsewhere", "../../..", "sub/../../x"])
def test_checkpoint_and_restore_stay_in_the_data_directory(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, where: str
) -> None:
    [proc] = start_shards(1, write_job(), token_file)
    target = (proc.data_dir / where).resolve()
    for method, request in [
        ("Checkpoint", pb.CheckpointRequest(directory=where)),
        ("Restore", pb.RestoreRequest(directory=where)),
    ]:
        code, details = call(proc, token_file, method, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, details)
        assert "directory" in details
        assert repr(where) in details
    written = list(target.glob("MANIFEST-*")) if target.is_dir() else []
    assert not written, f"a refused checkpoint wrote {written}"
    # A folder inside the data directory is fine.
    code, details = call(proc, token_file, "Checkpoint", pb.CheckpointRequest(directory="exports"))
    assert code == grpc.StatusCode.OK, details
    assert any((proc.data_dir / "exports").iterdir())


@pytest.mark.parametrize("step", [2**62, -5, 1 << 40])
def test_a_step_clock_out_of_range_is_refused_and_not_kept(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, step: int
) -> None:
    [proc] = start_shards(1, write_job(), token_file)
    ids = np.arange(4, dtype="<u8").tobytes()
    request = pb.LookupRequest(tables=[pb.TableIds(table="user", ids=ids)], train=True, step=step)
    code, details = call(proc, token_file, "Lookup", request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"step: must be in [0, 2**40), got {step}" in details
    with connect([proc], token_file) as c:
        user = c.stats()[0].table("user")
    assert (user.clock, user.rows) == (0, 0)  # nothing moved, nothing created
    ok = pb.LookupRequest(tables=[pb.TableIds(table="user", ids=ids)], train=True, step=1000)
    assert call(proc, token_file, "Lookup", ok)[0] == grpc.StatusCode.OK


def test_a_lookup_whose_reply_cannot_be_sent_is_refused_before_any_row_is_made(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    [proc] = start_shards(1, write_job(max_message_bytes=256 * 1024), token_file)
    with connect([proc], token_file) as c:
        # 20k ids: 160 KB of request fit in, 20k float32 rows of dim 8 (640 KB) do not fit out.
        with pytest.raises(MessageTooLarge, match="split the ids into several calls"):
            c.lookup({"user": np.arange(20_000, dtype=U64)})
        user = c.stats()[0].table("user")
        assert (user.rows, user.clock) == (0, 0)
        assert c.lookup({"user": np.arange(100, dtype=U64)})["user"].shape == (100, 8)
