"""Locations on a real S3 server (SeaweedFS) and on disk: whole files, listing, checkpoints."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deploy.local.objectstore import LocalS3
from embedding_store.errors import CheckpointError
from embedding_store.location import Location
from trainer.checkpoint import CheckpointBook


# Only the S3 case starts a process (the session's S3 server): the fast tier keeps "local".
@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.processes), "local"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return Location.parse(tmp_path / "loc")
    s3: LocalS3 = request.getfixturevalue("s3")
    return Location.parse(s3.url(request.getfixturevalue("s3_prefix")))


def test_files_round_trip(location: Location, tmp_path: Path) -> None:
    assert location.names() == []
    location.write_bytes("b.json", b"{}")
    location.write_bytes("a.bin", bytes(range(256)) * 1000)
    location.child("sub").write_bytes("c", b"c")
    assert location.names() == ["a.bin", "b.json"]  # files directly here, sorted
    assert location.read_bytes("a.bin") == bytes(range(256)) * 1000
    with pytest.raises(FileNotFoundError):
        location.read_bytes("missing")
    src = tmp_path / "up.bin"
    src.write_bytes(b"x" * (9 << 20))  # more than one copy buffer
    location.upload(src, "up.bin")
    location.download("up.bin", tmp_path / "down" / "up.bin")
    assert (tmp_path / "down" / "up.bin").read_bytes() == src.read_bytes()
    location.delete("b.json")
    location.delete("b.json")  # a missing file is not an error
    assert location.names() == ["a.bin", "up.bin"]
    assert location.child("sub").names() == ["c"]
    location.check()
    assert location.names() == ["a.bin", "up.bin"], "check() leaves no probe behind"


def test_a_reader_never_sees_half_a_file(location: Location) -> None:
    """What makes a manifest a commit point without rename: whole or absent."""
    size = 24 << 20
    seen_sizes: list[int] = []
    done = threading.Event()

    def write() -> None:
        try:
            location.write_bytes("big", b"z" * size)
        finally:
            done.set()

    threading.Thread(target=write, daemon=True).start()
    while not done.is_set():
        if "big" in location.names():
            seen_sizes.append(len(location.read_bytes("big")))
        time.sleep(0.005)
    assert set(seen_sizes) <= {size}
    assert len(location.read_bytes("big")) == size


def test_job_checkpoints_in_a_location(location: Location) -> None:
    book = CheckpointBook(location, keep=2)
    assert book.latest() is None
    for step in (10, 20, 30):
        book.save(
            step=step,
            samples=step * 4,
            positions={"t/0": step * 4},
            shard_seqs=[step, step],
            dense={"ranks": [{"w": step}]},
        )
    assert book.manifests() == ["JOB-000000000020.json", "JOB-000000000030.json"]
    latest = book.latest()
    assert latest is not None
    assert (latest.step, latest.positions) == (30, {"t/0": 120})
    assert book.load_dense(latest) == {"ranks": [{"w": 30}]}
    assert "dense-000000000010.pt" not in location.names(), "old dense states are dropped"
    # Another process (host) opening the same location sees the same newest checkpoint.
    again = CheckpointBook(Location.parse(location.url))
    assert again.latest() == latest


@pytest.mark.processes
def test_wrong_credentials_are_one_clear_error_without_the_secret(
    s3: LocalS3, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    url = s3.url(s3_prefix) + "&secret_key=hunter2"
    with pytest.raises(CheckpointError) as failed:
        Location.parse(url).check()
    text = str(failed.value)
    assert s3_prefix in text
    assert "hunter2" not in text


def test_file_urls_and_paths_are_local(tmp_path: Path) -> None:
    assert Location.parse(f"file://{tmp_path}/x").local == tmp_path / "x"
    assert not Location.parse(tmp_path).is_remote
    with pytest.raises(CheckpointError, match="names its bucket"):
        Location.parse("s3:///nobucket")
