"""``benchmarks/serve.py --smoke``: every serving figure, at tiny sizes.

The whole script runs as in its full run (a training shard, its replica,
``streamrec serve`` and ``streamrec run`` as processes, tritonclient as the
client), with latency measurements of 0.3 s, 3 sparse stamps, 2 dense versions
and one round of 16k-event jobs for the training slowdown, every job naming one
Dask cluster instead of starting its own (the slowdown's jobs run in the benchmark's
process: a ``streamrec run``'s start took longer than its training). Every figure
must be written and finite; none is compared with a speed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes

LATENCY = [
    "p50_ms_batch1",
    "p99_ms_batch1",
    "p50_ms_batch64",
    "p99_ms_batch64",
    "p99_ms_batch512",
    "requests_per_s_batch1",
    "samples_per_s_batch512",
]
FRESHNESS = [
    "sparse_freshness_s_p50",
    "sparse_freshness_s_p99",
    "dense_freshness_s_p50",
    "dense_freshness_s_p99",
]


def test_every_serving_figure_is_reported(tmp_path: Path) -> None:
    figures = run_benchmark("serve.py", tmp_path / "serve.json", "--smoke", timeout=600)
    keys = LATENCY + FRESHNESS
    keys += [f"{k}_while_training" for k in keys]
    keys += ["requests_per_s_batch1_per_core", "samples_per_s_batch512_per_core"]
    keys += ["requests_per_s_batch1_per_server_core", "samples_per_s_batch512_per_server_core"]
    keys += ["training_slowdown", "training_samples_per_s_with_load"]
    keys += ["training_samples_per_s_without_load", "cpus"]
    # The control: the job beside a burner of the cores the load cost the server.
    keys += ["training_slowdown_burner", "training_samples_per_s_beside_burner"]
    keys += ["serving_load_cores", "burner_cores"]
    assert_positive(figures, keys)
    assert figures["tensor_encoding"].startswith("binary")
    for suffix in ("", "_while_training"):
        sweep = figures[f"sweep{suffix}"]
        assert [level["threads"] for level in sweep] == [1, 2]
        for level in sweep:
            # the server's own processes' cores, from their CPU time
            assert_positive(level, ["requests_per_s", "p99_ms", "server_cores"])
        best = max(level["requests_per_s"] for level in sweep)
        assert figures[f"requests_per_s_batch1{suffix}"] == best
        sweep512 = figures[f"sweep512{suffix}"]
        assert [level["threads"] for level in sweep512] == [1, 2, 4]
        best512 = 512 * max(level["requests_per_s"] for level in sweep512)
        assert figures[f"samples_per_s_batch512{suffix}"] == best512
    # Each stamp and each published version was seen by the server, none timed out.
    for suffix in ("", "_while_training"):
        assert figures[f"sparse_freshness{suffix}"]["timeouts"] == 0
        assert figures[f"dense_freshness{suffix}"]["timeouts"] == 0
    load = figures["slowdown_runs"]["with"][0]["serving_load"]
    assert load["requests"] > 0
    assert load["errors"] == 0  # each answer read whole, a 200
    assert 0 < figures["load_client_cores"] == load["client_cores"] < 1
    burner = figures["slowdown_runs"]["burner"][0]
    assert burner["burner_share"] == figures["serving_load_cores"]
    assert burner["burner_cores"] == figures["burner_cores"]  # its CPU, measured
    # The ceiling: the same server code and client with a model that costs nothing.
    assert_positive(
        figures["ceiling"],
        [
            "p50_ms_batch1",
            "p99_ms_batch1",
            "requests_per_s_batch1",
            "requests_per_s_batch1_per_server_core",
        ],
    )
    assert [level["threads"] for level in figures["ceiling"]["sweep"]] == [1, 2]
    assert (
        0
        < figures["requests_per_s_batch1_vs_ceiling"]
        == (figures["requests_per_s_batch1"] / figures["ceiling"]["requests_per_s_batch1"])
    )
    for target in figures["targets"].values():
        assert target["met"] in (True, False)
        assert math.isfinite(target["value"])
