"""Kernel-level profile of a window of training steps, driven by the same optimizer-step hook
that times the steps, so either strategy can be profiled without touching its code. Besides the
table of operators it measures the communication the window exposed: the time NCCL kernels ran
while no other kernel did."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from workloads.bench.profile_categories import Breakdown, breakdown, launches

Interval = tuple[float, float]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in merged(intervals))


def exposed(comm: Sequence[Interval], other: Sequence[Interval]) -> float:
    """How long `comm` intervals ran with none of `other` running: covered(comm) minus their overlap."""
    busy = merged(other)
    overlap, j = 0.0, 0
    for start, end in merged(comm):
        while j < len(busy) and busy[j][1] <= start:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < end:
            overlap += min(end, busy[k][1]) - max(start, busy[k][0])
            k += 1
    return covered(comm) - overlap


@dataclass(frozen=True, kw_only=True)
class Communication:
    """Device time of NCCL kernels per profiled step: in all, and not overlapped by other kernels."""

    comm_s: float
    exposed_s: float
    steps: int


def communication(events: Iterable, *, steps: int) -> Communication:
    """From a profile's events: device kernels whose name starts with "nccl" are communication;
    every other device activity (kernels, copies) is the work it can hide behind."""
    comm: list[Interval] = []
    other: list[Interval] = []
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        (comm if event.name.lower().startswith("nccl") else other).append(span)
    return Communication(comm_s=covered(comm) / steps, exposed_s=exposed(comm, other) / steps, steps=steps)


class StepWindowProfiler:
    """Records steps `first..last` (1-based optimizer steps) and writes the operators and kernels
    sorted by device time. Steps inside the window run slower; the benchmark's figures mark them."""

    def __init__(
        self, *, first: int, last: int, out: Optional[Path], title: str, device: torch.device, table: bool = True
    ) -> None:
        """With `table` False only device activity is recorded (what the communication figures
        need), which keeps long windows cheap to process."""
        if not 1 <= first <= last:
            raise ValueError(f"--profile-steps {first}:{last}: need 1 <= first <= last")
        self.first, self.last, self.out, self.title = first, last, out, title
        self._with_table = table
        cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
        activities = [ProfilerActivity.CPU, *cuda] if table or not cuda else cuda
        # Shapes tell LoRA's rank-sized matmuls from the base model's (profile_categories.py).
        self._profile = profile(activities=activities, record_shapes=table)
        self._sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        self._cuda = device.type == "cuda"
        self.table: Optional[str] = None
        self.communication: Optional[Communication] = None
        """Set when the window closes, on CUDA."""
        self.categories: Optional[Breakdown] = None
        """Device time by category, set when the window closes (with `table`)."""

    def after_step(self, step: int) -> None:
        """Called after optimizer step `step` was queued: the window opens after step first-1."""
        if step == self.first - 1:
            self._open()
        elif step == self.last:
            self._close()

    def start_if_first_step(self) -> None:
        """A window starting at step 1 opens before any step ran."""
        if self.first == 1:
            self._open()

    def _open(self) -> None:
        # The device finishes the steps before the window first, and those in it before it closes,
        # so the window holds exactly its own steps' kernels.
        if self._cuda:
            torch.cuda.synchronize()
        self._profile.__enter__()

    def _close(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        if self._cuda:
            self.communication = communication(self._profile.events(), steps=self.last - self.first + 1)
        if not self._with_table:
            return
        self.table = self._profile.key_averages().table(sort_by=self._sort, row_limit=30, max_name_column_width=70)
        self.categories = breakdown(launches(self._profile.events()), steps=self.last - self.first + 1)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"profile-{self.title}.txt").write_text(
                f"steps {self.first}..{self.last} of {self.title}, sorted by {self._sort}\n{self.table}\n"
            )
            (self.out / f"profile-{self.title}-categories.txt").write_text(
                f"steps {self.first}..{self.last} of {self.title}, device time by category\n"
                f"{self.categories.table()}\n")
