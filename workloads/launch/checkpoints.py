"""A run's checkpoints in storage: which ones Ray Train registered, and removing the others.

Ray Train registers a checkpoint (in `checkpoint_manager_snapshot.json`, beside the run's checkpoint
folders) only once every rank has reported it, so `ray.train.get_checkpoint()` never hands out a
half-written one. But a rank killed while the checkpoint is written leaves its folder behind, holding
the other ranks' shards and, from rank 0, the `.metadata` that makes it look complete to
torch.distributed.checkpoint. Ray deletes only registered checkpoints (those beyond `num_to_keep`), so
that folder would stay in the bucket forever. `remove_unregistered` deletes such folders when the next
attempt starts, before any rank of it writes a checkpoint.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    import pyarrow.fs

SNAPSHOT_NAME = "checkpoint_manager_snapshot.json"
"""Ray Train's record of the run's registered checkpoints, in the run's storage folder."""
CHECKPOINT_PREFIX = "checkpoint_"
"""How Ray Train names a checkpoint folder (checkpoint_<date>_<time>)."""


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


def remove_unregistered(filesystem: "pyarrow.fs.FileSystem", run_path: str, *,
                        say: Callable[[str], None]) -> list[str]:
    """Delete the checkpoint folders under `run_path` that Ray Train never registered; returns their
    names. Call it when no rank of the run can be writing a checkpoint (before an attempt's first)."""
    import pyarrow.fs

    run_path = run_path.rstrip("/")
    listing = filesystem.get_file_info(pyarrow.fs.FileSelector(run_path, allow_not_found=True))
    folders = [info.base_name for info in listing if info.type == pyarrow.fs.FileType.Directory]
    snapshot_path = f"{run_path}/{SNAPSHOT_NAME}"
    snapshot = None
    if filesystem.get_file_info(snapshot_path).type == pyarrow.fs.FileType.File:
        with filesystem.open_input_stream(snapshot_path) as stream:
            snapshot = stream.read().decode()
    registered = registered_names(snapshot)
    if registered is None:
        say(f"cannot read {SNAPSHOT_NAME} (another Ray version's format?): no incomplete checkpoint removed")
        return []
    broken = unregistered(folders, registered)
    for name in broken:
        filesystem.delete_dir(f"{run_path}/{name}")
    if broken:
        say(f"removed {len(broken)} incomplete checkpoint(s) that a failed attempt left in storage "
            f"(written by some ranks, never registered): {', '.join(broken)}")
    return broken
