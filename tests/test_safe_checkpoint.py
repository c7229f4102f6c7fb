"""`python -m workloads export` runs nothing a checkpoint holds: a `.metadata` whose pickle would run
a command is refused with one line and the command never runs; the files it points at must lie in
its folder; pickled (BYTE_IO) items are never loaded; a real checkpoint's metadata reads as before."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from workloads.client import export as export_cli
from workloads.model_io.safe_checkpoint import SafeFileSystemReader, UnsafeCheckpoint, read_checkpoint_metadata
from workloads.model_io.toy import write_toy_model


class _RunsACommand:
    """What a job could pickle into `.metadata`: on load, os.system runs its command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A DCP checkpoint folder as DCP writes it: a tensor, a pickled hyperparameter, and the model's
    Hugging Face metadata beside them (the toy model's)."""
    folder = tmp_path / "run" / "checkpoint-0000002"
    dcp.save({"w": torch.arange(4.0), "lr": 0.01}, checkpoint_id=str(folder), no_dist=True)
    model = write_toy_model(tmp_path / "toy")
    (folder / "model").mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (model / name).is_file():
            shutil.copy2(model / name, folder / "model" / name)
    return folder


def test_a_real_checkpoints_metadata_reads(checkpoint):
    metadata = read_checkpoint_metadata(checkpoint)
    assert set(metadata.state_dict_metadata) == {"w", "lr"}
    state = {"w": torch.empty(4)}
    dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))


def test_export_refuses_a_metadata_pickle_that_runs_a_command_and_the_command_does_not_run(
        checkpoint, tmp_path, capsys):
    marker = tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_RunsACommand(f"touch {marker}")))
    assert export_cli.main("export", [str(checkpoint.parent)]) == export_cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("export: error: ") and "refused: its .metadata would load posix.system" in err
    assert not marker.exists()
    assert not (checkpoint.parent / "model").exists()  # nothing written either


def test_metadata_that_points_outside_its_folder_is_refused(checkpoint):
    metadata = read_checkpoint_metadata(checkpoint)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    with (checkpoint / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    with pytest.raises(UnsafeCheckpoint, match="outside the checkpoint"):
        read_checkpoint_metadata(checkpoint)


def test_pickled_items_are_never_loaded(checkpoint):
    # DCP's default planner would torch.load(weights_only=False) this item's bytes. (DCP hands the
    # reader's error back wrapped in its CheckpointException.)
    with pytest.raises(CheckpointException, match="UnsafeCheckpoint: .*refused to read 'lr', a pickled object"):
        dcp.load({"lr": 0.0}, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
