"""What a training strategy under benchmark is: a function that trains `cfg.steps` steps on the
loop's data and returns the losses it saw. The harness times it from outside (see timing.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workloads.train.config import TrainConfig
from workloads.context import TrainContext


@dataclass(frozen=True, kw_only=True)
class StrategyResult:
    losses: dict[int, float]
    """Loss of each step it read back, averaged over ranks, keyed by 1-based step."""
    self_reported: list[dict] = field(default_factory=list)
    """Metrics the strategy published itself (the loop's reports and summary), for cross-checks."""


class Strategy(Protocol):
    def __call__(self, cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
        """Build, shard and train for cfg.steps optimizer steps, one `optimizer.step()` per step."""
