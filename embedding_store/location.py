"""Where durable files live: a local folder or an object-store prefix, named by one string.

A :class:`Location` is a flat folder of named files with the few operations
checkpoints need: write a whole file, read it, list names, delete. It is
reached through ``pyarrow.fs``, so ``s3://`` (AWS S3 or any S3-compatible
server), ``gs://``, ``hdfs://`` and ``file://`` URLs work, as do plain paths.

Writes are all or nothing, without a rename (object stores have none): on a
local disk a temporary file is fsynced and renamed; in an object store an
object becomes visible only when its upload completes. A reader therefore
never sees half a file, and a manifest written last is a commit point.

S3 URLs take pyarrow's options as query parameters, e.g.
``s3://bucket/jobs/ctr?endpoint_override=10.0.0.5:8333&scheme=http&region=us-east-1``;
credentials come from the usual AWS chain (``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``, an instance role).

>>> import tempfile
>>> loc = Location.parse(tempfile.mkdtemp())
>>> loc.write_bytes("a.json", b"{}")
>>> loc.names(), loc.read_bytes("a.json"), loc.child("sub").is_remote
(['a.json'], b'{}', False)
>>> Location.parse("s3://bucket/prefix?scheme=http").is_remote
True
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedding_store.errors import CheckpointError

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_COPY_BUFFER = 8 << 20


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path.

    >>> is_url("s3://b/p"), is_url("file:///tmp/x"), is_url("runs/job"), is_url(Path("/tmp"))
    (True, True, False, False)
    """
    return isinstance(text, str) and bool(_URL.match(text))


@dataclass(frozen=True)
class Location:
    """A folder of files: ``local`` for a path on this host, else a ``pyarrow.fs`` one."""

    url: str  # as the user wrote it (query kept): shown in messages, passed to other hosts
    local: Path | None = None

    @classmethod
    def parse(cls, where: str | os.PathLike[str]) -> Location:
        """A Location for a path, a ``file://`` URL or an object-store URL (nothing is opened)."""
        text = os.fspath(where)
        if not is_url(text):
            return cls(url=text, local=Path(text))
        parsed = urllib.parse.urlparse(text)
        if parsed.scheme == "file":
            return cls(url=text, local=Path(urllib.parse.unquote(parsed.path)))
        if not parsed.netloc:
            msg = f"{_display(text)}: a storage URL names its bucket (scheme://bucket/prefix)"
            raise CheckpointError(msg)
        return cls(url=text)

    @functools.cached_property
    def fs(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` of a remote location, made on first use."""
        import pyarrow.fs as pafs

        url = self.url
        parsed = urllib.parse.urlparse(url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        if parsed.scheme == "s3" and "endpoint_override" in query and "region" not in query:
            # An S3-compatible server has no region to look up (pyarrow would ask AWS).
            url = urllib.parse.urlunparse(
                parsed._replace(query=urllib.parse.urlencode({**query, "region": "us-east-1"}))
            )
        try:
            fs, _ = pafs.FileSystem.from_uri(url)
        except (ValueError, OSError) as exc:
            msg = f"{self}: not a storage URL pyarrow can open ({exc})"
            raise CheckpointError(msg) from exc
        return fs

    @property
    def base(self) -> str:
        """The folder inside :attr:`fs` (``bucket/prefix``)."""
        parsed = urllib.parse.urlparse(self.url)
        return (parsed.netloc + parsed.path).rstrip("/")

    @property
    def is_remote(self) -> bool:
        return self.local is None

    def __str__(self) -> str:
        return _display(self.url)

    def child(self, name: str) -> Location:
        """The sub-folder ``name`` (a single path segment, or several joined by ``/``)."""
        if self.local is not None:
            return Location(url=str(self.local / name), local=self.local / name)
        parsed = urllib.parse.urlparse(self.url)
        path = parsed.path.rstrip("/") + "/" + name
        return Location(url=urllib.parse.urlunparse(parsed._replace(path=path)))

    def _remote(self, name: str) -> str:
        return f"{self.base}/{name}"

    # --- files ----------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names of the files directly in this folder, sorted; [] when it does not exist."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return sorted(p.name for p in self.local.iterdir() if p.is_file())
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.base, allow_not_found=True, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except OSError as exc:
            raise self._error("list", exc) from exc
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write file ``name`` all or nothing (see the module docstring)."""
        if self.local is not None:
            from embedding_store.persistence import write_file_atomic

            self.local.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.local / name, lambda f: f.write(data))
            return
        try:
            with self.fs.open_output_stream(self._remote(name)) as out:
                out.write(data)
        except OSError as exc:
            raise self._error(f"write {name}", exc) from exc

    def read_bytes(self, name: str) -> bytes:
        """The contents of file ``name``; :class:`FileNotFoundError` when there is none."""
        if self.local is not None:
            return (self.local / name).read_bytes()
        try:
            with self.fs.open_input_stream(self._remote(name)) as f:
                data: bytes = f.read()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if _not_found(exc):
                raise FileNotFoundError(f"{self}/{name}") from exc
            raise self._error(f"read {name}", exc) from exc
        return data

    def delete(self, name: str) -> None:
        """Remove file ``name``; a missing file is not an error."""
        if self.local is not None:
            (self.local / name).unlink(missing_ok=True)
            return
        try:
            self.fs.delete_file(self._remote(name))
        except FileNotFoundError:
            return
        except OSError as exc:
            if not _not_found(exc):
                raise self._error(f"delete {name}", exc) from exc

    def upload(self, source: Path, name: str | None = None) -> None:
        """Copy local file ``source`` here as ``name`` (default: its own name), streamed."""
        target = name or source.name
        if self.local is not None:
            from embedding_store.persistence import write_file_atomic

            self.local.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as src:
                write_file_atomic(
                    self.local / target, lambda f: shutil.copyfileobj(src, f, _COPY_BUFFER)
                )
            return
        try:
            with source.open("rb") as src, self.fs.open_output_stream(self._remote(target)) as out:
                while chunk := src.read(_COPY_BUFFER):
                    out.write(chunk)
        except OSError as exc:
            raise self._error(f"upload {target}", exc) from exc

    def download(self, name: str, target: Path) -> None:
        """Copy file ``name`` to local path ``target`` (written atomically)."""
        from embedding_store.persistence import write_file_atomic

        target.parent.mkdir(parents=True, exist_ok=True)
        if self.local is not None:
            with (self.local / name).open("rb") as src:
                write_file_atomic(target, lambda f: shutil.copyfileobj(src, f, _COPY_BUFFER))
            return

        def copy(f: Any) -> None:
            with self.fs.open_input_stream(self._remote(name)) as src:
                while chunk := src.read(_COPY_BUFFER):
                    f.write(chunk)

        try:
            write_file_atomic(target, copy)
        except OSError as exc:
            if _not_found(exc):
                raise FileNotFoundError(f"{self}/{name}") from exc
            raise self._error(f"download {name}", exc) from exc

    def check(self) -> None:
        """Raise :class:`CheckpointError` unless this folder can be listed, written and read."""
        probe = f".streamrec-probe-{os.getpid()}"
        try:
            self.names()
            self.write_bytes(probe, b"ok")
            if self.read_bytes(probe) != b"ok":
                msg = f"{self}: a file written here reads back different"
                raise CheckpointError(msg)
        except OSError as exc:
            raise self._error("write a test file", exc) from exc
        finally:
            with contextlib.suppress(CheckpointError):
                self.delete(probe)

    def _error(self, what: str, exc: BaseException) -> CheckpointError:
        return CheckpointError(f"{self}: cannot {what} ({exc})")


def _not_found(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "not found" in text.lower()


def _display(url: str) -> str:
    """``url`` without secrets a query may carry (``secret_key``, ``session_token``).

    >>> _display("s3://b/p?endpoint_override=h:1&secret_key=abc")
    's3://b/p?endpoint_override=h:1&secret_key=***'
    """
    if "?" not in url:
        return url
    head, _, query = url.partition("?")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    shown = [f"{k}={'***' if ('secret' in k or 'token' in k) else v}" for k, v in pairs]
    return head + "?" + "&".join(shown)
