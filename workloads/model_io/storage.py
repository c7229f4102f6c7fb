"""Files under a local folder or an s3:// prefix.

S3 goes through pyarrow's filesystem (the one Ray Train uses for its storage), so an S3 location
honours the standard AWS environment the same way: credentials, AWS_REGION, and
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible stores. Local folders need nothing but
the standard library, so a machine without pyarrow (a bare GPU host, no Ray) exports local runs.

Every failure to reach or read a location is a ValueError that names the location.

Keys come from listings a job may have written (any job can write under the bucket's prefix), and
the machine that exports is the user's: every key is checked before it is used (workloads/files.py):
one that is absolute or has a `..` is refused with the key named, locally no symbolic link is
followed below the folder a location names (for reading or writing), and a listing of a local
folder lists links without following them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

from workloads.files import create_inside, key_parts, path_inside

S3_SCHEME = "s3://"
COPY_CHUNK_BYTES = 8 * 2**20


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

    def join(self, *keys: str) -> Location:
        """The location of `keys` (relative paths, "" for none) below this one. ValueError naming a key
        that is absolute or has a `..` (S3 keeps such a key as written, and a local path that takes it
        leads out), or, locally, that passes through a symbolic link."""
        joined = "/".join(part for key in keys if key for part in key_parts(key))
        if not joined:
            return self
        if not self.remote:
            path_inside(Path(self.path), joined)
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
        """Every file below this folder: relative path -> size in bytes; empty when there is none. A
        local folder's symbolic links are listed (their own size), never followed: reading one
        through `join` is refused. ValueError naming a key of an S3 listing that `join` would refuse."""
        base = self.path.rstrip("/")
        if not self.remote:
            root = Path(base)
            if not root.is_dir():
                return {}
            found = {}
            for folder, dirs, names in os.walk(root):
                for name in [*names, *(d for d in dirs if (Path(folder) / d).is_symlink())]:
                    path = Path(folder) / name
                    if path.is_symlink() or path.is_file():
                        found[path.relative_to(root).as_posix()] = path.lstat().st_size
            return found
        import pyarrow.fs

        if self._s3_info(base).type == pyarrow.fs.FileType.NotFound:
            return {}
        infos = self._s3_info(pyarrow.fs.FileSelector(base, recursive=True, allow_not_found=True))
        found = {
            info.path[len(base) + 1 :]: info.size
            for info in infos
            if info.type == pyarrow.fs.FileType.File and info.path.startswith(base + "/")
        }
        for key in found:
            try:
                key_parts(key)
            except ValueError as exc:
                raise ValueError(f"{self.uri}: {exc}") from None
        return found

    def _open(self) -> BinaryIO:
        """This file, for reading. A local one is not opened through a link (O_NOFOLLOW): `join`
        refused links on the way, and one put in its place since is refused here."""
        if self.remote:
            return self.fs.open_input_stream(self.path)
        return open(self.path, "rb", opener=lambda path, flags: os.open(path, flags | os.O_NOFOLLOW))

    def read_bytes(self) -> bytes:
        try:
            with self._open() as stream:
                return stream.read()
        except OSError as exc:
            raise ValueError(f"cannot read {self.uri}: {_reason(exc)}") from None

    def _copy_file(self, name: str, dest: Location) -> None:
        """The file `name` below this folder to the same name below `dest`, either local or in S3. A
        local destination is written by `create_inside`: no link below it is followed."""
        source = self.join(name)
        if dest.remote:
            import pyarrow.fs

            pyarrow.fs.copy_files(source.path, dest.join(name).path,
                                  source_filesystem=source.fs or pyarrow.fs.LocalFileSystem(),
                                  destination_filesystem=dest.fs)
            return
        with source._open() as stream, create_inside(Path(dest.path), name) as out:
            shutil.copyfileobj(stream, out, COPY_CHUNK_BYTES)

    def copy_to(self, dest: Location, *, names: Optional[list[str]] = None) -> None:
        """Copy this folder's files (or only `names`, relative paths) below `dest`, local or in S3.
        Every name is checked (`join`) before the first file is written."""
        names = list(self.files()) if names is None else names
        for name in names:
            self.join(name)
            dest.join(name)
        for name in names:
            try:
                self._copy_file(name, dest)
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
        """Delete everything below this folder (locally: links removed, never followed)."""
        if self.remote:
            self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
            return
        root = Path(self.path)
        for child in root.iterdir() if root.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


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
