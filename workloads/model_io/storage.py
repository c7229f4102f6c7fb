"""Files under a local folder or an s3:// prefix, through pyarrow's filesystems (the ones Ray Train
uses for its storage), so an S3 location honours the standard AWS environment the same way:
credentials, AWS_REGION, and AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible stores.

Every failure to reach or read a location is a ValueError that names the location.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

S3_SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_SCHEME)


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@dataclass(frozen=True, kw_only=True)
class Location:
    """A folder (or one file) on a local disk or in S3."""

    fs: pafs.FileSystem
    path: str
    """The path on `fs` (for S3: bucket/key, no scheme)."""
    uri: str
    """How the user wrote it, for messages."""

    @property
    def remote(self) -> bool:
        return is_s3(self.uri)

    def join(self, *parts: str) -> Location:
        joined = "/".join(p.strip("/") for p in parts if p.strip("/"))
        if not joined:
            return self
        return Location(fs=self.fs, path=f"{self.path.rstrip('/')}/{joined}", uri=f"{self.uri.rstrip('/')}/{joined}")

    def _info(self, selector_or_path):
        try:
            return self.fs.get_file_info(selector_or_path)
        except OSError as exc:
            raise ValueError(f"cannot read {self.uri}: {_reason(exc)}") from None

    def is_file(self) -> bool:
        return self._info(self.path).type == pafs.FileType.File

    def size(self) -> int:
        return self._info(self.path).size or 0

    def files(self) -> dict[str, int]:
        """Every file below this folder: relative path -> size in bytes; empty when there is none."""
        base = self.path.rstrip("/")
        if self._info(base).type == pafs.FileType.NotFound:
            return {}
        infos = self._info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {
            info.path[len(base) + 1 :]: info.size
            for info in infos
            if info.type == pafs.FileType.File and info.path.startswith(base + "/")
        }

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.path) as stream:
                return stream.read()
        except OSError as exc:
            raise ValueError(f"cannot read {self.uri}: {_reason(exc)}") from None

    def download(self, target: Path, *, names: list[str] | None = None) -> None:
        """Copy this folder's files (or only `names`, relative paths) into the local folder `target`."""
        wanted = names if names is not None else list(self.files())
        local = pafs.LocalFileSystem()
        for name in wanted:
            dest = target / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                pafs.copy_files(self.join(name).path, str(dest), source_filesystem=self.fs,
                                destination_filesystem=local)
            except OSError as exc:
                raise ValueError(f"cannot download {self.join(name).uri}: {_reason(exc)}") from None

    def upload_from(self, source: Path) -> None:
        """Copy every file of the local folder `source` below this location."""
        local = pafs.LocalFileSystem()
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            dest = self.join(path.relative_to(source).as_posix())
            try:
                if not self.remote:
                    Path(dest.path).parent.mkdir(parents=True, exist_ok=True)
                pafs.copy_files(str(path), dest.path, source_filesystem=local, destination_filesystem=self.fs)
            except OSError as exc:
                raise ValueError(f"cannot write {dest.uri}: {_reason(exc)}") from None

    def copy_to(self, dest: Location) -> None:
        """Copy this folder's files below `dest` (S3 to S3 stays inside S3)."""
        for name in self.files():
            target = dest.join(name)
            try:
                if not dest.remote:
                    Path(target.path).parent.mkdir(parents=True, exist_ok=True)
                pafs.copy_files(self.join(name).path, target.path, source_filesystem=self.fs,
                                destination_filesystem=dest.fs)
            except OSError as exc:
                raise ValueError(f"cannot copy {self.join(name).uri} to {target.uri}: {_reason(exc)}") from None


def locate(uri: str) -> Location:
    """A Location for `s3://bucket/prefix` or a local path (relative ones are made absolute)."""
    if is_s3(uri):
        if len(uri) <= len(S3_SCHEME) or uri[len(S3_SCHEME)] == "/":
            raise ValueError(f"{uri!r} names no bucket: use s3://BUCKET/PREFIX")
        try:
            fs, path = pafs.FileSystem.from_uri(uri.rstrip("/"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot open {uri}: {_reason(exc)}") from None
        return Location(fs=fs, path=path, uri=uri.rstrip("/"))
    if "://" in uri:
        raise ValueError(f"{uri!r}: only local paths and s3:// URIs are supported")
    path = os.path.abspath(os.path.expanduser(uri))
    return Location(fs=pafs.LocalFileSystem(), path=path, uri=uri)
