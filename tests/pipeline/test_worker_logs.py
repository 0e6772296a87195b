"""A peer that hangs up mid-transfer leaves no traceback in a worker's log.

A subprocess starts a LocalCluster of one worker process (its log goes to the
subprocess's stderr, as a job's local workers' goes to the job's output),
registers the job's Dask plugins, and then plays a trainer rank killed while
reading a result: it asks the worker for a key and closes the connection
instead of answering "OK".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from distributed import Client, LocalCluster
    from distributed.comm import connect
    from deploy.job.services import install_dask_plugins

    async def hang_up(address, key):
        comm = await connect(address)
        await comm.write({"op": "get_data", "keys": [key], "who": None, "reply": True})
        msg = await comm.read()
        assert msg["status"] == "OK", msg
        comm.abort()  # killed before its "OK"

    if __name__ == "__main__":
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            if sys.argv[1] == "plugins":
                install_dask_plugins(client)
            future = client.submit(bytes, 1_000_000, key="result-0")
            future.result()
            worker = next(iter(cluster.scheduler.workers))
            asyncio.run(hang_up(worker, "result-0"))
            time.sleep(1.0)
            assert client.submit(sum, [1, 2], pure=False).result() == 3
            print("went on", flush=True)
    """
)


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_peer_that_hangs_up_mid_transfer_leaves_no_traceback() -> None:
    # Dask's own behaviour, which the job's plugin is for.
    bare = run("bare")
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert "failed during get data" in bare.stderr
    assert "Traceback" in bare.stderr

    quiet = run("plugins")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "went on" in quiet.stdout
    assert "failed during get data" not in quiet.stderr, quiet.stderr[-3000:]
    assert "Traceback" not in quiet.stderr, quiet.stderr[-3000:]
