"""The peer DPO users pick: TRL's DPOTrainer (with peft for LoRA), set up as a careful user would, on
the same pairs, model shape and initial weights as the loop's `objective: dpo` run.

- weights: fp32 with bf16 autocast (`bf16=True`) for a full fine-tune, the reference a bf16 copy
  of the starting model (TRL only runs it under autocast: bf16 weights compute the same, in half
  the memory); for LoRA a bf16 base with peft's adapters (fp32), rank, alpha and target modules as
  the loop's config, the reference the base with the adapters off (TRL's own way);
- fused AdamW, liger-kernel's layer kernels when installed (`use_liger_kernel`: TRL 1.16 keeps its
  own fused log-prob head and applies liger's RMSNorm, SwiGLU and RoPE), the loop's learning rate
  schedule, clipping, weight decay, beta and loss;
- activation checkpointing as the loop's config has it (DPOConfig turns it on by default);
- padded batches: TRL 1.16 falls back to padding for `padding_free` ("temporarily unavailable
  since the DPO refactor"), so it is left off;
- the same pairs per optimizer step as the loop trains on average (its rows times the pairs its
  packing puts in a row), in micro-batches of at most TRL_PAIRS_PER_MICRO_BATCH pairs and
  accumulation for the rest (a careful user's choice on one GPU: a micro-batch of padded pairs up to
  twice the row length each grows fast).

Tokens/s count every token TRL runs that is not padding (both sequences of each pair, prompt
included), so a token is counted alike on both sides. TRL and datasets come from the host's
wheels (docs/gpu/wheels.sh DIR dpo); the job never imports this module.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Optional

import torch

from workloads.bench.hf_trainer import loss_recorder
from workloads.bench.strategy import StrategyResult
from workloads.context import TrainContext
from workloads.train.config import TrainConfig
from workloads.train.encode import load_tokenizer
from workloads.train.model import build_causal_lm
from workloads.train.pair_records import read_pairs
from workloads.train.pairs import encode_pair, pack_pairs

TRL_PAIRS_PER_MICRO_BATCH = 4
"""The most pairs (8 padded sequences) in one of TRL's micro-batches."""


def pairs_per_step(cfg: TrainConfig, records: list, tokenizer) -> tuple[int, float]:
    """(pairs the loop's step trains on average, its pairs per row): the same pairs packed as the
    loop packs them."""
    encoded = [encode_pair(tokenizer, r) for r in records]
    _, stats = pack_pairs(encoded, list(range(len(encoded))), seq_len=cfg.seq_len, pad_id=0)
    return max(1, round(cfg.samples_per_rank_per_step * stats.pairs_per_row)), stats.pairs_per_row


class CountingCollator:
    """Wraps TRL's collator and counts each batch's tokens that are not padding."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []

    def __call__(self, features: list[dict]) -> dict:
        out = self.inner(features)
        self.tokens.append(int(out["attention_mask"].sum()))
        return out


def build_models(cfg: TrainConfig, *, device: torch.device):
    """(policy, reference or None): the loop's initial weights (same seed); LoRA: a bf16 base with
    peft's adapters and no reference (TRL switches the adapters off)."""
    lm = build_causal_lm(dataclasses.replace(cfg.model, attn_implementation="sdpa"), device=device, seed=cfg.seed)
    lm.config.use_cache = False
    if cfg.method != "lora":
        reference = copy.deepcopy(lm).to(dtype=torch.bfloat16).eval().requires_grad_(False)
        return lm.to(device), reference
    from peft import LoraConfig, get_peft_model

    from workloads.train.method import resolve_target_modules

    targets = resolve_target_modules(lm, cfg.lora.target_modules)
    lm = lm.to(device=device, dtype=torch.bfloat16)
    return get_peft_model(lm, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                         target_modules=targets, task_type="CAUSAL_LM")), None


def train_trl_dpo(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device,
                  pairs_per_micro_batch: Optional[int] = None) -> StrategyResult:
    """TRL's DPOTrainer for cfg.steps steps; `pairs_per_micro_batch`: its micro-batch (default: as
    many as a step holds, at most TRL_PAIRS_PER_MICRO_BATCH)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from workloads.train.loss import liger_available

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    records = read_pairs([Path(cfg.data.path)], limit=cfg.data.max_examples)
    per_step, per_row = pairs_per_step(cfg, records, tokenizer)
    micro = min(per_step, pairs_per_micro_batch or TRL_PAIRS_PER_MICRO_BATCH)
    accumulation = max(1, round(per_step / micro))
    cuda = device.type == "cuda"
    model, reference = build_models(cfg, device=device)
    args = DPOConfig(
        output_dir=str(ctx.scratch_dir / "trl-dpo"), max_steps=cfg.steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, learning_rate=cfg.lr, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1], max_grad_norm=cfg.grad_clip, bf16=cfg.mixed_precision and cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", use_liger_kernel=cuda and liger_available(),
        gradient_checkpointing=cfg.model.activation_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no", report_to=[],
        # Under torchrun Trainer wraps the model in DDP, looking for unused parameters by default (an
        # extra pass over the graph every step) where none are: a careful user turns it off.
        ddp_find_unused_parameters=False,
        seed=cfg.seed, dataloader_num_workers=0, disable_tqdm=True, use_cpu=not cuda,
        # The loop's sequences: at most seq_len // 2 positions each, so seq_len // 2 + 1 tokens.
        max_length=cfg.seq_len // 2 + 1, beta=cfg.dpo.beta,
        loss_type=[cfg.dpo.loss_type, *(["sft"] if cfg.dpo.rpo_alpha else [])],
        loss_weights=[1.0, *([cfg.dpo.rpo_alpha] if cfg.dpo.rpo_alpha else [])],
        label_smoothing=cfg.dpo.label_smoothing, precompute_ref_log_probs=cfg.dpo.reference == "precomputed",
    )
    dataset = Dataset.from_list([{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in records])

    losses = loss_recorder()
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                         processing_class=tokenizer, callbacks=[losses])
    collator = CountingCollator(trainer.data_collator)
    trainer.data_collator = collator
    trainer.train()
    micro_steps = cfg.steps * accumulation
    counted = collator.tokens[:micro_steps]
    tokens_per_step = sum(counted) / len(counted) * accumulation if counted else None
    summary = {"example_tokens_per_step": tokens_per_step, "pairs_per_step": micro * accumulation,
               "loop_pairs_per_step": per_step, "loop_pairs_per_row": per_row, "pairs_per_micro_batch": micro,
               "grad_accum_steps": accumulation, "liger": args.use_liger_kernel,
               "activation_checkpointing": args.gradient_checkpointing, "reference_dtype": "bfloat16",
               "micro_batches": len(collator.tokens), "padding_free": False,
               "steps_per_epoch": math.ceil(len(records) / (micro * accumulation))}
    return StrategyResult(losses=losses.losses, self_reported=[{"summary": summary}])
