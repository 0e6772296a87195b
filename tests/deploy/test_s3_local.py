"""`streamrec s3 up` / `down`: a local S3 server for trying cluster mode, kept across restarts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embedding_store.location import Location
from tests.conftest import streamrec


def test_s3_up_down_up_keeps_its_address_key_and_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = str(tmp_path / "state")
    try:
        first = streamrec("s3", "up", "--state-dir", state, check=True).stdout
        url = re.search(r"a job or shard URL:\s+(\S+)", first)
        key = re.search(r"AWS_SECRET_ACCESS_KEY=(\S+)", first)
        assert url is not None, first
        assert key is not None, first
        assert ": started;" in first
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "streamrec")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key.group(1))
        where = Location.parse(url.group(1).replace("PREFIX", "try"))
        where.write_bytes("kept.txt", b"still here")

        assert "already running" in streamrec("s3", "up", "--state-dir", state).stdout
        assert "S3 stopped" in streamrec("s3", "down", "--state-dir", state).stdout
        again = streamrec("s3", "up", "--state-dir", state, check=True).stdout
        assert "restarted with its data" in again
        assert url.group(1) in again, "the same address"
        assert key.group(1) in again, "the same key"
        assert where.read_bytes("kept.txt") == b"still here"
        assert oct((tmp_path / "state" / "s3.json").stat().st_mode & 0o777) == "0o600"
    finally:
        streamrec("s3", "down", "--state-dir", state)
    assert "no S3 running" in streamrec("s3", "down", "--state-dir", state).stdout
