"""The committed gRPC stubs must match what the .proto files generate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from embedding_store.proto import generate


def test_committed_stubs_are_up_to_date() -> None:
    assert generate.main(["--check"]) == 0


@pytest.mark.parametrize("edited", [s.outputs[0] for s in generate.STUBS])
def test_the_check_notices_a_stale_stub(
    edited: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Point the generator at a copy of the packages, one of whose stubs was edited by hand.
    for stubs in generate.STUBS:
        folder = Path(stubs.proto).parent
        shutil.copytree(
            generate.ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    stub = tmp_path / edited
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.main(["--check"]) == 1


def test_a_missing_stub_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for stubs in generate.STUBS:
        folder = tmp_path / Path(stubs.proto).parent
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(generate.ROOT / stubs.proto, tmp_path / stubs.proto)
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0  # writes them
    assert generate.main(["--check"]) == 0


def test_the_oip_stubs_load_into_a_pool_of_their_own() -> None:
    from google.protobuf import descriptor_pool

    from embedding_store.proto import embedding_store_pb2
    from serving.proto import grpc_predict_v2_pb2 as pb

    assert pb.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert embedding_store_pb2.DESCRIPTOR.pool is descriptor_pool.Default()
    assert pb.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
