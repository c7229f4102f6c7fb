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


def test_gpu_preset_is_the_1_5b_shape_in_mixed_precision():
    cfg = preset("qwen2.5-1.5b")
    assert cfg.model.name_or_path == "qwen2.5-1.5b"
    assert (cfg.seq_len, cfg.micro_batch) == (2048, 16)
    assert cfg.mixed_precision and cfg.fused_linear_ce


def test_demo_preset_is_small_learnable_and_checkpoints():
    cfg = preset("demo-cpu")
    assert cfg.model.name_or_path == "tiny-qwen2" and cfg.data.kind == "synthetic"
    assert not cfg.mixed_precision and not cfg.compile
    assert 40 <= cfg.steps <= 60 and 0 < cfg.checkpoint_every < cfg.steps


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
        ({"data": {"kind": "parquet"}}, r"data.kind is 'parquet': use one of synthetic, jsonl"),
        ({"data": {"kind": "jsonl"}}, r"data.path is empty"),
        ({"data": {"kind": "jsonl", "path": "a.jsonl"}}, r"data.tokenizer is empty"),
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


def test_the_24gb_preset_is_the_same_fine_tune_in_smaller_steps():
    full, small = preset("qwen2.5-1.5b").to_dict(), preset("qwen2.5-1.5b-24gb").to_dict()
    changed = {k for k in full if full[k] != small[k]}
    assert changed == {"micro_batch", "reshard_after_forward", "peak_flops"}
    assert small["micro_batch"] < full["micro_batch"] and small["reshard_after_forward"] is True
