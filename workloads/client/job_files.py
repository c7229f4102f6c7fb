"""A local data file travels with the job: copied into its working_dir, the path rewritten.

Ray uploads the working_dir through the head node's object store, so only small files go this
way; a bigger one is refused before anything is submitted, with how to put it in S3 instead.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Optional

MAX_UPLOAD_MIB = 100
"""The largest data file sent with a job (Ray's working_dir limit is 500 MiB in all)."""

UPLOAD_DIR = "job_data"
"""The folder of the job's working_dir the file lands in; the rewritten relative path is found
there on every node (workloads/model_io/sources.py, `fetch_data_file`)."""


def local_data_file(train: dict) -> Optional[Path]:
    """The data file of a "jsonl" config when it is a file on this machine (not s3://)."""
    data = train.get("data", {})
    path = data.get("path", "")
    if data.get("kind") != "jsonl" or not path or "://" in path:
        return None
    local = Path(path).expanduser()
    return local if local.is_file() else None


def check_uploadable(train: dict) -> None:
    """ValueError when the config's local data file is too big to travel with the job."""
    path = local_data_file(train)
    if path is None:
        return
    size_mib = path.stat().st_size / 2**20
    if size_mib > MAX_UPLOAD_MIB:
        raise ValueError(
            f"data.path {str(path)!r} is {size_mib:,.0f} MiB, more than the {MAX_UPLOAD_MIB} MiB a job takes "
            f"along: copy it to S3 (aws s3 cp {path} s3://BUCKET/data/{path.name}) and set "
            f"data.path=s3://BUCKET/data/{path.name}"
        )


def stage_data_file(train: dict, working_dir: Path) -> dict:
    """The config with its local data file copied under `working_dir` and its path pointing there."""
    path = local_data_file(train)
    if path is None:
        return train
    check_uploadable(train)
    (working_dir / UPLOAD_DIR).mkdir(exist_ok=True)
    shutil.copy2(path, working_dir / UPLOAD_DIR / path.name)
    staged = copy.deepcopy(train)
    staged["data"]["path"] = f"{UPLOAD_DIR}/{path.name}"
    return staged
