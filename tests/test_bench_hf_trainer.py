"""The Trainer peer's heartbeat (workloads/bench/hf_trainer.py): a run that gives no step says where
it is (its first forwards, its first optimizer steps), on the host's clock."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from workloads.bench.hf_trainer import Heartbeat


def test_the_first_forwards_and_steps_are_announced_and_then_it_goes_quiet():
    lines: list[str] = []
    model = nn.Linear(4, 4)
    beat = Heartbeat(model, say=lines.append)
    for _ in range(Heartbeat.FIRST + 2):
        model(torch.zeros(1, 4))
    callback = beat.callback()
    for step in (1, 2, 7):
        callback.on_step_end(None, SimpleNamespace(global_step=step), None)
    beat.remove()
    model(torch.zeros(1, 4))
    assert [re.sub(r" [0-9.]+ s after .*", "", line) for line in lines] == [
        "[hf-trainer] forward 1 began", "[hf-trainer] forward 1 ended", "[hf-trainer] forward 2 began",
        "[hf-trainer] forward 2 ended", "[hf-trainer] forward 3 began", "[hf-trainer] forward 3 ended",
        "[hf-trainer] optimizer step 1 ended", "[hf-trainer] optimizer step 2 ended"]
    assert all(line.endswith("graphs compiled so far)") for line in lines)
