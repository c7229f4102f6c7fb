"""The small interface between the training loop and whatever runs it (Ray Train or torchrun).

The loop (workloads/train/loop.py) never imports Ray: an adapter builds a TrainContext and calls
`workloads.train.loop.train(config, ctx)`. The Ray adapter (workloads/launch/ray_train.py) maps `report` to
`ray.train.report` and `latest_checkpoint` to `ray.train.get_checkpoint()`; the torchrun adapter
(workloads/launch/torchrun.py) writes metrics as JSON lines and checkpoints to a local folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol

if TYPE_CHECKING:
    from workloads.train.preemption import NoticeFn


TRAIN_PREFIX = "[train] "
"""Rank 0's line per logged step, followed by compact JSON of the step's metrics."""
SUMMARY_PREFIX = "[train-summary] "
"""Rank 0's line at the end of a run, followed by the run's summary as JSON."""
GATE_PREFIX = "[transport-gate] "
"""Rank 0's line with the in-band transport gate's result, before the first step."""
DATA_PREFIX = "[data] "
"""Rank 0's line describing the training data (records, packed rows, held-out share)."""
LOAD_PREFIX = "[model-load] "
"""Rank 0's line with every rank's pretrained-weights load: seconds, bytes read, peak memory."""
TRACKING_PREFIX = "[tracking] "
"""Rank 0's line once its experiment-tracker run is open (JSON: run id, experiment, URI), and its
warnings about the tracker (plain text after the prefix)."""
RESTORE_PREFIX = "[restore] "
"""The line of the rank that downloaded a checkpoint for its node: what a resume cost that node."""
METHOD_PREFIX = "[method] "
"""Rank 0's line before the first step: the fine-tune method (full, or LoRA and its settings) and the
parameters it trains of the model's (`trained_params`, `params`), as peft counts them."""


PREFLIGHT_FAILED_KEY = "preflight_failed"
"""The metric every rank reports, instead of training, when a check before step 1 failed."""


class PreflightError(RuntimeError):
    """A check before the first training step failed on every rank together (the transport gate,
    the storage write check). It is deterministic: the same cluster fails it again, so a launcher
    stops the run instead of retrying it."""


class ReportFn(Protocol):
    def __call__(self, metrics: dict, checkpoint_dir: Optional[Path] = None) -> None:
        """Publish one step's metrics; with checkpoint_dir, also a checkpoint every rank wrote to.

        Called by every rank (Ray Train requires it). The folder is the one the loop saved into
        with torch.distributed.checkpoint; the adapter persists it (Ray: to the run's storage).
        """


@dataclass(frozen=True, kw_only=True)
class TrainContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    """Index of this rank's node (ranks on one node share NVLink/SHM; across nodes, the network)."""
    report: ReportFn
    latest_checkpoint: Callable[[], Optional[Path]]
    """The folder of the newest persisted checkpoint to resume from, or None to start fresh."""
    scratch_dir: Path
    """A per-run local folder for checkpoints in flight and per-rank NCCL logs."""
    preemption_notice: Optional["NoticeFn"] = None
    """Asks whether a node hosting the run's ranks is being drained (a collective: every rank
    asks at the same steps); None where the launcher cannot tell (torchrun)."""
    planned_world_size: int = 0
    """The world size the config's grad_accum_steps is meant for (an elastic run's largest); the
    loop rescales accumulation to keep the samples per optimizer step. 0: this world size."""
