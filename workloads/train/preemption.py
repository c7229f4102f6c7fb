"""A checkpoint on notice: the loop asks, at step boundaries, whether a node hosting its ranks is
being drained (a Spot interruption: EKS drains the node, the pod's `ray start --block` gets
SIGTERM and marks the Ray node as draining), and saves a checkpoint at once when one is.

The asking is a barrier across all ranks (Ray Train's `get_preemption_info` broadcasts rank 0's
view), so every rank asks at the same steps: every `every` steps. The cost was measured on the
local cluster (docs/RELIABILITY.md): a few milliseconds per ask, against a Spot drain of 95 s
(infra/spot.py), so asking every few steps costs nothing that matters and waits at most those
steps. No Ray here: the adapter passes the asking function in (TrainContext.preemption_notice).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

PREEMPTION_PREFIX = "[preemption] "
"""Rank 0's line when the loop saved a checkpoint on a drain notice, followed by JSON."""


@dataclass(frozen=True, kw_only=True)
class Notice:
    """A drain of some of the run's nodes, as every rank sees it."""

    deadline_unix_s: Optional[float]
    """When the drained node is taken away (UNIX seconds), None when unknown."""
    ranks: tuple[int, ...]
    """The ranks on the drained nodes."""
    nodes: tuple[str, ...]
    """The drained nodes' IDs."""

    def seconds_left(self, now_unix_s: float) -> Optional[float]:
        return None if self.deadline_unix_s is None else self.deadline_unix_s - now_unix_s


NoticeFn = Callable[[], Optional[Notice]]
"""Asks (a collective: every rank calls it at the same steps) for the current drain, if any."""


@dataclass
class PreemptionWatch:
    """Asks every `every` steps; a notice is acted on once (one checkpoint per drain)."""

    ask: Optional[NoticeFn]
    """None: nothing to ask (torchrun, or a launcher without preemption support)."""
    every: int
    """Steps between asks; 0 never asks."""
    clock: Callable[[], float] = time.perf_counter
    asks: int = 0
    asking_s: float = 0.0
    """Time spent asking, this rank's: the cost of the barrier."""
    acted_on: Optional[tuple] = field(default=None)

    def check(self, step: int) -> Optional[Notice]:
        """The notice to save a checkpoint for now, or None (no drain, not a step to ask at, or a
        drain already saved for)."""
        if self.ask is None or self.every <= 0 or step % self.every:
            return None
        started = self.clock()
        notice = self.ask()
        self.asking_s += self.clock() - started
        self.asks += 1
        if notice is None:
            return None
        key = (notice.nodes, notice.deadline_unix_s)
        if key == self.acted_on:
            return None
        self.acted_on = key
        return notice

    def summary(self) -> Optional[dict]:
        """How often this rank asked and what one ask cost it, for the run's summary."""
        if not self.asks:
            return None
        return {"every": self.every, "asks": self.asks, "mean_ms": round(1000 * self.asking_s / self.asks, 3)}


def notice_record(notice: Notice, *, step: int, seen_unix_s: float, saved_unix_s: float) -> dict:
    """What the log says of a checkpoint on notice: when the loop saw the drain, how long the save
    took, how much time the node had left."""
    left = notice.seconds_left(saved_unix_s)
    return {
        "event": "checkpoint-on-notice",
        "step": step,
        "ranks": list(notice.ranks),
        "nodes": list(notice.nodes),
        "seen_unix_s": round(seen_unix_s, 3),
        "save_s": round(saved_unix_s - seen_unix_s, 3),
        "seconds_left_at_save": None if left is None else round(left, 1),
    }
