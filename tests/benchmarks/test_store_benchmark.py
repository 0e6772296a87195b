"""``benchmarks/store.py`` on a table of 20,000 rows, batches of 2,048 ids: every figure.

In this process and over gRPC to one and two shard processes, through the
shared-memory area and through the socket alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes


def test_every_path_to_the_store_reports_its_rate(tmp_path: Path) -> None:
    args = ["--distinct", "20000", "--batch-ids", "2048", "--repeats", "2"]
    figures = run_benchmark("store.py", tmp_path / "store.json", *args)
    assert (figures["distinct_ids"], figures["batch_ids"]) == (20000, 2048)
    keys = ["gather_limit_rows_per_s", "inproc_lookup_vs_limit"]
    for kind in ("lookup", "push"):
        keys += [f"inproc_{kind}_rows_per_s", f"grpc_{kind}_rows_per_s"]
        keys += [f"grpc_{kind}_rows_per_s_2_shards", f"grpc_network_{kind}_rows_per_s"]
        keys += [f"grpc_vs_inproc_{kind}", f"grpc_network_vs_inproc_{kind}"]
    assert_positive(figures, keys)
