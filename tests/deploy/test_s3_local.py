"""`streamrec s3 up` / `down`: a local S3 server for trying cluster mode, kept across restarts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embedding_store.location import Location
from tests.support.ports import held_port
from tests.support.processes import streamrec

pytestmark = pytest.mark.processes


def s3_up(state: str) -> str:
    """``streamrec s3 up``'s output; a failure shows what it printed."""
    done = streamrec("s3", "up", "--state-dir", state)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_s3_up_down_up_keeps_its_address_key_and_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = str(tmp_path / "state")
    try:
        first = s3_up(state)
        url = re.search(r"a job or shard URL:\s+(\S+)", first)
        key = re.search(r"AWS_SECRET_ACCESS_KEY=(\S+)", first)
        assert url is not None, first
        assert key is not None, first
        assert ": started;" in first
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "streamrec")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key.group(1))
        where = Location.parse(url.group(1).replace("PREFIX", "try"))
        where.write_bytes("kept.txt", b"still here")

        assert "already running" in s3_up(state)
        assert "S3 stopped" in streamrec("s3", "down", "--state-dir", state).stdout
        again = s3_up(state)
        assert "restarted with its data" in again
        assert url.group(1) in again, "the same address"
        assert key.group(1) in again, "the same key"
        assert where.read_bytes("kept.txt") == b"still here"
        assert oct((tmp_path / "state" / "s3.json").stat().st_mode & 0o777) == "0o600"
    finally:
        streamrec("s3", "down", "--state-dir", state)
    assert "no S3 running" in streamrec("s3", "down", "--state-dir", state).stdout


def test_s3_up_in_a_shell_that_exported_an_older_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """weed took the shell's AWS_* key as an identity too, replacing the new secret.

    `s3 up` tells users to export the key; a later `s3 up` with a new state dir
    then waited 60 s for a server that refused the key it was about to print.
    """
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "streamrec")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "an-older-servers-secret")
    state = str(tmp_path / "state")
    try:
        out = s3_up(state)
        key = re.search(r"AWS_SECRET_ACCESS_KEY=(\S+)", out)
        url = re.search(r"a job or shard URL:\s+(\S+)", out)
        assert key is not None, out
        assert url is not None, out
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key.group(1))
        where = Location.parse(url.group(1).replace("PREFIX", "k"))
        where.write_bytes("x", b"1")
        assert where.read_bytes("x") == b"1"
    finally:
        streamrec("s3", "down", "--state-dir", state)


def test_weed_that_exits_on_a_taken_port_is_started_again_on_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports are picked free, then bound by weed; one taken in between costs a retry."""
    from deploy.local import objectstore

    with held_port() as taken:
        picks = iter([taken])
        real = objectstore._free_port_pair
        monkeypatch.setattr(objectstore, "_free_port_pair", lambda: next(picks, None) or real())
        server = objectstore.LocalS3.start(tmp_path / "s3")
        try:
            assert server.alive()
            log = (tmp_path / "s3" / "weed.log").read_text(errors="replace")
            assert str(taken) in log, "the first weed was given the taken port"
        finally:
            server.stop()
