"""The optimizer: which parameters get weight decay, and the learning-rate schedule, each checked
against figures worked out by hand rather than against the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from workloads.train.config import preset, with_overrides
from workloads.train.loop import build_model
from workloads.train.optim import build_optimizer, clip_grad_norm, lr_at, schedule, set_lr

PEAK, WARMUP, TOTAL, MIN_RATIO = 1e-3, 10, 110, 0.1
FLOOR = PEAK * MIN_RATIO


def _lr(step: int) -> float:
    return lr_at(step, peak=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, min_lr_ratio=MIN_RATIO)


def test_warmup_rises_linearly_to_the_peak():
    assert [_lr(s) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])


def test_cosine_decays_from_the_peak_to_the_floor_on_the_last_step():
    # 100 decay steps: a quarter of the way in, cos(pi/4); halfway, the midpoint; at the end, the floor.
    assert _lr(35) == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 + math.sqrt(0.5)) / 2)
    assert _lr(60) == pytest.approx((PEAK + FLOOR) / 2)
    assert _lr(TOTAL) == pytest.approx(FLOOR)
    assert _lr(TOTAL + 50) == pytest.approx(FLOOR)  # a run extended past its schedule stays at the floor
    after_warmup = [_lr(s) for s in range(WARMUP, TOTAL + 1)]
    assert all(a > b for a, b in zip(after_warmup, after_warmup[1:]))


def test_a_run_shorter_than_its_warmup_never_leaves_it():
    assert lr_at(4, peak=PEAK, warmup_steps=10, total_steps=4, min_lr_ratio=MIN_RATIO) == pytest.approx(4e-4)


def test_the_schedule_of_a_config_reads_its_fields():
    cfg = with_overrides(preset("demo-cpu"), ["lr=0.01", "warmup_steps=4", "steps=20", "min_lr_ratio=0.25"])
    assert [schedule(cfg, s) for s in (2, 4, 20)] == pytest.approx([0.005, 0.01, 0.0025])


def test_a_schedule_without_decay_steps_ends_at_the_floor():
    assert lr_at(11, peak=PEAK, warmup_steps=10, total_steps=10, min_lr_ratio=MIN_RATIO) == pytest.approx(FLOOR)


@pytest.fixture
def model_and_optimizer():
    cfg = with_overrides(preset("demo-cpu"), ["weight_decay=0.1", "lr=0.01"])
    model, _ = build_model(cfg, device=torch.device("cpu"))
    return cfg, model, build_optimizer(model, cfg, device=torch.device("cpu"))


def test_norms_and_biases_get_no_weight_decay(model_and_optimizer):
    cfg, model, optimizer = model_and_optimizer
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(decay_of) == len(named) == sum(len(g["params"]) for g in optimizer.param_groups)
    exempt = {name for name in named if "norm" in name or name.endswith(".bias")}
    # The tiny Qwen2 has q/k/v biases and RMSNorm weights: both kinds are really exercised.
    assert any(n.endswith("self_attn.q_proj.bias") for n in exempt)
    assert any(n.endswith("input_layernorm.weight") for n in exempt)
    assert {name: decay_of[id(p)] for name, p in named.items()} == {
        name: 0.0 if name in exempt else cfg.weight_decay for name in named
    }


def test_one_step_with_zero_gradients_shrinks_only_the_matrices(model_and_optimizer):
    # AdamW's decoupled decay multiplies a decayed weight by (1 - lr * wd) even when its gradient is
    # zero; an exempt weight does not move at all.
    cfg, model, optimizer = model_and_optimizer
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(cfg.lr / cfg.warmup_steps)  # the schedule's first step
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1.0 if "norm" in name or name.endswith(".bias") else 1.0 - lr * cfg.weight_decay
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=name)


def test_adamw_gets_the_configs_betas_and_the_usual_eps(model_and_optimizer):
    cfg, _, optimizer = model_and_optimizer
    assert (optimizer.defaults["betas"], optimizer.defaults["eps"]) == (cfg.betas, 1e-8)


def test_fused_adamw_on_cuda_and_foreach_on_cpu(model_and_optimizer):
    # On CUDA one fused kernel updates every parameter; the CPU path uses the foreach implementation.
    # (Fused AdamW also runs on CPU tensors, so the CUDA choice can be built without a GPU.)
    cfg, model, optimizer = model_and_optimizer
    assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (False, True)
    on_cuda = build_optimizer(model, cfg, device=torch.device("cuda"))
    assert (on_cuda.defaults["fused"], on_cuda.defaults["foreach"]) == (True, None)


def test_set_lr_sets_every_group(model_and_optimizer):
    _, _, optimizer = model_and_optimizer
    set_lr(optimizer, 0.125)
    assert [g["lr"] for g in optimizer.param_groups] == [0.125] * len(optimizer.param_groups)


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 100.0])
def test_clip_grad_norm_is_torchs_on_a_plain_model(max_norm):
    torch.manual_seed(0)
    ours, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    reference.load_state_dict(ours.state_dict())
    for model in (ours, reference):
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    norm = clip_grad_norm(ours, max_norm=max_norm)
    # max_norm 0 means no clipping: torch's own with an infinite bound reports the norm and clips nothing.
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm or float("inf"))
    torch.testing.assert_close(norm, expected)
    assert norm > 0.5  # the 0.5 case really clips
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
