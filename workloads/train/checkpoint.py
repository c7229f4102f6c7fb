"""Save and load training state with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer into one folder (rank 0 adds the
metadata), so a checkpoint is written in parallel and can be loaded on another number of ranks.
The folder also holds the step and the data position, the two numbers that make a resumed run
continue exactly where the saved one stopped (the learning rate is a function of the step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int
    """Optimizer steps completed."""
    data_position: int
    """Samples consumed by all ranks together (see workloads/train/data.py)."""


def checkpoint_dir(scratch_dir: Path, *, step: int) -> Path:
    return scratch_dir / f"checkpoint-{step:07d}"


def save(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress) -> Path:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {
        "model": model_state,
        "optim": optim_state,
        "progress": {"step": progress.step, "data_position": progress.data_position},
    }
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def load(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
    """Load in place into the (already sharded) model and optimizer; return the saved progress."""
    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": 0, "data_position": 0}}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return Progress(
        step=int(state["progress"]["step"]), data_position=int(state["progress"]["data_position"])
    )
