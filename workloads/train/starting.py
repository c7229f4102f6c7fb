"""The model a run starts from when `model.name_or_path` names another run (workloads/model_io/run_model.py):
the config rewritten to name that run's model (and, stacked, its base and adapter), so that the run
records exactly where it started. The client applies it before its checks, the loop again on the
nodes (for a run folder only they can see)."""

from __future__ import annotations

import dataclasses

from workloads.model_io.run_model import starting_model
from workloads.train.config import TrainConfig


def with_starting_model(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """(`cfg` starting from the model its name_or_path names, a line saying so or "")."""
    if cfg.model.is_named_architecture:
        return cfg, ""
    stack = cfg.model.adapter == "stack"
    if stack and cfg.method != "lora":
        raise ValueError("model.adapter is 'stack' but method is not 'lora': a LoRA run's adapter stacks beneath new "
                         "adapters only; set method=lora, or model.adapter=merge to start from the merged weights")
    start = starting_model(cfg.model.name_or_path, stack=stack)
    if not start.run and not start.stacked_adapter:
        return cfg, ""
    model = dataclasses.replace(cfg.model, name_or_path=start.name_or_path,
                                revision=start.revision if start.stacked_adapter else "")
    lora = dataclasses.replace(cfg.lora, stacked_adapter=start.stacked_adapter) if start.stacked_adapter else cfg.lora
    how = (f"its base {start.name_or_path} with its adapter {start.stacked_adapter} beneath the new ones"
           if start.stacked_adapter else f"its model {start.name_or_path}")
    return dataclasses.replace(cfg, model=model, lora=lora), f"starting from run {start.run}: {how}"
