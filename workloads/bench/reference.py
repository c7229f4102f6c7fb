"""The reference strategy: how AWS's Ray-on-EKS sample trains.

The model is built whole in bf16 on each GPU, wrapped by FSDP1 (`FullyShardedDataParallel`) with a
size-based auto-wrap policy at 1e7 parameters, trained by AdamW directly on the bf16 parameters
(so the optimizer state is bf16 too), with the loss the Hugging Face model computes itself from
full logits. On the CPU (tests) the same code runs in fp32 over gloo.

It reads exactly the loop's batches (`workloads.train.loop.device_batches`) and starts from the loop's
initial weights (`build_causal_lm` with the same seed), so the two strategies differ only in how
they train.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from workloads.bench.runtime import mean_over_ranks
from workloads.bench.strategy import StrategyResult
from workloads.train.config import TrainConfig
from workloads.context import TrainContext
from workloads.train.data import build_data
from workloads.train.loop import device_batches
from workloads.train.model import build_causal_lm

WRAP_MIN_PARAMS = 10_000_000


def reference_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def train_reference(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
    # transformers' own sdpa, as the sample uses it (the loop's `varlen` backend is the project's).
    model_cfg = dataclasses.replace(cfg.model, attn_implementation="sdpa")
    lm = build_causal_lm(model_cfg, device=device, seed=cfg.seed).to(reference_dtype(device))
    model = FullyShardedDataParallel(
        lm,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=WRAP_MIN_PARAMS),
        device_id=device,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    source = build_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=lm.config.vocab_size,
                        model_name_or_path=cfg.model.name_or_path).train
    data = device_batches(source, cfg, ctx=ctx, device=device, position=0)
    losses = []
    for _ in range(cfg.steps):
        batch = next(data)
        # The loop's labels are already next-token aligned; shift_labels tells the model's own loss
        # not to shift them a second time, so both strategies score the same targets.
        labels = batch.labels.contiguous()
        loss = model(input_ids=batch.input_ids, labels=labels, shift_labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    # Read back once, after the last step: the steps themselves never wait for the host.
    means = mean_over_ranks(torch.stack(losses))
    return StrategyResult(losses=dict(enumerate(means, start=1)))
