"""Where the loop finds a file or folder named in its config (data.path, data.tokenizer,
model.name_or_path).

`python -m workloads submit` uploads local files with the job and names them relative to the job's
folder (the uploaded working_dir), because Ray Train runs each worker in a folder of its own, where a
relative path names nothing. A value that is neither absolute nor found from the current folder is
therefore looked up in the folder that holds the `workloads` package: the job's folder on a cluster,
the checkout elsewhere.
"""

from __future__ import annotations

import socket
from pathlib import Path

JOB_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the `workloads` package."""

_PATH_SYNTAX = ("/", "./", "../", "~")


def looks_like_path(value: str) -> bool:
    """Written as a path (absolute, ./, ../, ~), not as a Hugging Face id such as org/name."""
    return value.startswith(_PATH_SYNTAX)


def resolve_path(value: str, *, field: str, hub_id_allowed: bool) -> str:
    """The value with a relative path found in the job's folder made absolute. ValueError for a
    value written as a path that names nothing here, rather than letting Hugging Face take it for
    a hub id and fail minutes later asking for an internet connection."""
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    if not path.is_absolute() and (JOB_ROOT / path).exists():
        return str(JOB_ROOT / path)
    if hub_id_allowed and not looks_like_path(value):
        return value
    raise ValueError(f"{field} {value!r} is not a file or folder on {socket.gethostname()}: give a path "
                     "that exists on the nodes, or submit from the folder that holds it so that it is "
                     "uploaded with the job")
