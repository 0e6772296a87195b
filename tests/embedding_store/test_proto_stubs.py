"""The committed gRPC stubs must match what the .proto generates."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from embedding_store.proto import generate


def test_committed_stubs_are_up_to_date() -> None:
    assert generate.main(["--check"]) == 0


def test_the_check_notices_a_stale_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Point the generator at a copy of the package whose stub was edited by hand.
    pkg = tmp_path / "embedding_store" / "proto"
    shutil.copytree(generate.PROTO.parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    stub = pkg / "embedding_store_pb2.py"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(generate, "PROTO", pkg / "embedding_store.proto")
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.main(["--check"]) == 1
