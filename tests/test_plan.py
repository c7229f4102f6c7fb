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
    assert any(line.startswith("cost            $4.60 per hour (1 x g6.12xlarge at us-east-1's On-Demand list price")
               for line in lines)


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


def test_plan_turns_offloading_on_where_nothing_fits_without_it_and_says_so(capsys):
    """7B LoRA at 32,768 tokens a row on one g6.12xlarge: checkpointed, micro-batch 1 needs 25.0 GiB
    of an L4's 22.5 (28 layer inputs of 224 MiB); with the inputs offloaded, 19.0."""
    argv = ("--preset", "qwen2.5-7b-lora-24gb", "--nodes", "1", "--set", "seq_len=32768")
    code, out = run_plan(capsys, *argv, "--json")
    result = json.loads(out)
    assert code == 0 and result["memory"]["fits"] and result["micro_batch"] == 1
    assert result["activation_offloading"] and result["offloading_turned_on"]
    assert result["memory"]["offloaded_to_host_gib"] == pytest.approx(27 * 32768 * 3584 * 2 / 2**30, abs=0.01)
    _, text = run_plan(capsys, *argv)
    assert "activation checkpointing and offloading (turned on: without it the run does not fit)" in text
    assert "GiB pinned per rank for the offloaded layer inputs" in text
    # A micro-batch the user set is not changed: the refusal names offloading as the way out.
    code, out = run_plan(capsys, *argv, "--set", "micro_batch=1", "--json")
    result = json.loads(out)
    assert code == 1 and not result["activation_offloading"]
    assert "--set model.activation_offloading=true" in [w["change"] for w in result["fits_with"]]


def test_a_run_that_fits_keeps_its_layer_inputs_on_the_gpu(capsys):
    code, out = run_plan(capsys, "--preset", "qwen2.5-7b-lora-24gb", "--nodes", "1", "--json")
    result = json.loads(out)
    assert code == 0 and not result["activation_offloading"] and not result["offloading_turned_on"]
    assert result["memory"]["offloaded_to_host_gib"] == 0


def test_plan_says_why_it_chose_its_preset(capsys):
    """On one g6.12xlarge, 7B became LoRA without a word."""
    code, out = run_plan(capsys, "--model-size", "7b", "--nodes", "1")
    (line,) = [line for line in out.splitlines() if line.startswith("preset ")]
    assert code == 0 and " ".join(line.split()) == (
        "preset qwen2.5-7b-lora-24gb: LoRA, as a full fine-tune of 7B needs its state sharded over 8 or more GPUs "
        "of 24 GB and 1 x g6.12xlarge has 4 (--nodes 2 plans the full fine-tune, qwen2.5-7b-24gb)")
    _, out = run_plan(capsys, "--model-size", "7b")
    assert "preset          qwen2.5-7b-24gb: the full fine-tune of 7B, sharded over the 8 GPUs of 24 GB" in out
    _, out = run_plan(capsys, "--preset", "qwen2.5-7b-lora-24gb")
    assert "preset          qwen2.5-7b-lora-24gb: as --preset names it" in out


def test_a_method_set_chooses_the_preset_of_that_method_and_nothing_of_another_is_shown(capsys):
    """`--set method=full` kept the LoRA preset's name in the header and its micro-batch of 8 beside
    "full fine-tune"."""
    code, out = run_plan(capsys, "--model-size", "7b", "--nodes", "1", "--set", "method=full", "--json")
    result = json.loads(out)
    assert result["preset"] == "qwen2.5-7b-24gb" and result["method"] == "full"
    assert code == 1 and not result["memory"]["fits"]  # 4 L4s do not hold it: the way out is more nodes
    assert any(w["change"] == "2 nodes" for w in result["fits_with"])
    _, text = run_plan(capsys, "--model-size", "7b", "--nodes", "1", "--set", "method=full")
    assert "lora" not in text.lower().split("fits with")[0]
    assert "as --set method=full asks" in text
    # A preset named with another method is that preset as set, said so; a micro-batch that fits
    # nothing is not called the largest the GPU takes.
    _, text = run_plan(capsys, "--preset", "qwen2.5-7b-lora-24gb", "--nodes", "1", "--set", "method=full")
    lines = text.splitlines()
    assert lines[0].startswith("plan            qwen2.5-7b-lora-24gb with --set method=full on 1 x g6.12xlarge")
    assert "largest micro-batch" not in text and "no micro-batch fits" in text


def test_plan_prices_the_cluster_in_a_region(capsys, tmp_path, monkeypatch):
    """The price named no region and could not be asked for one."""
    code, out = run_plan(capsys, "--region", "eu-central-1", "--json")
    result = json.loads(out)
    assert code == 0 and result["region"] == "eu-central-1"
    assert result["usd_per_hour"] == pytest.approx(2 * 5.75429, abs=0.01)
    _, text = run_plan(capsys, "--region", "eu-central-1")
    assert "cost            $11.51 per hour (2 x g6.12xlarge at eu-central-1's On-Demand list price of 2026-01-21)" \
        in text
    # By default the stack's region, instance type and nodes.
    (tmp_path / "Pulumi.yaml").write_text("name: ray-eks\n")
    (tmp_path / "Pulumi.tokyo.yaml").write_text(
        "config:\n  aws:region: ap-northeast-1\n  ray-eks:gpuAvailabilityZone: ap-northeast-1a\n"
        "  ray-eks:gpuAvailabilityZoneId: apne1-az1\n  ray-eks:gpuNodeCount: 4\n")
    monkeypatch.setattr(plan, "PROJECT_DIR", tmp_path)
    code, out = run_plan(capsys, "--stack", "tokyo", "--json")
    result = json.loads(out)
    assert (result["region"], result["nodes"], result["instance_type"]) == ("ap-northeast-1", 4, "g6.12xlarge")
    assert result["usd_per_hour"] == pytest.approx(4 * 6.67369, abs=0.01)
    # A region the table has no price for says whose price it shows.
    _, text = run_plan(capsys, "--region", "sa-east-1")
    assert "at us-east-1's On-Demand list price" in text and "no sa-east-1 price" in text
    assert plan.main("plan", ["--region", "us-wset-2"]) == 2
    assert "--region 'us-wset-2' is not an AWS region; did you mean us-west-2?" in capsys.readouterr().err
