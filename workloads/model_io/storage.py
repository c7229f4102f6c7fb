"""Files under a local folder or an s3:// prefix.

S3 goes through pyarrow's filesystem (the one Ray Train uses for its storage), so an S3 location
honours the standard AWS environment the same way: credentials, AWS_REGION, and
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible stores. Local folders need nothing but
the standard library, so a machine without pyarrow (a bare GPU host, no Ray) exports local runs.

Every failure to reach or read a location is a ValueError that names the location.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

S3_SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_SCHEME)


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@dataclass(frozen=True, kw_only=True)
class Location:
    """A folder (or one file) on a local disk or in S3."""

    path: str
    """An absolute local path, or bucket/key for S3."""
    uri: str
    """How the user wrote it, for messages."""
    fs: Optional[Any] = None
    """The pyarrow.fs.FileSystem of an S3 location; None for a local one."""

    @property
    def remote(self) -> bool:
        return self.fs is not None

    def join(self, *parts: str) -> Location:
        joined = "/".join(p.strip("/") for p in parts if p.strip("/"))
        if not joined:
            return self
        return Location(path=f"{self.path.rstrip('/')}/{joined}", uri=f"{self.uri.rstrip('/')}/{joined}", fs=self.fs)

    def _s3_info(self, selector_or_path):
        try:
            return self.fs.get_file_info(selector_or_path)
        except OSError as exc:
            raise ValueError(f"cannot read {self.uri}: {_reason(exc)}") from None

    def is_file(self) -> bool:
        if not self.remote:
            return Path(self.path).is_file()
        import pyarrow.fs

        return self._s3_info(self.path).type == pyarrow.fs.FileType.File

    def size(self) -> int:
        if not self.remote:
            return Path(self.path).stat().st_size
        return self._s3_info(self.path).size or 0

    def files(self) -> dict[str, int]:
        """Every file below this folder: relative path -> size in bytes; empty when there is none."""
        base = self.path.rstrip("/")
        if not self.remote:
            root = Path(base)
            if not root.is_dir():
                return {}
            found = {}
            for folder, _, names in os.walk(root, followlinks=True):
                for name in names:
                    path = Path(folder) / name
                    if path.is_file():
                        found[path.relative_to(root).as_posix()] = path.stat().st_size
            return found
        import pyarrow.fs

        if self._s3_info(base).type == pyarrow.fs.FileType.NotFound:
            return {}
        infos = self._s3_info(pyarrow.fs.FileSelector(base, recursive=True, allow_not_found=True))
        return {
            info.path[len(base) + 1 :]: info.size
            for info in infos
            if info.type == pyarrow.fs.FileType.File and info.path.startswith(base + "/")
        }

    def read_bytes(self) -> bytes:
        try:
            if not self.remote:
                return Path(self.path).read_bytes()
            with self.fs.open_input_stream(self.path) as stream:
                return stream.read()
        except OSError as exc:
            raise ValueError(f"cannot read {self.uri}: {_reason(exc)}") from None

    def _copy_file(self, source: Location, dest: Location) -> None:
        """One file from `source` to `dest`, either of them local or in S3."""
        if not dest.remote:
            Path(dest.path).parent.mkdir(parents=True, exist_ok=True)
        if not source.remote and not dest.remote:
            shutil.copy2(source.path, dest.path)
            return
        import pyarrow.fs

        local = pyarrow.fs.LocalFileSystem()
        pyarrow.fs.copy_files(source.path, dest.path, source_filesystem=source.fs or local,
                              destination_filesystem=dest.fs or local)

    def copy_to(self, dest: Location, *, names: Optional[list[str]] = None) -> None:
        """Copy this folder's files (or only `names`, relative paths) below `dest`, local or in S3."""
        for name in names if names is not None else list(self.files()):
            try:
                self._copy_file(self.join(name), dest.join(name))
            except OSError as exc:
                raise ValueError(
                    f"cannot copy {self.join(name).uri} to {dest.join(name).uri}: {_reason(exc)}") from None

    def download(self, target: Path, *, names: Optional[list[str]] = None) -> None:
        """Copy this folder's files (or only `names`) into the local folder `target`."""
        self.copy_to(local_location(target), names=names)

    def upload_from(self, source: Path) -> None:
        """Copy every file of the local folder `source` below this location."""
        local_location(source).copy_to(self)

    def clear(self) -> None:
        """Delete everything below this folder."""
        if self.remote:
            self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def local_location(path: Path) -> Location:
    return Location(path=os.path.abspath(path), uri=str(path))


def locate(uri: str) -> Location:
    """A Location for `s3://bucket/prefix` or a local path (relative ones are made absolute)."""
    if is_s3(uri):
        if len(uri) <= len(S3_SCHEME) or uri[len(S3_SCHEME)] == "/":
            raise ValueError(f"{uri!r} names no bucket: use s3://BUCKET/PREFIX")
        import pyarrow.fs

        try:
            fs, path = pyarrow.fs.FileSystem.from_uri(uri.rstrip("/"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot open {uri}: {_reason(exc)}") from None
        return Location(path=path, uri=uri.rstrip("/"), fs=fs)
    if "://" in uri:
        raise ValueError(f"{uri!r}: only local paths and s3:// URIs are supported")
    return Location(path=os.path.abspath(os.path.expanduser(uri)), uri=uri)
