"""Save and load training state with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer into one folder (rank 0 adds the
metadata), so a checkpoint is written in parallel and can be loaded on another number of ranks.
The folder also holds the step and the data position, the two numbers that make a resumed run
continue exactly where the saved one stopped (the learning rate is a function of the step). Beside
the DCP files, rank 0 writes `progress.json`: the same numbers with the world size that saved them,
the run's experiment-tracker id, the world size its samples per step are planned for and the hub
revisions it read, so that a resumed run continues the same tracker run, knows whether it was
resized, and trains on the same samples per step from the same data (workloads/train/resumed.py).
A checkpoint without that file (from before it existed) loads as one that recorded none of these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from workloads.model_io.load import file_name
from workloads.model_io.safe_checkpoint import read_checkpoint_metadata


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int
    """Optimizer steps completed."""
    data_position: int
    """Samples consumed by all ranks together (see workloads/train/data.py)."""
    world_size: int = 0
    """Ranks that saved the checkpoint; 0: not recorded."""
    tracking_run_id: str = ""
    """The experiment tracker's run id (workloads/train/tracking.py); empty: none known."""
    method: str = "full"
    """The fine-tuning method that saved it ("full", "lora"; workloads/train/method.py): what the
    checkpoint holds. A checkpoint from before it was recorded is a full fine-tune's."""
    planned_world_size: int = 0
    """The world size the run's grad_accum_steps is meant for (workloads/train/elastic.py); 0: not
    recorded."""
    hub_revisions: dict[str, str] = field(default_factory=dict)
    """The commit of each hub repository the run read ("model:ORG/NAME", "dataset:ORG/NAME")."""
    eval_loss: Optional[float] = None
    """The eval loss of the step saved, when it was evaluated (`checkpoint.keep_best` scores every
    checkpoint by it: `export --checkpoint best`)."""


PROGRESS_FILE = "progress.json"


def checkpoint_dir(scratch_dir: Path, *, step: int) -> Path:
    return scratch_dir / f"checkpoint-{step:07d}"


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, *, frozen: bool):
    """(model state, optimizer state, options) as saved and loaded: with `frozen` False, the trained
    parameters only (LoRA's adapters; the base comes from its source on every start)."""
    if frozen:
        return *get_state_dict(model, optimizer), None
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # ignore_frozen_params drops a frozen tied weight under one of its two names only (torch 2.13
    # keeps `lm_head.weight`): keep the trained names, as the state dict writes them.
    trained = {file_name(n) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trained}, optim_state, options


def save(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress,
         frozen: bool = True) -> Path:
    """`frozen`: whether the frozen parameters are saved too (a method that freezes its base saves
    only what trains)."""
    model_state, optim_state, _ = _state_dicts(model, optimizer, frozen=frozen)
    state = {
        "model": model_state,
        "optim": optim_state,
        "progress": {"step": progress.step, "data_position": progress.data_position},
    }
    # progress.json before the DCP files, so that their .metadata, which marks a complete checkpoint
    # to torch.distributed.checkpoint and to the orphan cleanup, stays the last file written.
    if not dist.is_initialized() or dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PROGRESS_FILE).write_text(json.dumps(asdict(progress)) + "\n")
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def read_progress(folder: Path) -> dict:
    """`progress.json` of a checkpoint folder as saved, or {} when it has none."""
    try:
        saved = json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def load(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, method: str = "full",
         frozen: bool = True) -> Progress:
    """Load in place into the (already sharded) model and optimizer; return the saved progress.
    ValueError when the checkpoint was saved by another fine-tuning method than `method`."""
    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)")
    saved = read_progress(folder)
    saved_method = str(saved.get("method") or "full")
    if saved_method != method:
        raise ValueError(
            f"{folder} was saved by a {saved_method!r} fine-tune and this run is {method!r}: it holds other "
            f"weights than this run trains. Resume with method={saved_method}, or start a new run (another "
            "--run-name)")
    # DCP's reader opens each file the metadata names as it is named: checked first to lie inside.
    read_checkpoint_metadata(folder)
    model_state, optim_state, options = _state_dicts(model, optimizer, frozen=frozen)
    state = {"model": model_state, "optim": optim_state, "progress": {"step": 0, "data_position": 0}}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    return Progress(
        step=int(state["progress"]["step"]), data_position=int(state["progress"]["data_position"]),
        world_size=int(saved.get("world_size") or 0), tracking_run_id=str(saved.get("tracking_run_id") or ""),
        method=saved_method,
        planned_world_size=int(saved.get("planned_world_size") or 0),
        hub_revisions=dict(saved.get("hub_revisions") or {}),
    )
