"""Threads sized by the CPUs a process may use: its affinity capped by its cgroup's quota.

In a container the affinity is every core of the node; the quota
(``resources.limits.cpu``) is what the process gets. The cgroup files are
written under a temporary root, as cgroup v2 and v1 lay them out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.job import threads


def test_cgroup_v2_quota_of_the_process_cgroup_or_the_root(tmp_path: Path) -> None:
    pod = tmp_path / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (pod / "cpu.max").write_text("200000 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1\n") == 2.0
    # Inside a container the process's cgroup is mounted at the root.
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path, "0::/elsewhere\n") == 0.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(tmp_path, "0::/\n") is None


def test_cgroup_v1_quota_and_none(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("300000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    text = "4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert threads.cgroup_cpu_quota(tmp_path, text) == 3.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert threads.cgroup_cpu_quota(tmp_path, text) is None
    assert threads.cgroup_cpu_quota(tmp_path / "absent", text) is None


@pytest.mark.parametrize(("quota", "expected"), [(None, 16), (2.0, 2), (1.5, 2), (0.25, 1)])
def test_host_cpus_is_the_affinity_capped_by_the_quota(
    monkeypatch: pytest.MonkeyPatch, quota: float | None, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: quota)
    assert threads._host_cpus() == expected
    # The demo's parts on such a host: a 2-core quota leaves the trainer one thread.
    left = threads.auto_torch_threads(expected, local_worker_threads=2, local_shards=2)
    assert left == max(1, expected - 3)
