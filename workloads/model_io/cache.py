"""A cache of downloaded models and data files that every process of one user on a machine shares.

Each entry is filled once per machine: the first process to ask takes an exclusive lock on the
entry (fcntl, released by the kernel if the process dies), fills a private temporary folder and
renames it into place; the others wait on the lock and then find the entry complete. So eight
ranks of one node make one download, and a killed download leaves no half-filled entry behind.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workloads.files import path_inside, private_folder

CACHE_ENV = "WORKLOADS_CACHE"
"""Environment variable naming the cache folder when the config leaves it empty."""


def cache_root(configured: str = "") -> Path:
    """The configured folder, else $WORKLOADS_CACHE, else the user's own `workloads` folder under
    $XDG_CACHE_HOME (~/.cache): on one machine, the same folder for every process of the user (a
    pod's ranks run as one user). `fill_once` refuses a folder that is not the user's alone."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    default = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "workloads"
    return Path(configured or os.environ.get(CACHE_ENV) or default).expanduser()


def entry_name(*parts: str) -> str:
    """A file-system-safe entry name made of `parts` (a URI, a hub id and revision, ...)."""
    return "--".join(re.sub(r"[^A-Za-z0-9._-]+", "_", part).strip("_") or "_" for part in parts)


@dataclass(frozen=True, kw_only=True)
class Entry:
    path: Path
    """The complete entry folder."""
    filled_here: bool
    """This process filled it (False: it was already there, or another process filled it)."""


def fill_once(root: Path, name: str, fill: Callable[[Path], None]) -> Entry:
    """The folder `root/name`, filled by `fill(folder)` unless it already exists; once per machine."""
    private_folder(root, what="cache folder",
                   instead=f"set {CACHE_ENV} (or cache_dir) to a folder only you can write, such as ~/.cache/workloads")
    target = path_inside(root, name)
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_dir():
                return Entry(path=target, filled_here=False)
            partial = root / f"{name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            try:
                fill(partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            os.rename(partial, target)
            return Entry(path=target, filled_here=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
