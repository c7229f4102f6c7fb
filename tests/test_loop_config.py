"""The training config: presets, JSON round trip, overrides, and clear errors for mistakes."""

from __future__ import annotations

import json

import pytest

from workloads.train.config import (PRESETS, DataConfig, ModelConfig, TrainConfig, preset, preset_for_gpu,
                              with_overrides)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name):
    cfg = preset(name)
    assert TrainConfig.from_json(json.dumps(cfg.to_dict())) == cfg
    assert TrainConfig.from_json(cfg.to_json()) == cfg


def test_gpu_preset_fine_tunes_the_pretrained_model_on_the_hub_dataset_in_mixed_precision():
    cfg = preset("qwen2.5-1.5b")
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B" and not cfg.model.is_named_architecture
    assert (cfg.data.kind, cfg.data.path, cfg.data.split) == ("hub", "HuggingFaceH4/ultrachat_200k", "train_sft")
    assert 0 < cfg.data.eval_fraction and 0 < cfg.eval_every < cfg.steps
    assert (cfg.seq_len, cfg.micro_batch) == (2048, 16)
    assert cfg.mixed_precision and cfg.fused_linear_ce and cfg.export_model


def test_synthetic_gpu_preset_is_the_same_run_without_downloads():
    real, synthetic = preset("qwen2.5-1.5b").to_dict(), preset("qwen2.5-1.5b-synthetic").to_dict()
    assert synthetic["model"]["name_or_path"] == "qwen2.5-1.5b" and synthetic["data"]["kind"] == "synthetic"
    # The benchmarks' preset keeps micro-steps per rank (they measure per-GPU speed at a micro-batch).
    assert {k for k in real if real[k] != synthetic[k]} == {"model", "data", "eval_every", "rows_per_step"}


def test_demo_preset_is_small_learnable_evaluates_and_checkpoints():
    cfg = preset("demo-cpu")
    assert cfg.model.name_or_path == "tiny-qwen2" and cfg.data.kind == "synthetic"
    assert not cfg.mixed_precision and not cfg.compile
    assert cfg.steps <= 200 and 0 < cfg.checkpoint_every < cfg.steps and 0 < cfg.eval_every < cfg.steps


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"stpes": 3}, r"unknown config key 'stpes'; did you mean 'steps'\?"),
        ({"model": {"name": "x"}}, r"unknown config key 'model.name'; did you mean 'model.name_or_path'\?"),
        ({"transport": {"expectt": "efa"}}, r"'transport.expectt'; did you mean 'transport.expect'"),
        ({"zzz": 1}, r"^unknown config key 'zzz'$"),
        ({"steps": "ten"}, r"steps must be an integer, got 'ten'"),
        ({"compile": "yes"}, r"compile must be true or false"),
        ({"model": "tiny-qwen2"}, r"model must be a mapping"),
        ({"steps": 0}, r"steps is 0: it must be at least 1"),
        ({"lr": -1.0}, r"lr is -1.0: use a positive learning rate"),
        ({"min_lr_ratio": 2}, r"min_lr_ratio is 2.0"),
        ({"betas": [0.9, 1.5]}, r"betas is \(0.9, 1.5\)"),
        ({"data": {"kind": "parquet"}}, r"data.kind is 'parquet': use one of synthetic, jsonl, hub"),
        ({"data": {"kind": "jsonl"}}, r"data.path is empty"),
        ({"data": {"kind": "jsonl", "path": "a.jsonl"}}, r"data.tokenizer is empty"),
        ({"data": {"kind": "hub", "path": "ultrachat"}}, r"kind \"hub\" needs a hub dataset id"),
        ({"data": {"eval_fraction": 0.9}}, r"data.eval_fraction is 0.9: use a share in \[0, 0.5\]"),
        ({"data": {"max_examples": -1}}, r"data.max_examples is -1"),
        ({"eval_every": -1}, r"eval_every is -1: it must be 0 or more"),
        ({"eval_every": 5, "model": {"name_or_path": "org/m"}, "data": {"kind": "jsonl", "path": "a.jsonl",
          "eval_fraction": 0}}, r"eval_every is 5 but data.eval_fraction is 0, so nothing is held out"),
        ({"eval_batches": 0}, r"eval_batches is 0: it must be at least 1"),
        ({"export_dtype": "fp8"}, r"export_dtype is 'fp8': use one of 'auto', 'float32', 'bfloat16', 'float16'"),
        ({"transport": {"expect": "tcp"}}, r"transport.expect is 'tcp': use one of 'efa', 'any'"),
        ({"transport": {"min_busbw_gbps": "fast"}}, r"transport.min_busbw_gbps must be a number"),
    ],
)
def test_mistakes_are_value_errors_naming_the_field(d, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(d)


def test_jsonl_with_a_pretrained_model_takes_its_tokenizer():
    cfg = TrainConfig(
        model=ModelConfig(name_or_path="Qwen/Qwen2.5-1.5B"), data=DataConfig(kind="jsonl", path="a.jsonl")
    )
    assert cfg.data.tokenizer == ""


def test_overrides_parse_json_values_and_dotted_keys():
    cfg = with_overrides(
        preset("demo-cpu"),
        [
            "steps=7",
            "lr=0.5",
            "compile=true",
            "model.name_or_path=org/model",
            "transport.min_busbw_gbps=null",
            "betas=[0.8,0.9]",
        ],
    )
    assert (cfg.steps, cfg.lr, cfg.compile, cfg.betas) == (7, 0.5, True, (0.8, 0.9))
    assert cfg.model.name_or_path == "org/model"
    assert cfg.transport.min_busbw_gbps is None


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("steps", r"use key=value"),
        ("steps.x=1", r"'steps' is not a nested config section"),
        ("step=3", r"did you mean 'steps'"),
    ],
)
def test_bad_overrides_say_how_to_write_them(item, match):
    with pytest.raises(ValueError, match=match):
        with_overrides(preset("demo-cpu"), [item])


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown preset 'demo'.*did you mean 'demo-cpu'"):
        preset("demo")


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        preset("demo-cpu").steps = 3  # type: ignore[misc]


def test_invalid_json_is_a_value_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        TrainConfig.from_json("{steps: 3")


@pytest.mark.parametrize(("gpu_memory_gib", "name"), [(None, "qwen2.5-1.5b"), (141, "qwen2.5-1.5b"),
                                                      (80, "qwen2.5-1.5b"), (48, "qwen2.5-1.5b-24gb"),
                                                      (24, "qwen2.5-1.5b-24gb")])
def test_the_default_preset_follows_the_gpu_memory(gpu_memory_gib, name):
    assert preset_for_gpu(gpu_memory_gib) == name


def test_config_export_dtypes_are_the_exporters():
    import typing

    from workloads.model_io.hf_writer import EXPORT_DTYPES

    assert typing.get_args(typing.get_type_hints(TrainConfig)["export_dtype"]) == EXPORT_DTYPES


def test_the_24gb_preset_is_the_same_fine_tune_in_smaller_steps():
    full, small = preset("qwen2.5-1.5b").to_dict(), preset("qwen2.5-1.5b-24gb").to_dict()
    changed = {k for k in full if full[k] != small[k]}
    assert changed == {"micro_batch", "reshard_after_forward"}
    assert small["micro_batch"] < full["micro_batch"] and small["reshard_after_forward"] is True


def test_both_gpu_presets_train_the_same_rows_per_step_and_the_step_time_model_describes_it():
    """On the default cluster (2 nodes x 4 GPUs) both presets train 128 rows per optimizer step,
    so they share a learning rate and cover the data in the same steps; the step-time model's
    default strategies for 2x g6.12xlarge are the 24 GB preset's micro-steps."""
    from workloads.sizing.step_time import cluster_strategies

    gpus = 2 * 4
    full, small = preset("qwen2.5-1.5b").for_world_size(gpus), preset("qwen2.5-1.5b-24gb").for_world_size(gpus)
    assert full.samples_per_rank_per_step * gpus == small.samples_per_rank_per_step * gpus == 128
    assert small.grad_accum_steps > 1  # each micro-step reduces in-node; only the last crosses nodes
    for strategy in cluster_strategies():
        assert (strategy.micro_batch, strategy.grad_accum_steps, strategy.seq_len) == (
            small.micro_batch, small.grad_accum_steps, small.seq_len)
