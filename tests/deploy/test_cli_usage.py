"""Usage errors of ``streamrec``: exit 2 and one line naming the option or field and the value.

Handlers raise :class:`deploy.cli.UsageError`; :func:`deploy.cli.dispatch` alone turns it
into the message and the exit code. The invocations below fail before any broker, shard
or cluster is needed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from deploy.cli import USAGE_EXIT, UsageError, build_parser, dispatch, main
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.processes

TABLES = {"user": {"dim": 8, "optimizer": {"kind": "sgd", "lr": 0.1}}}

# (name, arguments, the command's prog, what the message must hold). In the arguments
# "{job}" is a job file with a store but no `features:`, "{typo}" one with a misspelled
# key, "{dir}" the test's folder.
BAD = [
    ("produce: neither --from nor --events", ["produce", "--to", "kafka://h:1/t"],
     "streamrec produce", ["give either --from FILE", "--events N"]),
    ("produce: negative --rate", ["produce", "--events", "3", "--rate", "-1", "--to",
     "kafka://h:1/t"], "streamrec produce", ["--rate -1: expected 0"]),
    ("produce: negative --partition", ["produce", "--events", "3", "--partition", "-2",
     "--to", "kafka://h:1/t"], "streamrec produce", ["--partition -2: expected 0 or more"]),
    ("produce: --seed with --from", ["produce", "--from", "{dir}/r.jsonl", "--seed", "4",
     "--to", "kafka://h:1/t"], "streamrec produce", ["--seed is for the synthetic stream"]),
    ("kafka up: --port out of range", ["kafka", "up", "--port", "70000", "--state-dir",
     "{dir}/kafka"], "streamrec kafka up", ["--port 70000: expected 0-65535"]),
    ("kafka up --broker tansu: --port out of range", ["kafka", "up", "--broker", "tansu",
     "--port", "65536", "--state-dir", "{dir}/tansu"], "streamrec kafka up",
     ["--port 65536: expected 0-65535"]),
    ("kafka up: --storage without tansu", ["kafka", "up", "--storage", "memory://x/"],
     "streamrec kafka up", ["--storage is Tansu's (give --broker tansu)"]),
    ("store serve: no token", ["store", "serve", "--config", "{job}", "--data-dir",
     "{dir}/d"], "streamrec store serve", ["--token-file or $STREAMREC_STORE_TOKEN"]),
    ("store serve: --metrics-port out of range", ["store", "serve", "--config", "{job}",
     "--data-dir", "{dir}/d", "--no-auth", "--metrics-port", "70000"],
     "streamrec store serve", ["--metrics-port 70000: expected 0-65535"]),
    ("store serve: --snapshots without a bucket", ["store", "serve", "--config", "{job}",
     "--data-dir", "{dir}/d", "--no-auth", "--snapshots", "s3://"],
     "streamrec store serve", ["--snapshots s3://: a storage URL names its bucket"]),
    ("store serve: a misspelled key", ["store", "serve", "--config", "{typo}", "--data-dir",
     "{dir}/d", "--no-auth"], "streamrec store serve",
     ["typo.yaml: invalid job config", "store.tables.user.optimiser: unknown key"]),
    ("store replica: --poll-s 0", ["store", "replica", "--config", "{job}", "--follow",
     "127.0.0.1:1", "--data-dir", "{dir}/r", "--no-auth", "--poll-s", "0"],
     "streamrec store replica", ["--poll-s: must be > 0, got 0.0"]),
    ("run: no such job file", ["run", "{dir}/nope.yaml"], "streamrec run",
     ["nope.yaml: cannot read the job config"]),
    ("backfill: no Parquet source", ["backfill", "{job}"], "streamrec backfill",
     ["give Parquet files with --from"]),
    ("serve: no features", ["serve", "{job}", "--store", "grpc://a:1"], "streamrec serve",
     ["job.yaml has no `features:` section"]),
    ("score: no features", ["score", "{job}", "--from", "{dir}/r.jsonl", "--to",
     "{dir}/o.parquet"], "streamrec score", ["job.yaml has no `features:` section"]),
    ("evaluate: no such job file", ["evaluate", "{dir}/nope.yaml", "--from", "{dir}/r.jsonl"],
     "streamrec evaluate", ["nope.yaml: cannot read the job config"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job file without features, one with a misspelled key, and a records file."""
    root = tmp_path_factory.mktemp("usage")
    (root / "job.yaml").write_text(yaml.safe_dump({"store": {"tables": TABLES}}))
    typo = {"store": {"tables": {"user": {"dim": 8, "optimiser": "sgd"}}}}
    (root / "typo.yaml").write_text(yaml.safe_dump(typo))
    (root / "r.jsonl").write_text("{}\n")
    return root


def _streamrec(folder: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    values = {"job": str(folder / "job.yaml"), "typo": str(folder / "typo.yaml")}
    argv = [a.format(dir=folder, **values) for a in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    env["STREAMREC_STATE_DIR"] = str(folder / "state")
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        cwd=folder,  # no `.streamrec/` of a checkout to take notes about
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "prog", "says"), [case[1:] for case in BAD], ids=[case[0] for case in BAD]
)
def test_a_bad_invocation_exits_2_naming_the_option_and_value(
    folder: Path, args: list[str], prog: str, says: list[str]
) -> None:
    out = _streamrec(folder, args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("note: ")]
    assert lines[0].startswith(f"{prog}: error: "), out.stderr
    if not lines[0].endswith("invalid job config"):  # then one line per field
        assert len(lines) == 1, out.stderr
    for text in says:
        assert text in out.stderr, out.stderr


def test_serve_with_store_and_follow_names_both(folder: Path) -> None:
    """With the features given, ``serve`` stops at the two options, before any connection."""
    from connectors.synthetic import synthetic_feature_spec

    job = yaml.safe_load((folder / "job.yaml").read_text())
    job["features"] = synthetic_feature_spec().model_dump()
    with_features = folder / "features.yaml"
    with_features.write_text(yaml.safe_dump(job))
    out = _streamrec(folder, ["serve", str(with_features), "--store", "grpc://a:1",
                              "--follow", "grpc://b:2"])  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr == "streamrec serve: error: give --store or --follow, not both\n"


def _raises(args: argparse.Namespace) -> int:
    msg = f"--rate {args.rate}: expected 0 (as fast as possible) or more"
    raise UsageError(msg)


def test_dispatch_maps_a_usage_error_to_2_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(func=_raises, rate=-3, command_prog="streamrec produce")
    assert dispatch(args) == USAGE_EXIT == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err
        == "streamrec produce: error: --rate -3: expected 0 (as fast as possible) or more\n"
    )


def test_dispatch_passes_other_exit_codes_through() -> None:
    assert dispatch(argparse.Namespace(func=lambda _: None)) == 0
    assert dispatch(argparse.Namespace(func=lambda _: 1)) == 1
    assert dispatch(argparse.Namespace(func=lambda _: 0)) == 0


def test_main_names_the_innermost_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The prefix is the prog of the command parsed, nested groups included."""
    code = main(["kafka", "up", "--broker", "tansu", "--port", "-1"])
    assert code == 2
    assert capsys.readouterr().err == "streamrec kafka up: error: --port -1: expected 0-65535\n"


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of every command prints its usage and exits 0 (dask and torchrun hand
    theirs to the stock tool)."""
    found = list(_commands(build_parser()))
    assert len(found) > 15
    for path, parser in found:
        if not parser.add_help:
            continue
        with pytest.raises(SystemExit) as stopped:
            main([*path, "--help"])
        assert stopped.value.code == 0, path
        assert f"usage: streamrec {' '.join(path)}" in capsys.readouterr().out, path
