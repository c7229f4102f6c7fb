"""What is on the GPU at a run's peak: a window of optimizer steps recorded with the CUDA caching
allocator's history (torch.cuda.memory._record_memory_history), replayed to the moment the memory
allocated was highest, and the blocks alive then grouped by where they were allocated.

The replay is pure (tested on the CPU with traces written by hand): allocated bytes start at what
was allocated when the window opened, each `alloc` adds its size, each `free_completed` takes it
away (a block freed while another stream still used it counts until that use ends, as the
allocator's own statistics do). Two checks keep it honest: the replayed end must equal what the
allocator says is allocated when the window closes (a trace that overflowed its entries loses its
start and fails this), and the replayed peak must equal the allocator's peak for the window.

The Python stacks say where each block came from; blocks the autograd engine allocates in backward
have no Python frame unless Python code ran (a checkpointed layer's recomputation does), so those
are grouped by their stream and size alone.
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

GIB = 2**30
PROJECT_DIR = "/workloads/"
"""Frames in files under this folder are the project's own."""
MAX_ENTRIES = 2_000_000
"""Allocator events the history keeps (a circular buffer): far more than a few steps make."""


@dataclass(frozen=True, kw_only=True)
class Block:
    size: int
    where: str
    """The innermost project frame and the innermost frame, or what stands for them without frames."""
    time_us: int


@dataclass(frozen=True, kw_only=True)
class Peak:
    peak_bytes: int
    at_event: int
    """Index of the event that reached the peak (-1: the peak is the window's start)."""
    at_time_us: Optional[int]
    start_bytes: int
    end_bytes: int
    live: tuple[Block, ...]
    """Blocks allocated inside the window and alive at the peak."""
    held_from_before: int
    """Bytes allocated before the window that were still allocated at the peak."""


def _short(frame: dict) -> str:
    filename = frame.get("filename", "?")
    if PROJECT_DIR in filename:
        filename = "workloads/" + filename.rsplit(PROJECT_DIR, 1)[1]
    elif "/site-packages/" in filename:
        filename = filename.rsplit("/site-packages/", 1)[1]
    return f"{filename}:{frame.get('line', '?')} {frame.get('name', '?')}"


def where(frames: Sequence[dict], *, stream: int = 0) -> str:
    """Where a block was allocated, from its Python frames (innermost first, as the allocator records
    them): the innermost frame of the project's code, then the innermost frame of all."""
    if not frames:
        return f"(no Python frame: autograd engine or C++, stream {stream})"
    own = next((f for f in frames if PROJECT_DIR in f.get("filename", "")), None)
    innermost = _short(frames[0])
    if own is None or own is frames[0]:
        return innermost
    return f"{_short(own)} > {innermost}"


def replay(events: Iterable[dict], *, start_bytes: int) -> Peak:
    """The peak of allocated bytes over `events` (one device's trace) and what was alive then.

    `start_bytes` is what was allocated when recording began. A free of an address the window did not
    allocate releases memory from before the window (it counts against `held_from_before`)."""
    live: dict[int, tuple[int, dict]] = {}
    current = peak = start_bytes
    before = start_bytes
    at_event, at_time, at_live, at_before = -1, None, {}, before
    for index, event in enumerate(events):
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (index, event)
            current += size
            if current > peak:
                peak, at_event, at_time = current, index, event.get("time_us")
                at_live, at_before = dict(live), before
        elif action == "free_completed":
            current -= size
            if live.pop(addr, None) is None:
                before -= size
    blocks = tuple(Block(size=int(e.get("size", 0)), where=where(e.get("frames") or [], stream=e.get("stream", 0)),
                         time_us=e.get("time_us", 0)) for _, e in sorted(at_live.values(), key=lambda v: v[0]))
    return Peak(peak_bytes=peak, at_event=at_event, at_time_us=at_time, start_bytes=start_bytes, end_bytes=current,
                live=blocks, held_from_before=at_before)


@dataclass(frozen=True, kw_only=True)
class Group:
    where: str
    bytes: int
    blocks: int


def grouped(blocks: Iterable[Block]) -> list[Group]:
    """The live blocks by where they were allocated, largest total first."""
    sums: dict[str, list[int]] = {}
    for block in blocks:
        entry = sums.setdefault(block.where, [0, 0])
        entry[0] += block.size
        entry[1] += 1
    return sorted((Group(where=w, bytes=b, blocks=n) for w, (b, n) in sums.items()), key=lambda g: (-g.bytes, g.where))


@dataclass(frozen=True, kw_only=True)
class WindowReport:
    title: str
    first_step: int
    last_step: int
    peak: Peak
    allocator_peak_bytes: int
    allocator_end_bytes: int
    start_time_us: int = 0
    """Host time (Unix, µs, the trace's clock) the window opened at."""
    step_end_times_us: tuple[int, ...] = ()
    """Host time each optimizer step of the window was queued at (steps first..last)."""
    groups: list[Group] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        """The replay ends where the allocator ended and peaks where it peaked."""
        return self.peak.end_bytes == self.allocator_end_bytes and self.peak.peak_bytes == self.allocator_peak_bytes

    def peak_step(self) -> Optional[int]:
        """The optimizer step whose work reached the peak (queued at or after it); None when the
        peak's time falls outside the window's (another clock, or the window's start)."""
        if self.peak.at_time_us is None or self.peak.at_time_us < self.start_time_us:
            return None
        for step, end in enumerate(self.step_end_times_us, start=self.first_step):
            if self.peak.at_time_us <= end:
                return step
        return None

    def table(self, *, rows: int = 25) -> str:
        peak = self.peak
        step = self.peak_step()
        lines = [
            f"{self.title}: memory allocated over optimizer steps {self.first_step}..{self.last_step}",
            f"peak {peak.peak_bytes / GIB:.3f} GiB (the allocator's: {self.allocator_peak_bytes / GIB:.3f}), "
            f"at event {peak.at_event}" + (f", in step {step}" if step is not None else ""),
            f"replay {'matches' if self.consistent else 'DOES NOT match'} the allocator "
            f"(end {peak.end_bytes / GIB:.3f} GiB, allocator {self.allocator_end_bytes / GIB:.3f})",
            f"{peak.held_from_before / GIB:8.3f} GiB  allocated before the window and still held at the peak "
            f"(of {peak.start_bytes / GIB:.3f} at its start: weights, optimizer state, ...)",
            f"{sum(b.size for b in peak.live) / GIB:8.3f} GiB  allocated in the window and alive at the peak, "
            "by where:",
        ]
        for group in self.groups[:rows]:
            lines.append(f"{group.bytes / GIB:8.3f} GiB  {group.blocks:5d} blocks  {group.where}")
        if len(self.groups) > rows:
            rest = self.groups[rows:]
            lines.append(f"{sum(g.bytes for g in rest) / GIB:8.3f} GiB  {sum(g.blocks for g in rest):5d} blocks  "
                         f"({len(rest)} more places)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"title": self.title, "steps": [self.first_step, self.last_step], "peak_step": self.peak_step(),
                "consistent": self.consistent, "allocator_peak_gib": round(self.allocator_peak_bytes / GIB, 3),
                "peak_gib": round(self.peak.peak_bytes / GIB, 3),
                "held_from_before_gib": round(self.peak.held_from_before / GIB, 3),
                "groups": [{**asdict(g), "gib": round(g.bytes / GIB, 3)} for g in self.groups]}


def report(snapshot: dict, *, title: str, first_step: int, last_step: int, start_bytes: int, allocator_peak_bytes: int,
           allocator_end_bytes: int, start_time_us: int = 0, step_end_times_us: Sequence[int] = (),
           device_index: int = 0) -> WindowReport:
    """The window's report from an allocator snapshot (torch.cuda.memory._snapshot())."""
    peak = replay(snapshot["device_traces"][device_index], start_bytes=start_bytes)
    return WindowReport(title=title, first_step=first_step, last_step=last_step, peak=peak,
                        allocator_peak_bytes=allocator_peak_bytes, allocator_end_bytes=allocator_end_bytes,
                        start_time_us=start_time_us, step_end_times_us=tuple(step_end_times_us),
                        groups=grouped(peak.live))


class MemoryWindow:
    """Records the allocator's history over optimizer steps `first..last` of a CUDA run and writes
    memory-<title>.txt and .json to `out` (and the raw snapshot, memory-<title>.pickle, for
    torch's viewer at pytorch.org/memory_viz, when `keep_snapshot`). Driven, like the profiler, by
    the optimizer-step hook."""

    def __init__(self, *, first: int, last: int, out: Optional[Path], title: str, device,
                 keep_snapshot: bool = False) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"--memory-steps {first}:{last}: need 1 <= first <= last")
        self.first, self.last, self.out, self.title, self.device = first, last, out, title, device
        self.keep_snapshot = keep_snapshot
        self._start_bytes = self._start_time_us = 0
        self._step_ends: list[int] = []
        self.report: Optional[WindowReport] = None
        self.peak_before_bytes = 0
        """The allocator's peak before the window opened (opening resets it)."""

    def start_if_first_step(self) -> None:
        if self.first == 1:
            self._open()

    def after_step(self, step: int) -> None:
        if step == self.first - 1:
            self._open()
        if self.first <= step <= self.last:
            self._step_ends.append(time.time_ns() // 1000)
        if step == self.last:
            self._close()

    def _open(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        self.peak_before_bytes = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._start_bytes = torch.cuda.memory_allocated(self.device)
        self._start_time_us = time.time_ns() // 1000
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python", device=self.device)

    def _close(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        snapshot = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        self.report = report(snapshot, title=self.title, first_step=self.first, last_step=self.last,
                             start_bytes=self._start_bytes,
                             allocator_peak_bytes=torch.cuda.max_memory_allocated(self.device),
                             allocator_end_bytes=torch.cuda.memory_allocated(self.device),
                             start_time_us=self._start_time_us, step_end_times_us=self._step_ends,
                             device_index=torch.device(self.device).index or 0)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / f"memory-{self.title}.txt").write_text(self.report.table() + "\n")
            (self.out / f"memory-{self.title}.json").write_text(json.dumps(self.report.as_dict(), indent=1) + "\n")
            if self.keep_snapshot:
                with open(self.out / f"memory-{self.title}.pickle", "wb") as f:
                    pickle.dump(snapshot, f)
