"""Local files the project writes or reads on another's word.

- Files that are read while they are rewritten (a run's record, the local autoscaler's state, a
  benchmark's results, a fault plan the ranks read at every point) are replaced whole.
- A folder the user's processes share files through (the model cache, the record of submissions)
  is the user's own: `private_folder`.
- A key or relative path read from storage or from a run folder (an S3 listing, a checkpoint's
  metadata, a cache entry's name) becomes a local path only through `path_inside`: a job writes its
  own keys, and the machine that exports its checkpoint is the user's. `create_inside` writes one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


def replace_whole(path: Path, text: str) -> None:
    """Write `text` to `path` in one rename: a reader sees the old file or the new one, never half of
    one, and a writer killed mid-write leaves the last complete file. The draft is named by the
    writer's pid, so two processes that write the same file never share one."""
    draft = path.with_name(f".{path.name}.{os.getpid()}.draft")
    draft.write_text(text)
    draft.replace(path)


def private_folder(path: Path, *, what: str, instead: str) -> Path:
    """`path`, a folder only this user can write, made (0700) when absent. ValueError naming it, and
    `instead` (what to do), when it, or the link it is reached by, belongs to another user, or when
    other users may write to it: another account could plant files there, or take what is fetched."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for info in (os.lstat(path), os.stat(path)):
        if info.st_uid != os.geteuid():
            raise ValueError(f"{what} {path} is owned by another user (uid {info.st_uid}), not you: {instead}")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{what} {path} is writable by other users (mode {mode:o}): chmod go-w {path}, or "
                         f"{instead}")
    return path


def _refused(key: str, why: str) -> ValueError:
    return ValueError(f"refused the key {key!r}: {why}")


def key_parts(key: str) -> list[str]:
    """The parts of `key`, a '/'-separated relative path; ValueError naming it when it is empty or
    absolute, or has an empty, `.` or `..` part or a NUL: each could name a place outside the folder
    it is read below, or two keys one file."""
    if not key:
        raise _refused(key, "it is empty")
    if key.startswith("/"):
        raise _refused(key, "it is absolute; keys are paths inside the folder they are read from")
    parts = key.split("/")
    for part in parts:
        if part == "..":
            raise _refused(key, "'..' climbs out of the folder it is read below")
        if part in ("", "."):
            raise _refused(key, "it has an empty or '.' part")
        if "\x00" in part:
            raise _refused(key, "it holds a NUL character")
    return parts


def path_inside(root: Path, key: str) -> Path:
    """The local path of `key` (a relative path read from storage or from a run folder) inside the
    folder `root`, which need not exist yet. ValueError naming the key when it is not a plain
    relative path (`key_parts`) or when any part of it that exists below `root` is a symbolic link:
    a link could lead anywhere, so none below `root` is followed. `root` itself is the caller's."""
    parts = key_parts(key)
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise _refused(key, f"{path} is a symbolic link, and links below {root} are never followed")
    return path


def create_inside(root: Path, key: str) -> BinaryIO:
    """A file opened for writing (created, or emptied) at `key` inside the folder `root`, with the
    folders on the way made. Each part is opened relative to the one before it with O_NOFOLLOW, so
    a link put on the way after `path_inside` checked it is refused too, never followed."""
    parts = path_inside(root, key).relative_to(root).parts
    Path(root).mkdir(parents=True, exist_ok=True)
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=folder)
            below = _open_no_link(key, root, part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder)
            os.close(folder)
            folder = below
        file = _open_no_link(key, root, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=folder)
    finally:
        os.close(folder)
    return os.fdopen(file, "wb")


def _open_no_link(key: str, root: Path, part: str, flags: int, *, dir_fd: int) -> int:
    try:
        return os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(key, f"{part!r} on its way is a symbolic link or not a folder, and links below "
                                f"{root} are never followed") from None
        raise
