"""Checkpoints in storage when an attempt starts: a folder Ray Train never registered is removed when it
is incomplete (a rank died writing it) or older than what the run resumes from, and resumed from when
it is complete and newer than the newest registered one (the head was lost before registering it),
as Ray 2.58 writes its snapshot; an unreadable snapshot removes nothing."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
    _CheckpointManagerState,
    _TrainingResultState,
)

import json
import warnings

import torch
import torch.distributed.checkpoint as dcp

from workloads.launch import ray_train
from workloads.launch.checkpoints import (SNAPSHOT_NAME, complete_step, latest_registered, registered_names, settle,
                                          unregistered)

OLD, KEPT, LATEST, BROKEN, NEWER = (f"checkpoint_2026-12-01_10-0{m}-00.000001" for m in range(5))
"""Ray's folder names, in the order the run saved them."""


def _ray_snapshot(*names: str) -> str:
    """The snapshot Ray Train's CheckpointManager writes, from its own model."""
    results = [_TrainingResultState(checkpoint_dir_name=name, metrics={"step": i}) for i, name in enumerate(names)]
    return _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(names))),
        latest_checkpoint_result=results[-1], pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(names), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[],
    ).model_dump_json()


def _checkpoint(folder: Path, *, step: int, complete: bool = True) -> None:
    """A real DCP checkpoint with the loop's progress.json; incomplete: a shard its metadata names is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(folder), no_dist=True)
    (folder / "progress.json").write_text(json.dumps({"step": step, "data_position": 16 * step}))
    if not complete:
        next(folder.glob("*.distcp")).unlink()


def _run_folder(root: Path, *, snapshot: str | None, newer: bool = False) -> Path:
    run = root / "bucket" / "runs" / "save-kill"
    for step, name in enumerate((OLD, KEPT, LATEST, BROKEN), start=1):
        _checkpoint(run / name, step=2 * step, complete=name != BROKEN)
    if newer:
        _checkpoint(run / NEWER, step=10)
    (run / ".write-check").mkdir()
    (run / ".validate_storage_marker").write_text("")
    if snapshot is not None:
        (run / SNAPSHOT_NAME).write_text(snapshot)
    return run


FS = pyarrow.fs.LocalFileSystem()


def test_rays_snapshot_names_the_registered_checkpoints():
    assert registered_names(_ray_snapshot(KEPT, LATEST)) == {KEPT, LATEST}
    assert latest_registered(_ray_snapshot(KEPT, LATEST)) == LATEST and latest_registered(None) is None
    assert registered_names(None) == set()
    assert registered_names("{}") is None and registered_names("not json") is None
    assert unregistered([KEPT, BROKEN, ".write-check", "checkpoint-local"], {KEPT}) == [BROKEN]


def test_a_checkpoint_is_complete_when_every_file_its_metadata_names_is_there(tmp_path):
    run = _run_folder(tmp_path, snapshot=None)
    assert complete_step(FS, str(run / LATEST)) == 6
    assert complete_step(FS, str(run / BROKEN)) is None
    (run / KEPT / "progress.json").unlink()
    assert complete_step(FS, str(run / KEPT)) is None
    (run / OLD / ".metadata").write_bytes(b"not a pickle of DCP's metadata")
    assert complete_step(FS, str(run / OLD)) is None


def test_incomplete_and_older_unregistered_folders_are_removed(tmp_path):
    run = _run_folder(tmp_path, snapshot=_ray_snapshot(KEPT, LATEST))
    said: list[str] = []
    settled = settle(FS, str(run), say=said.append)
    assert (settled.removed, settled.resume_from) == ([OLD, BROKEN], None)
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [KEPT, LATEST, ".write-check", ".validate_storage_marker", SNAPSHOT_NAME])
    assert said == [f"removed 2 unregistered checkpoint(s): written by some ranks only, or older than the one the "
                    f"run resumes from: {OLD}, {BROKEN}"]


def test_a_complete_checkpoint_a_lost_head_never_registered_is_resumed_from(tmp_path):
    run = _run_folder(tmp_path, snapshot=_ray_snapshot(KEPT, LATEST), newer=True)
    said: list[str] = []
    settled = settle(FS, str(run), say=said.append)
    assert (settled.resume_from, settled.resume_step, settled.registered_step) == (NEWER, 10, 6)
    assert settled.removed == [OLD, BROKEN] and (run / NEWER).is_dir()
    assert said[0] == (f"resuming from {NEWER} (step 10): complete in storage but never registered (the Ray head "
                       f"was lost before it registered it); Ray Train's latest is {LATEST} (step 6)")


def test_without_a_snapshot_the_newest_complete_checkpoint_is_resumed_from(tmp_path):
    run = _run_folder(tmp_path, snapshot=None)
    settled = settle(FS, str(run), say=lambda m: None)
    assert (settled.resume_from, settled.removed) == (LATEST, [OLD, KEPT, BROKEN])
    assert settle(FS, str(tmp_path / "no-such-run"), say=print).removed == []


def test_a_snapshot_it_cannot_read_removes_nothing(tmp_path):
    run = _run_folder(tmp_path, snapshot='{"ray_version": "9.9.9", "checkpoints": []}')
    said: list[str] = []
    assert settle(FS, str(run), say=said.append).removed == []
    assert all((run / name).is_dir() for name in (KEPT, LATEST, BROKEN))
    assert "no incomplete checkpoint removed" in said[0]


def test_a_ranks_checkpoints_in_flight_from_an_earlier_attempt_are_removed(tmp_path):
    (tmp_path / "checkpoint-0000004").mkdir()
    (tmp_path / "checkpoint-0000004" / "__1_0.distcp").write_bytes(b"half")
    (tmp_path / "nccl").mkdir()
    ray_train.remove_local_checkpoints(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["nccl"]
