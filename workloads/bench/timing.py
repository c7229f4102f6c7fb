"""Per-step timing that keeps the host out of the step: on CUDA each mark records an event on the
current stream and the host synchronizes once, when the durations are read."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Marks the end of training steps; durations are the intervals between consecutive marks.

    A mark may cover several steps (a loop that reports every k steps); its interval is then
    divided evenly among them.
    """

    def __init__(self, *, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[int, object]] = []

    def mark(self, step: int) -> None:
        """Record that every step up to and including `step` has been issued."""
        if self._marks and step <= self._marks[-1][0]:
            raise ValueError(f"steps must increase: {step} after {self._marks[-1][0]}")
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((step, event))
        else:
            self._marks.append((step, time.perf_counter()))

    def step_seconds(self) -> dict[int, float]:
        """Seconds per step, keyed by step, for every step after the first mark."""
        if self._cuda:
            torch.cuda.synchronize()
        result: dict[int, float] = {}
        for (prev_step, prev), (step, here) in zip(self._marks, self._marks[1:]):
            if self._cuda:
                elapsed = prev.elapsed_time(here) / 1000.0
            else:
                elapsed = here - prev
            for covered in range(prev_step + 1, step + 1):
                result[covered] = elapsed / (step - prev_step)
        return result
