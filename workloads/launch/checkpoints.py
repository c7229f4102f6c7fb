"""A run's checkpoints in storage: which ones Ray Train registered, which are complete, and which to
remove or resume from when an attempt starts.

Ray Train registers a checkpoint (in `checkpoint_manager_snapshot.json`, beside the run's checkpoint
folders) only once every rank has reported it, so `ray.train.get_checkpoint()` never hands out a
half-written one. Two things can leave an unregistered folder behind:
- a rank killed while the checkpoint is written: the folder holds the other ranks' shards and, from
  rank 0, the `.metadata` that makes it look complete to torch.distributed.checkpoint, but not the
  killed rank's shard. Ray deletes only registered checkpoints, so it would stay in the bucket forever;
- the Ray head lost after every rank uploaded its part but before its controller registered the
  checkpoint (Ray 2.58's CheckpointManager registers in `after_report`, once it has every rank's
  report, then writes the snapshot): the folder is complete, and the newest the run has, but the
  resubmitted run's controller restores from the snapshot, which names an older one.
`settle` runs when an attempt starts, before any rank of it writes a checkpoint: it finds the newest
*complete* checkpoint (every file its DCP metadata names is in storage, and its progress.json), resumes
from it when it is newer than the newest registered one, so that a lost head costs at most the steps
since the newest complete checkpoint, and deletes the other unregistered folders.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    import pyarrow.fs

SNAPSHOT_NAME = "checkpoint_manager_snapshot.json"
"""Ray Train's record of the run's registered checkpoints, in the run's storage folder."""
CHECKPOINT_PREFIX = "checkpoint_"
"""How Ray Train names a checkpoint folder (checkpoint_<date>_<time>)."""
PROGRESS_FILE = "progress.json"
"""The loop's record of a checkpoint's step (workloads/train/checkpoint.py), written by rank 0."""


def registered_names(snapshot: Optional[str]) -> Optional[set[str]]:
    """The checkpoint folders a snapshot's text registers (none without a snapshot), or None when the
    text is not a snapshot this code understands: then nothing may be deleted."""
    if snapshot is None:
        return set()
    try:
        state = json.loads(snapshot)
        results = [*state["checkpoint_results"], *state["pending_training_results"]]
        if state.get("latest_checkpoint_result"):
            results.append(state["latest_checkpoint_result"])
        return {result["checkpoint_dir_name"] for result in results}
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def unregistered(folders: Iterable[str], registered: set[str]) -> list[str]:
    """The checkpoint folders among `folders` (base names) that are not registered."""
    return sorted(name for name in folders if name.startswith(CHECKPOINT_PREFIX) and name not in registered)


def latest_registered(snapshot: Optional[str]) -> Optional[str]:
    """The checkpoint folder a snapshot names as the run's latest, or None."""
    try:
        latest = json.loads(snapshot or "null")["latest_checkpoint_result"] if snapshot else None
        return latest["checkpoint_dir_name"] if latest else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def _read(filesystem: "pyarrow.fs.FileSystem", path: str) -> Optional[bytes]:
    import pyarrow.fs

    if filesystem.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def complete_step(filesystem: "pyarrow.fs.FileSystem", folder: str) -> Optional[int]:
    """The step of the checkpoint folder when it is complete in storage: its DCP metadata (read
    without running anything it holds) names files every one of which is there, and its
    progress.json gives the step. None when any part is missing or unreadable."""
    import pyarrow.fs

    from workloads.model_io.safe_checkpoint import METADATA_FILE, read_checkpoint_metadata

    metadata = _read(filesystem, f"{folder}/{METADATA_FILE}")
    progress = _read(filesystem, f"{folder}/{PROGRESS_FILE}")
    if metadata is None or progress is None:
        return None
    with tempfile.TemporaryDirectory(prefix="checkpoint-metadata-") as tmp:
        (Path(tmp) / METADATA_FILE).write_bytes(metadata)
        try:
            parsed = read_checkpoint_metadata(Path(tmp))
            step = int(json.loads(progress)["step"])
        except (ValueError, KeyError, TypeError):
            return None
    listing = filesystem.get_file_info(pyarrow.fs.FileSelector(folder, recursive=True))
    present = {info.path[len(folder) + 1:] for info in listing if info.type == pyarrow.fs.FileType.File}
    needed = {str(info.relative_path) for info in (parsed.storage_data or {}).values()}
    return step if needed and needed <= present else None


@dataclass(frozen=True)
class Settled:
    removed: list[str]
    """Unregistered folders deleted: incomplete ones, and complete ones older than what is resumed."""
    resume_from: Optional[str]
    """A complete, unregistered checkpoint newer than the newest registered one, to resume from
    instead of it; None: resume as Ray Train says."""
    resume_step: Optional[int] = None
    registered_step: Optional[int] = None


def settle(filesystem: "pyarrow.fs.FileSystem", run_path: str, *, say: Callable[[str], None]) -> Settled:
    """Decide, when an attempt starts, which checkpoint it resumes from and delete the unregistered
    folders it does not need. Call it when no rank of the run can be writing a checkpoint."""
    import pyarrow.fs

    run_path = run_path.rstrip("/")
    listing = filesystem.get_file_info(pyarrow.fs.FileSelector(run_path, allow_not_found=True))
    folders = [info.base_name for info in listing if info.type == pyarrow.fs.FileType.Directory]
    snapshot_bytes = _read(filesystem, f"{run_path}/{SNAPSHOT_NAME}")
    snapshot = None if snapshot_bytes is None else snapshot_bytes.decode()
    registered = registered_names(snapshot)
    if registered is None:
        say(f"cannot read {SNAPSHOT_NAME} (another Ray version's format?): no incomplete checkpoint removed")
        return Settled(removed=[], resume_from=None)
    latest = latest_registered(snapshot)
    registered_step = None if latest is None else complete_step(filesystem, f"{run_path}/{latest}")
    steps = {name: complete_step(filesystem, f"{run_path}/{name}") for name in unregistered(folders, registered)}
    # Ray names checkpoint folders by the time they were saved: the order of their names is the run's.
    newer = sorted(name for name, step in steps.items() if step is not None and (latest is None or name > latest))
    resume_from = newer[-1] if newer else None
    resume_step = None if resume_from is None else steps[resume_from]
    removed = [name for name in steps if name != resume_from]
    for name in removed:
        filesystem.delete_dir(f"{run_path}/{name}")
    if resume_from is not None:
        say(f"resuming from {resume_from} (step {resume_step}): complete in storage but never registered (the "
            f"Ray head was lost before it registered it); Ray Train's latest is "
            f"{latest or 'none'}{'' if registered_step is None else f' (step {registered_step})'}")
    if removed:
        say(f"removed {len(removed)} unregistered checkpoint(s): written by some ranks only, or older than the one "
            f"the run resumes from: {', '.join(removed)}")
    return Settled(removed=removed, resume_from=resume_from, resume_step=resume_step,
                   registered_step=registered_step)
