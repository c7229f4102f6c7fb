"""A checkpoint's upload to the run's storage, when that storage may not answer for a while.

An S3 outage, or a network partition between the nodes and S3, must not end a run that can go on
training. Each rank tries its part of a checkpoint again after a pause (pyarrow's S3 client already
retries each request, for about 6 s against an endpoint that does not answer); a checkpoint that
some rank still could not store is skipped by every rank together (workloads/launch/ray_train.py),
with a warning, and training goes on: a restart resumes from the last checkpoint that was stored,
as it would without the outage. The folder a skipped checkpoint left half-written in storage is
deleted once storage answers again. The final checkpoint holds the trained model: it is tried for
longer, and the attempt fails (to be retried from the last stored one) rather than end the run
without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generic, Optional, TypeVar

if TYPE_CHECKING:
    import pyarrow.fs

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class UploadPolicy:
    tries: int = 2
    """Tries of a periodic checkpoint (or one on a drain notice) before it is skipped. Training waits
    meanwhile: every rank meets at the checkpoint, so each try costs the run its time."""
    pause_s: float = 2.0
    """Pause between those tries."""
    final_wait_s: float = 600.0
    """How long the final checkpoint (the trained model) is tried before the attempt fails."""
    final_pause_s: float = 15.0
    """Pause between tries of the final checkpoint."""


DEFAULT_POLICY = UploadPolicy()


@dataclass(frozen=True, kw_only=True)
class Upload(Generic[T]):
    stored: Optional[T]
    """What the upload returned (the persisted checkpoint), or None when every try failed."""
    error: str = ""
    """The last try's error, when none succeeded."""
    tries: int = 1


def last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def upload_patiently(upload: Callable[[], T], *, final: bool, policy: UploadPolicy = DEFAULT_POLICY,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> Upload[T]:
    """`upload()` tried as `policy` says for a periodic (`final` False) or the final checkpoint.
    Only storage errors (OSError: pyarrow's, Ray's copy of the files) are tried again."""
    started, tries = clock(), 0
    while True:
        tries += 1
        try:
            return Upload(stored=upload(), tries=tries)
        except OSError as exc:
            error = last_line(exc)
        if final:
            if clock() - started + policy.final_pause_s > policy.final_wait_s:
                return Upload(stored=None, error=error, tries=tries)
            sleep(policy.final_pause_s)
        else:
            if tries >= policy.tries:
                return Upload(stored=None, error=error, tries=tries)
            sleep(policy.pause_s)


@dataclass
class UnregisteredFolders:
    """Checkpoint folders in storage that Ray Train never registered, so nothing else deletes them
    while the attempt lives (rank 0's list): a skipped checkpoint's (some ranks' parts may be there),
    or the complete one the attempt resumed from after a head was lost before registering it
    (workloads/launch/checkpoints.py), once a newer one is stored."""

    names: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        self.names.append(name)

    def remove(self, filesystem: "pyarrow.fs.FileSystem", run_path: str) -> list[str]:
        """Delete each folder under `run_path` (what is not there counts as deleted); those that
        could not be are kept for the next call. Returns the names deleted."""
        import pyarrow.fs

        deleted = []
        for name in list(self.names):
            path = f"{run_path.rstrip('/')}/{name}"
            try:
                if filesystem.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
                    filesystem.delete_dir(path)
            except OSError:
                continue
            self.names.remove(name)
            deleted.append(name)
        return deleted
