"""Helpers shared by the benchmark scripts in this folder.

The scripts run as ``python benchmarks/X.py``, so this folder is first on
``sys.path`` and they import these with ``from common import ...``. The imports
of the repository's own packages are made inside the functions: each script puts
the repository root on ``sys.path`` itself, and ``--help`` stays fast.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from connectors.spec import FeatureSpec
    from deploy.local.shards import ShardProcess, StartingShard

# The fields of a Criteo display-ads record besides ``label``: 13 dense counts
# and 26 categorical (string) fields.
CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]


# --- timing ----------------------------------------------------------------------------


class MachineCpu:
    """The whole machine's CPU time (``/proc/stat``), sampled on a thread while a
    benchmark runs: how many cores its processes kept busy over a window, and how
    many the hypervisor took (steal). On a machine whose every core is busy, a mode
    that needs more CPU per sample is slower by that much, whichever process spends
    it: this is the control that tells such a cost from waiting.

    >>> with MachineCpu(every_s=0.01) as cpu:
    ...     t0 = time.time()
    ...     _ = sum(i * i for i in range(200_000))
    ...     t1 = time.time()
    >>> figures = cpu.over(t0, t1)
    >>> sorted(figures), figures["busy_cores"] >= 0
    (['busy_cores', 'busy_cpu_s', 'steal_cores'], True)
    """

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []  # unix s, busy s, steal s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-cpu", daemon=True)
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is within user)
        busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
        steal = fields[7] if len(fields) > 7 else 0
        return time.time(), busy / self._hz, steal / self._hz

    def _run(self) -> None:
        stopping = False
        while True:
            sample = self._read()
            if sample is None:
                return  # not Linux: no figures
            self.samples.append(sample)
            if stopping:
                return
            stopping = self._stop.wait(self.every_s)  # then one more: a window to the end

    def __enter__(self) -> MachineCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def over(self, t0: float, t1: float) -> dict[str, float]:
        """Busy and stolen cores on average from unix time ``t0`` to ``t1`` (the nearest
        samples around them), and the busy CPU seconds; empty where nothing was sampled."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        before = [s for s in self.samples if s[0] < t0][-1:]
        after = [s for s in self.samples if s[0] > t1][:1]
        window = before + inside + after
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return {}
        (a, busy_a, steal_a), (b, busy_b, steal_b) = window[0], window[-1]
        return {
            "busy_cores": round((busy_b - busy_a) / (b - a), 3),
            "steal_cores": round((steal_b - steal_a) / (b - a), 3),
            "busy_cpu_s": round((busy_b - busy_a) * (t1 - t0) / (b - a), 2),
        }


def median_seconds(fn: Callable[[int], object], repeats: int) -> float:
    """The median wall time of ``fn(0)`` ... ``fn(repeats - 1)``, after a warm-up ``fn(0)``.

    The warm-up call, not timed, pays for one-off costs (numba compilation or
    cache loads, connections). ``fn`` gets the run's index, to cycle inputs.
    """
    fn(0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_rate(fn: Callable[[int], object], count: int, repeats: int) -> float:
    """``count`` (the events or rows one call handles) over ``median_seconds(fn, repeats)``."""
    return count / median_seconds(fn, repeats)


# --- data --------------------------------------------------------------------------------


def zipf_ranks(u: np.ndarray, distinct: int, dtype: type[np.integer[Any]]) -> np.ndarray:
    """Ranks in ``[0, distinct)`` with P(rank k) ~ 1/(k + 1), from uniforms ``u`` in [0, 1).

    >>> zipf_ranks(np.array([0.0, 0.5, 0.999]), 100, np.int64).tolist()
    [0, 9, 99]
    """
    ranks: np.ndarray = np.floor(np.exp(u * np.log(distinct + 1.0))).astype(dtype) - 1
    return ranks


def criteo_spec(
    dense_options: Mapping[str, Any] | None = None, shared_table: bool = False
) -> FeatureSpec:
    """The feature spec of a Criteo-like record: ``label``, ``I1``-``I13``, ``C1``-``C26``.

    ``dense_options`` are added to every dense field; each sparse field ``Cn``
    feeds its own table ``cn``, or with ``shared_table`` all feed the table ``all``.
    """
    from connectors.spec import FeatureSpec

    return FeatureSpec.model_validate(
        {
            "labels": ["label"],
            "dense": [{"name": d, **(dense_options or {})} for d in CRITEO_DENSE],
            "sparse": [
                {"name": s, "table": "all" if shared_table else s.lower()} for s in CRITEO_SPARSE
            ],
        }
    )


# --- store shard processes ---------------------------------------------------------------


def write_store_job(path: Path, store: dict[str, Any]) -> Path:
    """Write a job YAML with only a ``store:`` section (all a shard process reads) to ``path``."""
    import yaml

    path.write_text(yaml.safe_dump({"store": store}))
    return path


def write_token(path: Path) -> Path:
    """Write a fresh random store token to ``path``."""
    path.write_text(secrets.token_hex(16))
    return path


def wait_all(starting: Sequence[StartingShard], timeout_s: float = 120.0) -> list[ShardProcess]:
    """Shard processes spawned side by side (``ShardProcess.spawn``), each waited for until
    it serves; if one does not, every one of them is killed and the error raised."""
    try:
        return [s.wait(timeout_s) for s in starting]
    except BaseException:
        for s in starting:
            if s.proc.poll() is None:
                s.proc.kill()
            s.proc.wait()
        raise


@contextmanager
def store_shards(job: Path, dirs: list[Path], token_file: Path) -> Iterator[str]:
    """Start one store shard process of ``job`` per directory; yield their ``grpc://`` address.

    The processes start side by side (a start is mostly imports, on every core there
    is) and are killed on exit.
    """
    from deploy.local.shards import ShardProcess

    procs = wait_all([ShardProcess.spawn(job, d, token_file=token_file) for d in dirs])
    try:
        yield "grpc://" + ",".join(p.address for p in procs)
    finally:
        for p in procs:
            p.kill()


@contextmanager
def shared_dask(log_path: Path, workers: int = 2) -> Iterator[str]:
    """A local Dask cluster as a job starts its own (``workers`` processes, one thread
    each); yields its scheduler's address, for jobs to name in ``cluster.scheduler``.

    For the short runs of the smoke tests: a cluster's start (its processes' imports)
    and its workers' first tasks (the pipeline's imports and cached kernels) cost more
    than a short job's training, and jobs that name one cluster pay them once.
    """
    from deploy.local.dask_cluster import local_dask_cluster

    with local_dask_cluster(
        workers=workers, threads_per_worker=1, dashboard_address=":0", log_path=log_path
    ) as cluster:
        yield str(cluster.scheduler_address)


# --- output ------------------------------------------------------------------------------


def print_figures(
    figures: Mapping[str, Any],
    show: Callable[[Any], str],
    *,
    width: int | None = None,
    sep: str = "  ",
) -> None:
    """Print one line per figure: the name left-aligned in ``width``, ``sep``, ``show(value)``.

    ``width`` defaults to the longest name.

    >>> print_figures({"a": 1, "bcd": 2.5}, lambda v: f"{v:.1f}")
    a    1.0
    bcd  2.5
    """
    if width is None:
        width = max(len(k) for k in figures)
    for k, v in figures.items():
        print(f"{k:<{width}}{sep}{show(v)}")


def machine_info() -> dict[str, Any]:
    """The machine a benchmark ran on: its figures compare only with ones from the same.

    The same ratios differ by machine (TorchRec's FBGEMM kernels gain most
    where AVX-512 is), so every JSON names the CPU model, the vector
    extensions torch's kernels and FBGEMM pick from, the cores and the
    versions of the libraries whose kernels do the work.

    The hypervisor is named too (``none`` on bare metal): two VMs of one CPU
    model on different hosts are different machines.

    >>> info = machine_info()
    >>> sorted(info) == sorted(["cpu_model", "cores", "cpu_flags", "torch_cpu_capability",
    ...     "torch", "numba", "numpy", "python", "platform", "hypervisor", "product"])
    True
    """
    import os
    import platform

    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = (
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "amx_bf16",
        "amx_tile",
        "asimd",
        "sve",
    )
    info: dict[str, Any] = {
        "cpu_model": model or platform.processor(),
        "cores": os.cpu_count(),
        # FBGEMM dispatches on these flags (AVX2, AVX-512, VNNI); torch's ATen on the capability.
        "cpu_flags": [f for f in wanted if f in flags],
        "torch_cpu_capability": None,
        "torch": None,
        "numba": None,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hypervisor": _hypervisor("hypervisor" in flags),
        "product": _read_first("/sys/class/dmi/id/product_name"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        pass
    return info


def _read_first(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _hypervisor(cpu_says_virtual: bool) -> str:
    """``systemd-detect-virt``'s answer (kvm, microsoft, amazon, ..., none), else the
    kernel's /sys/hypervisor/type, else "virtual (unknown)" when the CPU flags say so."""
    import shutil
    import subprocess

    tool = shutil.which("systemd-detect-virt")
    if tool is not None:
        try:
            out = subprocess.run([tool], capture_output=True, text=True, timeout=5, check=False)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    kind = _read_first("/sys/hypervisor/type")
    if kind is not None:
        return kind
    return "virtual (unknown)" if cpu_says_virtual else "none"


def write_json(path: Path, figures: Mapping[str, Any], *, announce: bool = False) -> None:
    """Write ``figures`` as indented JSON to ``path``, creating its folder, with the
    machine they were measured on under ``"machine"`` (see :func:`machine_info`).

    With ``announce``, print ``wrote PATH`` after.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = {**figures, "machine": machine_info()}
    path.write_text(json.dumps(figures, indent=2) + "\n")
    if announce:
        print(f"wrote {path}")
