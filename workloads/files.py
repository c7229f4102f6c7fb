"""Files that are read while they are rewritten (a run's record, the local autoscaler's state, a
benchmark's results, a fault plan the ranks read at every point) are replaced whole."""

from __future__ import annotations

import os
from pathlib import Path


def replace_whole(path: Path, text: str) -> None:
    """Write `text` to `path` in one rename: a reader sees the old file or the new one, never half of
    one, and a writer killed mid-write leaves the last complete file. The draft is named by the
    writer's pid, so two processes that write the same file never share one."""
    draft = path.with_name(f".{path.name}.{os.getpid()}.draft")
    draft.write_text(text)
    draft.replace(path)
