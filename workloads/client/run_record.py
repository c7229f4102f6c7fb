"""What the client submitted for each run, kept on the machine it was submitted from.

Every submission (`submit`, and `run --local`, which submits to its own cluster) writes the run's
storage URI, the training config the job was sent (its model, the hub revisions pinned at
submission) and the local files uploaded with the job, to one JSON file per run under
$XDG_STATE_HOME/workloads/submitted (~/.local/state/...), a folder only the user may write. A job can
write anything under its storage prefix, checkpoints included, but not this: so `export` takes a
LoRA run's base from here (workloads/model_io/lora_base.py), and for a local run from before these
records, from the run's run.json, which the client wrote too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from workloads.client.runs import now, read_run
from workloads.files import private_folder, replace_whole
from workloads.model_io.cache import entry_name
from workloads.model_io.lora_base import LoraBase
from workloads.model_io.storage import is_s3

INSTEAD = "set XDG_STATE_HOME to a folder only you can write"


def records_folder() -> Path:
    state = os.environ.get("XDG_STATE_HOME", "")
    return (Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state") / "workloads" / "submitted"


def run_uri(storage_path: str, run_name: str) -> str:
    """Where Ray Train keeps the run's checkpoints: `<storage>/<run>`."""
    return f"{storage_path.rstrip('/')}/{run_name}"


def record_submission(*, run_name: str, storage_path: str, train: dict,
                      files: tuple[tuple[str, Path], ...] = ()) -> Path:
    """Record a submission (the run's latest replaces its earlier ones); the record's path."""
    folder = private_folder(records_folder(), what="the folder of submission records", instead=INSTEAD)
    run = run_uri(storage_path, run_name)
    path = folder / f"{entry_name(run_name)}-{hashlib.sha256(run.encode()).hexdigest()[:12]}.json"
    record = {"run": run, "run_name": run_name, "storage_path": storage_path, "submitted": now(), "train": train,
              "files": {place: str(local) for place, local in files}}
    replace_whole(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def _within(uri: str, run: str) -> bool:
    """`uri` is the run's storage folder `run` or lies below it."""
    if not run:
        return False
    if not (is_s3(uri) or is_s3(run)):
        uri, run = os.path.realpath(uri), os.path.realpath(run)
    return uri == run.rstrip("/") or uri.startswith(run.rstrip("/") + "/")


def _base(train: object, *, files: dict, told_by: str) -> Optional[LoraBase]:
    model = train.get("model") if isinstance(train, dict) else None
    name = str((model or {}).get("name_or_path") or "")
    if not name:
        return None
    return LoraBase(name_or_path=name, revision=str(model.get("revision") or ""),
                    source=str((files or {}).get(name) or ""), told_by=told_by)


def _from_records(checkpoint_uri: str) -> Optional[LoraBase]:
    folder = records_folder()
    if not folder.is_dir():
        return None
    private_folder(folder, what="the folder of submission records", instead=INSTEAD)
    found = []
    for path in folder.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _within(checkpoint_uri, str(record.get("run") or "")):
            found.append((len(str(record["run"])), str(record.get("submitted") or ""), path, record))
    if not found:
        return None
    *_, path, record = max(found)  # the innermost run, its latest submission
    return _base(record.get("train"), files=record.get("files") or {}, told_by=f"the submission record {path}")


def _from_run_json(checkpoint_uri: str) -> Optional[LoraBase]:
    """A local run's run.json (written by `run --local` before the job started): its storage is the
    run folder's checkpoints/<name>."""
    if is_s3(checkpoint_uri):
        return None
    path = Path(os.path.realpath(checkpoint_uri))
    for folder in (path, *path.parents):
        record = read_run(folder)
        if record is not None and record.get("name") and _within(str(path), str(folder / "checkpoints" /
                                                                             str(record["name"]))):
            return _base(record.get("train"), files={}, told_by=str(folder / "run.json"))
    return None


def submitted_base(checkpoint_uri: str) -> Optional[LoraBase]:
    """The base model the run holding the checkpoint at `checkpoint_uri` (local or s3://) was
    submitted with, as the client recorded it; None when no record of that run is found here."""
    return _from_records(checkpoint_uri) or _from_run_json(checkpoint_uri)
