"""What a soak is asked to do (workloads/rehearse/soak.py): its settings, the kinds of fault it
brings, and the plan of its faults, drawn from its seed. The run, its checks and its record read them."""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_KINDS = ("worker-kill", "node-drain", "head-restart", "tracker-down", "storage-down", "save-interrupted")
OUTAGES = ("tracker-down", "storage-down")
"""Faults that restart nothing: the run must train through them."""
BUCKET, PREFIX = "soak", "runs"
"""The run's checkpoints are under s3://BUCKET/PREFIX/<run name>/ (the CLI's bucket)."""
WAIT_NODES_S = 60.0
"""The run's --wait-nodes-s: its first wait line comes after a sixth of it (one start of the group)."""


@dataclass(frozen=True, kw_only=True)
class SoakSettings:
    steps: int
    """Training steps of the run."""
    faults: int
    """Faults it meets, spread over its steps; the first six are one of each kind."""
    seed: int
    """Chooses the faults' order, steps, targets and moments."""
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    tracker_down_s: float = 60.0
    """How long the tracker is down."""
    storage_down_s: float = 60.0
    """How long the storage is down: beyond about 15 s (two tries of each rank's part, each with
    pyarrow's own retries) the checkpoint it meets is skipped rather than stored late."""
    warmup_steps: int = 20
    """Steps trained before the first fault."""
    run_name: str = "soak"
    sample_every_s: float = 5.0
    """How often memory and the bucket are read."""
    progress_every_s: float = 30.0
    """How often a progress line is printed (the step, the memory per role, the bucket)."""
    drain_timeout_s: float = 20.0
    """The worker nodes' drain on SIGTERM (CLUSTER_ENV)."""
    memory_warmup_s: float = 60.0
    """A process's first seconds (imports, the model, the first steps, the allocator's pools) are
    left out of its memory growth; a train worker's count from its attempt's first step, since
    starting a worker group can take a minute when the cluster was just restarted."""
    memory_judged_after_s: float = 90.0
    """A process's memory is judged when it lived this long after its warm-up (shorter lives show no
    trend)."""
    memory_growth_limit_mib: float = 64.0
    """Growth allowed to a process's resident memory after its warm-up, over its life."""

    def __post_init__(self) -> None:
        if self.steps < self.warmup_steps + 2 * max(self.faults, 1):
            raise ValueError(f"steps={self.steps} leaves too few steps for {self.faults} faults after "
                             f"{self.warmup_steps} warm-up steps: give more steps or fewer faults")
        if self.faults < 1:
            raise ValueError(f"faults must be at least 1, got {self.faults}")

    def overrides(self) -> list[str]:
        """The run's config over the demo-cpu preset (the reference's too)."""
        return [f"steps={self.steps}", f"checkpoint_every={self.checkpoint_every}", "log_every=1",
                "preemption_check_every=1", "eval_every=0", "transport.expect=any"]


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    kind: str
    step: int
    """It comes once the run has trained this step (or at once, if it is past it by then)."""
    target: int
    """The worker (by its place in the State API's list), node (1 or 2) or rank it hits."""
    delay_s: float
    """How long after the step it comes, for the faults that land at any moment."""
    in_window: bool = False
    """A head restart in the registration window of a checkpoint: every rank's part uploaded, the
    head not yet told (a rank waits at the pause point `checkpoint-uploaded`), rather than at any
    moment."""


def plan_faults(settings: SoakSettings) -> list[PlannedFault]:
    """Each kind once, in a random order, then random kinds; each in its own stretch of the steps
    after warm-up (the last tenth left fault-free), at a random step of it."""
    rng = random.Random(settings.seed)
    kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))[:settings.faults]
    kinds += [rng.choice(FAULT_KINDS) for _ in range(settings.faults - len(kinds))]
    first, last = settings.warmup_steps, int(settings.steps * 0.9)
    width = (last - first) / settings.faults
    planned = []
    for index, kind in enumerate(kinds):
        start = int(first + index * width)
        step = rng.randint(start, max(start, int(first + (index + 1) * width) - 1))
        target = rng.randint(1, 2) if kind == "node-drain" else rng.randint(0, 1)
        planned.append(PlannedFault(kind=kind, step=step, target=target, delay_s=round(rng.uniform(0.0, 2.0), 2),
                                    in_window=kind == "head-restart" and rng.random() < 0.5))
    return planned
