"""Kernel-level profile of a window of training steps, driven by the same optimizer-step hook
that times the steps, so either strategy can be profiled without touching its code."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile


class StepWindowProfiler:
    """Records steps `first..last` (1-based optimizer steps) and writes the operators and kernels
    sorted by device time. Steps inside the window run slower; the benchmark's figures mark them."""

    def __init__(self, *, first: int, last: int, out: Optional[Path], title: str, device: torch.device) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"--profile-steps {first}:{last}: need 1 <= first <= last")
        self.first, self.last, self.out, self.title = first, last, out, title
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities)
        self._sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        self.table: Optional[str] = None

    def after_step(self, step: int) -> None:
        """Called after optimizer step `step`: the window opens after step first-1."""
        if step == self.first - 1:
            self._profile.__enter__()
        elif step == self.last:
            self._close()

    def start_if_first_step(self) -> None:
        """A window starting at step 1 opens before any step ran."""
        if self.first == 1:
            self._profile.__enter__()

    def _close(self) -> None:
        self._profile.__exit__(None, None, None)
        self.table = self._profile.key_averages().table(sort_by=self._sort, row_limit=30, max_name_column_width=70)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"profile-{self.title}.txt").write_text(
                f"steps {self.first}..{self.last} of {self.title}, sorted by {self._sort}\n{self.table}\n"
            )
