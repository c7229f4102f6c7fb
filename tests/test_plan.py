"""`python -m workloads plan`: memory per GPU, rows per step, speed and cost, without a cluster; and
the fit check's choices (presets by GPU, the nearest settings that fit)."""

from __future__ import annotations

import json

import pytest

from workloads.sizing.memory import Architecture
from workloads.client import plan
from workloads.client.fit import Target, assess, nearest_fits
from workloads.model_io.architectures import named_architecture
from workloads.train.config import preset, preset_for_gpu, with_overrides


def run_plan(capsys, *argv: str) -> tuple[int, str]:
    code = plan.main("plan", list(argv))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("argv, preset_name, rows, accum, method", [
    (("--model-size", "7b"), "qwen2.5-7b-24gb", 128, 16, "full"),
    (("--model-size", "7b", "--nodes", "1"), "qwen2.5-7b-lora-24gb", 128, 4, "lora"),
    (("--instance-type", "p5.48xlarge", "--nodes", "1", "--model-size", "7b"), "qwen2.5-7b", 128, 4, "full"),
    ((), "qwen2.5-1.5b-24gb", 128, 8, "full"),
])
def test_plan_json_has_the_run_its_memory_speed_and_cost(capsys, argv, preset_name, rows, accum, method):
    code, out = run_plan(capsys, *argv, "--json")
    result = json.loads(out)
    assert code == 0 and result["preset"] == preset_name and result["method"] == method
    assert (result["rows_per_step"], result["grad_accum_steps"]) == (rows, accum)
    assert result["memory"]["fits"] and result["memory"]["needed_gib"] <= result["memory"]["gpu_gib"]
    speed = result["speed"]
    assert speed["tokens_per_s"] == pytest.approx(speed["tokens_per_s_per_gpu"] * result["world_size"], rel=1e-3)
    hours = 1e9 / speed["tokens_per_s"] / 3600
    assert speed["hours_per_billion_tokens"] == pytest.approx(hours, rel=1e-2)
    assert speed["usd_per_billion_tokens"] == pytest.approx(hours * result["usd_per_hour"], rel=1e-2)


def test_the_7b_presets_meet_their_memory_targets_on_l4s(capsys):
    for argv in (("--preset", "qwen2.5-7b-lora-24gb", "--nodes", "1"), ("--preset", "qwen2.5-7b-24gb")):
        _, out = run_plan(capsys, *argv, "--json")
        assert json.loads(out)["memory"]["predicted_gib"] <= 21


def test_plan_prints_a_table(capsys):
    code, out = run_plan(capsys, "--preset", "qwen2.5-7b-lora-24gb", "--nodes", "1")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("plan            qwen2.5-7b-lora-24gb on 1 x g6.12xlarge (4 x L4)")
    assert any(line.startswith("method          LoRA of Qwen/Qwen2.5-7B-Instruct, activation checkpointing")
               for line in lines)
    assert any(line.startswith("rows per step   128 = micro-batch 8 x 4 micro-steps x 4 ranks") for line in lines)
    assert any(line.startswith("memory per GPU") and line.endswith(": fits") for line in lines)
    assert any(line.startswith("cost            $4.60 per hour;") for line in lines)


def test_a_run_that_does_not_fit_exits_1_with_what_does(capsys):
    code, out = run_plan(capsys, "--preset", "qwen2.5-7b-24gb", "--set", "model.activation_checkpointing=false",
                         "--json")
    result = json.loads(out)
    assert code == 1 and not result["memory"]["fits"]
    changes = [w["change"] for w in result["fits_with"]]
    assert any("model.activation_checkpointing=true" in c for c in changes)
    assert all(w["predicted_gib"] < result["memory"]["gpu_gib"] for w in result["fits_with"])


def test_a_gpu_without_a_published_peak_gets_no_speed(capsys):
    code, out = run_plan(capsys, "--instance-type", "g5.12xlarge", "--json")
    assert code == 0 and json.loads(out)["speed"] is None


@pytest.mark.parametrize("memory, size, gpus, name", [
    (24, "1.5b", 8, "qwen2.5-1.5b-24gb"), (80, "1.5b", 8, "qwen2.5-1.5b"), (None, "1.5b", None, "qwen2.5-1.5b"),
    (24, "7b", 8, "qwen2.5-7b-24gb"), (24, "7b", 4, "qwen2.5-7b-lora-24gb"), (80, "7b", 8, "qwen2.5-7b"),
])
def test_presets_are_chosen_by_gpu_memory_and_count(memory, size, gpus, name):
    assert preset_for_gpu(memory, model_size=size, gpus=gpus) == name


@pytest.mark.parametrize("overrides", [["micro_batch=4"], ["rows_per_step=0", "micro_batch=4", "grad_accum_steps=4"]])
def test_the_nearest_settings_that_fit_keep_the_rows_per_step(overrides):
    """With the preset's rows per step, or with micro-steps per rank."""
    arch = Architecture.from_config(named_architecture("qwen2.5-7b"))
    cfg = with_overrides(preset("qwen2.5-7b-24gb"), overrides)
    target = Target.instances("g6.12xlarge", 2)
    assert not assess(cfg, arch, target).fits
    rows = cfg.for_world_size(target.world_size).samples_per_rank_per_step
    for alternative in nearest_fits(cfg, arch, target):
        assert alternative.fit.fits
        changed = alternative.fit.cfg  # as the ranks run it
        if "micro_batch" in alternative.label:
            assert changed.samples_per_rank_per_step == rows
