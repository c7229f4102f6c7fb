"""Half-written checkpoints in storage: only the folders Ray Train never registered are removed, as Ray
2.58 writes its snapshot; an unreadable snapshot removes nothing."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
    _CheckpointManagerState,
    _TrainingResultState,
)

from workloads.launch import ray_train
from workloads.launch.checkpoints import SNAPSHOT_NAME, registered_names, remove_unregistered, unregistered

KEPT, LATEST, BROKEN = ("checkpoint_2026-12-01_10-00-00.000001", "checkpoint_2026-12-01_10-05-00.000001",
                        "checkpoint_2026-12-01_10-10-00.000001")


def _ray_snapshot(*names: str) -> str:
    """The snapshot Ray Train's CheckpointManager writes, from its own model."""
    results = [_TrainingResultState(checkpoint_dir_name=name, metrics={"step": i}) for i, name in enumerate(names)]
    return _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(names))),
        latest_checkpoint_result=results[-1], pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(names), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[],
    ).model_dump_json()


def _run_folder(root: Path, *, snapshot: str | None) -> Path:
    run = root / "bucket" / "runs" / "save-kill"
    for name in (KEPT, LATEST, BROKEN):
        (run / name).mkdir(parents=True)
        (run / name / "__0_0.distcp").write_bytes(b"rank 0's shard")
        (run / name / ".metadata").write_bytes(b"written by rank 0")
    (run / ".write-check").mkdir()
    (run / ".validate_storage_marker").write_text("")
    if snapshot is not None:
        (run / SNAPSHOT_NAME).write_text(snapshot)
    return run


def test_rays_snapshot_names_the_registered_checkpoints():
    assert registered_names(_ray_snapshot(KEPT, LATEST)) == {KEPT, LATEST}
    assert registered_names(None) == set()
    assert registered_names("{}") is None and registered_names("not json") is None
    assert unregistered([KEPT, BROKEN, ".write-check", "checkpoint-local"], {KEPT}) == [BROKEN]


def test_only_the_unregistered_folder_is_removed(tmp_path):
    run = _run_folder(tmp_path, snapshot=_ray_snapshot(KEPT, LATEST))
    said: list[str] = []
    removed = remove_unregistered(pyarrow.fs.LocalFileSystem(), str(run), say=said.append)
    assert removed == [BROKEN]
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [KEPT, LATEST, ".write-check", ".validate_storage_marker", SNAPSHOT_NAME])
    assert said == [f"removed 1 incomplete checkpoint(s) that a failed attempt left in storage (written by some "
                    f"ranks, never registered): {BROKEN}"]


def test_without_a_snapshot_no_checkpoint_was_ever_registered(tmp_path):
    run = _run_folder(tmp_path, snapshot=None)
    assert remove_unregistered(pyarrow.fs.LocalFileSystem(), str(run), say=lambda m: None) == [KEPT, LATEST, BROKEN]
    assert remove_unregistered(pyarrow.fs.LocalFileSystem(), str(tmp_path / "no-such-run"), say=print) == []


def test_a_snapshot_it_cannot_read_removes_nothing(tmp_path):
    run = _run_folder(tmp_path, snapshot='{"ray_version": "9.9.9", "checkpoints": []}')
    said: list[str] = []
    assert remove_unregistered(pyarrow.fs.LocalFileSystem(), str(run), say=said.append) == []
    assert all((run / name).is_dir() for name in (KEPT, LATEST, BROKEN))
    assert "no incomplete checkpoint removed" in said[0]


def test_a_ranks_checkpoints_in_flight_from_an_earlier_attempt_are_removed(tmp_path):
    (tmp_path / "checkpoint-0000004").mkdir()
    (tmp_path / "checkpoint-0000004" / "__1_0.distcp").write_bytes(b"half")
    (tmp_path / "nccl").mkdir()
    ray_train.remove_local_checkpoints(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["nccl"]
