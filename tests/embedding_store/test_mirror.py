"""A shard that moves hosts: checkpoints copied to S3, restored on an empty disk; restarts seen.

Real shard processes (``streamrec store serve --snapshots s3://...``) and a
real S3 server (SeaweedFS).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.local.objectstore import LocalS3
from deploy.local.shards import ShardProcess
from embedding_store.client import StoreClient
from embedding_store.errors import ShardRestarted
from embedding_store.location import Location
from embedding_store.mirror import remote_seqs
from embedding_store.transport.base import RetryPolicy

pytestmark = pytest.mark.processes

U64 = np.uint64
FAST = RetryPolicy(attempts=2, initial_backoff_s=0.05, timeout_s=10)


def _rows(client: StoreClient, ids: np.ndarray) -> np.ndarray:
    return np.asarray(client.lookup({"user": ids}, train=False)["user"], dtype=np.float32)


def _push(client: StoreClient, ids: np.ndarray, value: float) -> None:
    grads = np.full((ids.shape[0], 8), value, dtype=np.float32)
    client.push({"user": (ids, grads)})


def test_a_shard_restarted_on_an_empty_disk_restores_from_the_object_store(
    write_job: Callable[..., Path],
    token_file: Path,
    start_shards: Any,
    tmp_path: Path,
    s3: LocalS3,
    s3_prefix: str,
) -> None:
    url = s3.url(f"{s3_prefix}/shard-000")
    job = write_job()
    first = ShardProcess.start(
        job, tmp_path / "host-a" / "shard", token_file=token_file, snapshots=url
    )
    start_shards.track(first)
    ids = np.arange(1, 2001, dtype=U64)
    token = token_file.read_text().strip()
    with StoreClient.connect(f"grpc://{first.address}", token=token, retry=FAST) as c:
        c.lookup({"user": ids})
        _push(c, ids, 0.5)
        [one] = c.checkpoint(None, "auto")
        at_one = _rows(c, ids)
        _push(c, ids[:100], -1.0)
        [two] = c.checkpoint(None, "auto")
        at_two = _rows(c, ids)
        _push(c, ids, 3.0)  # never checkpointed: lost with the host
    assert (one.kind, two.kind) == ("full", "delta")
    assert remote_seqs(Location.parse(url)) == [one.seq, two.seq]
    first.kill()

    # Another host, an empty disk, the same address: the newest checkpoint comes back.
    second = ShardProcess.start(
        job, tmp_path / "host-b" / "shard", token_file=token_file, port=first.port, snapshots=url
    )
    start_shards.track(second)
    assert "2000 rows restored" in second.log()
    with StoreClient.connect(f"grpc://{second.address}", token=token, retry=FAST) as c:
        np.testing.assert_array_equal(_rows(c, ids), at_two)
        # A job rolling back to an older checkpoint: fetched from the mirror too.
        c.restore(None, upto_seq=[one.seq])
        np.testing.assert_array_equal(_rows(c, ids), at_one)
        [three] = c.checkpoint(None, "auto")
    assert three.seq == two.seq + 1, "a seq the mirror holds is never written again"
    assert remote_seqs(Location.parse(url))[-1] == three.seq


def test_a_push_to_a_restarted_shard_is_refused_as_lost_state(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any, tmp_path: Path
) -> None:
    job = write_job()
    shard = ShardProcess.start(job, tmp_path / "shard", token_file=token_file)
    start_shards.track(shard)
    ids = np.arange(1, 11, dtype=U64)
    token = token_file.read_text().strip()
    with StoreClient.connect(f"grpc://{shard.address}", token=token, retry=FAST) as c:
        c.lookup({"user": ids})
        _push(c, ids, 1.0)
        shard.kill()
        again = shard.restart()
        start_shards.track(again)
        # The new process answers on the same address: without the incarnation check
        # this push would succeed, and the rows pushed before would be silently gone.
        with pytest.raises(ShardRestarted, match="restarted"):
            _push(c, ids, 1.0)
        with pytest.raises(ShardRestarted):
            c.checkpoint(None, "auto")
        c.accept_restarts()
        _push(c, ids, 1.0)  # accepted: trains against the new process
