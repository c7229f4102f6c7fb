"""The memory window's replay (workloads/bench/memory_window.py) on allocator traces written by
hand in the allocator's own format: the peak, what was alive at it and where it came from, and the
checks that tell a replay that lost its start from one that did not."""

from __future__ import annotations

import json

import pytest

from workloads.bench.memory_window import GIB, MemoryWindow, grouped, replay, report, where

LOOP = {"filename": "/opt/app/workloads/train/loop.py", "line": 300, "name": "train"}
OFFLOAD = {"filename": "/opt/app/workloads/train/offload.py", "line": 120, "name": "_unpack"}
CHECKPOINT = {"filename": "/usr/lib/python3.11/site-packages/torch/utils/checkpoint.py", "line": 1100,
              "name": "recompute_fn"}
LINEAR = {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}


def alloc(addr: int, size: int, *frames: dict, t: int = 0, stream: int = 0) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames), "time_us": t, "stream": stream}


def free(addr: int, size: int, *, completed: bool = True) -> dict:
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": size, "frames": []}


def test_the_peak_is_the_highest_running_total_and_what_was_alive_then():
    events = [
        alloc(1, 100, LINEAR, LOOP, t=10),
        alloc(2, 300, CHECKPOINT, t=20),
        free(1, 100, completed=False),  # requested only: still counts until its stream is done
        alloc(3, 50, OFFLOAD, CHECKPOINT, t=30),  # peak: 1000 + 100 + 300 + 50
        free(1, 100),
        free(2, 300),
        free(900, 400),  # a block from before the window
        alloc(4, 200, LINEAR, t=40),  # 1000 - 400 + 50 + 200 = 850: below the peak
    ]
    peak = replay(events, start_bytes=1000)
    assert (peak.peak_bytes, peak.at_event, peak.at_time_us) == (1450, 3, 30)
    assert [b.size for b in peak.live] == [100, 300, 50]
    assert peak.held_from_before == 1000 and peak.end_bytes == 850


def test_memory_from_before_the_window_freed_before_the_peak_is_not_held_at_it():
    peak = replay([free(900, 400), alloc(1, 100, LOOP, t=5)], start_bytes=1000)
    assert peak.peak_bytes == 1000 and peak.at_event == -1 and peak.held_from_before == 1000  # the start itself
    peak = replay([free(900, 400), alloc(1, 500, LOOP, t=5)], start_bytes=1000)
    assert peak.peak_bytes == 1100 and peak.held_from_before == 600


def test_where_names_the_projects_innermost_frame_then_the_innermost():
    assert where([LINEAR, LOOP]) == "workloads/train/loop.py:300 train > torch/nn/modules/linear.py:125 forward"
    assert where([OFFLOAD, CHECKPOINT]) == "workloads/train/offload.py:120 _unpack"
    assert where([CHECKPOINT]) == "torch/utils/checkpoint.py:1100 recompute_fn"
    assert where([], stream=7) == "(no Python frame: autograd engine or C++, stream 7)"


def test_groups_sum_by_place_largest_first():
    peak = replay([alloc(1, 10, LINEAR, LOOP), alloc(2, 30, CHECKPOINT), alloc(3, 25, LINEAR, LOOP), alloc(4, 5)],
                  start_bytes=0)
    groups = grouped(peak.live)
    assert [(g.bytes, g.blocks) for g in groups] == [(35, 2), (30, 1), (5, 1)]
    assert groups[0].where.startswith("workloads/train/loop.py:300")


def snapshot(events: list[dict]) -> dict:
    return {"segments": [], "device_traces": [events]}


def test_the_report_matches_the_allocator_or_says_it_does_not_and_finds_the_step():
    events = [alloc(1, GIB, LINEAR, LOOP, t=1_000), free(1, GIB), alloc(2, 2 * GIB, CHECKPOINT, t=2_500)]
    good = report(snapshot(events), title="tuned-mb4", first_step=3, last_step=4, start_bytes=10 * GIB,
                  allocator_peak_bytes=12 * GIB, allocator_end_bytes=12 * GIB, start_time_us=500,
                  step_end_times_us=[2_000, 3_000])
    assert good.consistent and good.peak_step() == 4
    table = good.table()
    assert "peak 12.000 GiB (the allocator's: 12.000), at event 2, in step 4" in table
    assert "replay matches the allocator" in table
    assert "   2.000 GiB      1 blocks  torch/utils/checkpoint.py:1100 recompute_fn" in table
    assert json.loads(json.dumps(good.as_dict()))["peak_step"] == 4
    # A trace that lost its first entries (the circular buffer overflowed) ends elsewhere than the allocator.
    lost = report(snapshot(events[1:]), title="t", first_step=3, last_step=4, start_bytes=10 * GIB,
                  allocator_peak_bytes=12 * GIB, allocator_end_bytes=12 * GIB)
    assert not lost.consistent and "DOES NOT match" in lost.table()
    # A peak whose time is outside the window's is given no step.
    early = report(snapshot(events), title="t", first_step=3, last_step=4, start_bytes=10 * GIB,
                   allocator_peak_bytes=12 * GIB, allocator_end_bytes=12 * GIB, start_time_us=5_000,
                   step_end_times_us=[6_000, 7_000])
    assert early.peak_step() is None and "in step" not in early.table()


def test_a_window_needs_its_steps_in_order():
    with pytest.raises(ValueError, match="need 1 <= first <= last"):
        MemoryWindow(first=4, last=3, out=None, title="t", device="cuda:0")
