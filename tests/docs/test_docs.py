"""The docs site builds, its generated pages are complete, and the README stays a screen.

The site is built as `make docs` builds it (``mkdocs build --strict``: a broken link,
a missing page or anchor fails), into a temporary folder. The configuration reference
and the command-line page are generated at build time by docs/hooks.py; here they are
checked against the schema and the parsers walked independently of the hook, so a key
or a command the hook skips is caught.
"""

from __future__ import annotations

import argparse
import html
import os
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel

from deploy.cli import build_parser
from deploy.config import JobConfig
from tests.support.processes import REPO_ROOT

PAGES = (
    "index",
    "getting-started",
    "concepts",
    "own-data",
    "configuration",
    "cluster",
    "kubernetes",
    "operations",
    "serving",
    "cli",
    "benchmarks",
    "troubleshooting",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return out


def page(site: Path, name: str) -> str:
    return html.unescape((site / f"{name}.html").read_text(encoding="utf-8"))


@pytest.mark.processes
def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    for name in PAGES:
        assert (site / f"{name}.html").is_file(), name
    # Every marker of a generated part was replaced: none is left in a page.
    for name in PAGES:
        assert "<!-- streamrec:" not in (site / f"{name}.html").read_text(encoding="utf-8"), name


def _members(tp: Any) -> list[Any]:
    """A type's alternatives, Annotated layers, nested unions and None taken off."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(tp):
            out += _members(arg)
        return out
    return [] if tp is type(None) else [tp]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def leaf_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every key of the YAML that holds a value: ``<name>`` for a mapping's key, ``[]``
    for a list's items, each kind of a section that has several."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        members = _members(info.annotation)
        if members and all(_is_model(m) for m in members):
            for m in members:
                yield from leaf_paths(m, path)
            continue
        if len(members) == 1:
            origin, args = typing.get_origin(members[0]), typing.get_args(members[0])
            item = _members(args[-1]) if origin in (dict, list) else []
            if len(item) == 1 and _is_model(item[0]):
                yield from leaf_paths(item[0], f"{path}.<name>" if origin is dict else f"{path}[]")
                continue
        yield path


@pytest.mark.processes
def test_the_configuration_reference_lists_every_key(site: Path) -> None:
    text = page(site, "configuration")
    paths = sorted(set(leaf_paths(JobConfig)))
    assert len(paths) > 100
    for expected in (
        "run_dir",
        "store.tables.<name>.optimizer.lr",
        "store.tables.<name>.admission.threshold",
        "features.dense[].transform",
        "source.bootstrap_servers",
        "source.paths",
        "trainer.checkpoint.dir",
        "serving.grpc_port",
    ):
        assert expected in paths
    missing = [p for p in paths if f"<code>{p}</code>" not in text]
    assert not missing, missing


def commands(parser: argparse.ArgumentParser, prog: str = "streamrec") -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}"
                yield from commands(sub, f"{prog} {name}")


@pytest.mark.processes
def test_the_command_line_page_lists_every_command(site: Path) -> None:
    text = page(site, "cli")
    found = list(commands(build_parser()))
    assert "streamrec kafka topic create" in found
    assert "streamrec store serve" in found
    missing = [c for c in found if f"<code>{c}</code>" not in text]
    assert not missing, missing


def test_the_readme_is_one_screen_and_starts_with_the_two_commands() -> None:
    lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, len(lines)
    assert lines[0].startswith("# ")
    rest = [line for line in lines[1:] if line.strip()]
    assert rest[0].startswith("```"), rest[0]
    block = rest[1 : rest.index("```", 1)]
    ran = [line.split("#")[0].strip() for line in block if line.split("#")[0].strip()]
    assert ran[:2] == ["make demo", "make test"], ran
