"""The stability check (workloads/bench/stability.py): drift and flat memory, on made-up records."""

from __future__ import annotations

import json
import random

import pytest

from workloads.bench.stability import DRIFT_MAX, Window, judge, main


def windows(n=60, *, rate=lambda step: 52_000.0, memory=lambda step: 40.0, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [Window(step=5 * i, tokens_per_s=rate(5 * i) * (1 + rng.uniform(-noise, noise)),
                   mem_in_use_gib=memory(5 * i), peak_mem_gib=memory(5 * i) + 30) for i in range(1, n + 1)]


def test_noise_around_a_flat_line_is_stable():
    verdict = judge(windows(noise=0.02))
    assert verdict.ok and abs(verdict.drift) < DRIFT_MAX / 2 and verdict.warmup_steps == 30


def test_a_run_that_slows_by_three_percent_drifts():
    verdict = judge(windows(rate=lambda step: 52_000.0 * (1 - 0.03 * step / 300), noise=0.01))
    assert not verdict.drift_ok and verdict.drift == pytest.approx(-0.03, abs=0.006)


def test_memory_that_grows_a_few_mib_a_step_is_not_flat():
    verdict = judge(windows(memory=lambda step: 40.0 + 0.002 * step))  # 2 MiB a step: 0.53 GiB over steps 35-300
    assert verdict.drift_ok and not verdict.memory_ok and not verdict.ok
    assert verdict.memory_spread_gib == pytest.approx(0.53, abs=0.005)


def test_too_short_a_run_is_refused():
    with pytest.raises(ValueError, match="need at least 5"):
        judge(windows(n=5))


def test_the_command_writes_its_verdict_and_exits_by_it(tmp_path):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    lines = [json.dumps({"metrics": {"step": w.step, "tokens_per_s_per_device": w.tokens_per_s,
                                     "mem_in_use_gib": w.mem_in_use_gib, "peak_mem_gib": w.peak_mem_gib}})
             for w in windows(rate=lambda step: 50_000.0 - 10 * step)]
    (run / "metrics" / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    assert main([str(run)]) == 1
    record = json.loads((run / "stability.json").read_text())
    assert not record["verdict"]["drift_ok"] and record["verdict"]["memory_ok"] and len(record["windows"]) == 60
    assert (run / "stability.png").is_file()
    assert main([str(tmp_path / "nothing")]) == 2
