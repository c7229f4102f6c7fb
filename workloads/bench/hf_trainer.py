"""The peer users pick instead of the loop: Hugging Face's Trainer (with peft for LoRA), set up as a
careful user would, on the same chats, model shape and initial weights.

- weights: fp32 with bf16 autocast (`bf16=True`) for a full fine-tune; for LoRA a bf16 base with
  peft's adapters (fp32, peft's default), rank, alpha and target modules as the loop's config;
- fused AdamW (`adamw_torch_fused`), liger-kernel's fused layers when installed
  (`use_liger_kernel`), the loop's learning rate schedule, clipping and weight decay;
- activation checkpointing when the loop's config asks for it (non-reentrant);
- batches, by `HF_BATCHING`: "flat" (padding-free: `DataCollatorWithFlattening` into one row per
  micro-batch, position ids restarting per conversation, flex_attention keeping them apart) or
  "padded" (padded to the longest in the micro-batch, grouped by length).

It reads the loop's conversations (the same records, chat template and answer-only labels,
truncated to the row length) and takes as many of them per micro-batch as fill the loop's rows on
average, so both train about the same tokens per step. Tokens/s count conversation tokens, never
padding. Trainer and accelerate come with the `bench` extra; the job never imports this module.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from workloads.bench.strategy import StrategyResult
from workloads.context import TrainContext
from workloads.train.config import TrainConfig
from workloads.train.encode import encode_records, load_tokenizer
from workloads.train.loss import IGNORE_INDEX
from workloads.train.model import build_causal_lm
from workloads.train.records import read_records

HF_BATCHINGS = ("flat", "padded")


def conversations(cfg: TrainConfig) -> tuple[list[dict], object]:
    """The loop's chats as Trainer examples ({input_ids, labels}, labels not shifted: the model
    shifts them), each cut to the row length; and the tokenizer."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    records = read_records([Path(cfg.data.path)], text_field=cfg.data.text_field,
                           messages_field=cfg.data.messages_field, limit=cfg.data.max_examples,
                           data_format=cfg.data.format)
    examples = []
    for example in encode_records(tokenizer, records):
        tokens, targets = example.tokens[: cfg.seq_len], example.targets[: cfg.seq_len]
        examples.append({"input_ids": tokens,
                         "labels": [t if target else IGNORE_INDEX for t, target in zip(tokens, targets)]})
    return examples, tokenizer


class CountingCollator:
    """Wraps a collator and counts each batch's conversation tokens (its positions minus padding)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []

    def __call__(self, features: list[dict]) -> dict:
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        return self.inner(features)


def build_model(cfg: TrainConfig, *, device: torch.device, attn_implementation: str):
    """The loop's initial weights (same seed), fp32; LoRA: a bf16 base with peft's adapters."""
    lm = build_causal_lm(dataclasses.replace(cfg.model, attn_implementation=attn_implementation),
                         device=device, seed=cfg.seed)
    lm.config.use_cache = False
    if cfg.method != "lora":
        return lm.to(device)
    from peft import LoraConfig, get_peft_model

    from workloads.train.method import resolve_target_modules

    targets = resolve_target_modules(lm, cfg.lora.target_modules)
    lm = lm.to(device=device, dtype=torch.bfloat16)
    return get_peft_model(lm, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                         target_modules=targets, task_type="CAUSAL_LM"))


class Heartbeat:
    """Says when each of the first micro-batches' forward starts and ends and when the first
    optimizer steps end, on the host's clock, with torch.compile's compilations so far: a peer that
    gives no step shows whether it is stuck in its first forward (a compile, a mask build), its
    backward, or just slow (the 7B LoRA Trainer + peft runs without checkpointing that gave no step
    in minutes left no line to tell)."""

    FIRST = 3

    def __init__(self, model, *, say) -> None:
        import time

        self._clock, self._say, self.started = time.perf_counter, say, time.perf_counter()
        self.forwards = 0
        self._handles = [model.register_forward_pre_hook(self._before),
                         model.register_forward_hook(self._after, always_call=True)]

    def _compiles(self) -> str:
        from torch._dynamo.utils import counters

        return f"{counters['stats'].get('unique_graphs', 0)} graphs compiled so far"

    def _line(self, what: str) -> None:
        self._say(f"[hf-trainer] {what} {self._clock() - self.started:.1f} s after the model was ready "
                  f"({self._compiles()})")

    def _before(self, module, args) -> None:
        self.forwards += 1
        if self.forwards <= self.FIRST:
            self._line(f"forward {self.forwards} began")

    def _after(self, module, args, output) -> None:
        if self.forwards <= self.FIRST:
            self._line(f"forward {self.forwards} ended")

    def callback(self):
        from transformers import TrainerCallback

        beat = self

        class StepEnds(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step <= beat.FIRST:
                    beat._line(f"optimizer step {state.global_step} ended")

        return StepEnds()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def loss_recorder():
    """A Trainer callback that keeps each logged loss by optimizer step (`.losses`): the peers' loss
    curves beside the loop's (Trainer here, TRL's DPOTrainer in trl_dpo.py)."""
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    return Losses()


def _grouping(*, by_length: bool) -> dict:
    """TrainingArguments' switch for length-grouped batches: `train_sampling_strategy` in recent
    transformers 5 releases, `group_by_length` before."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "train_sampling_strategy" in fields:
        return {"train_sampling_strategy": "group_by_length" if by_length else "random"}
    return {"group_by_length": by_length}


def train_hf_trainer(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device,
                     batching: str = "flat") -> StrategyResult:
    from transformers import (DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer,
                              TrainingArguments)

    from workloads.train.loss import liger_available

    if batching not in HF_BATCHINGS:
        raise ValueError(f"batching {batching!r}: use one of {', '.join(HF_BATCHINGS)}")
    examples, tokenizer = conversations(cfg)
    mean_tokens = sum(len(e["input_ids"]) for e in examples) / len(examples)
    per_batch = max(1, round(cfg.micro_batch * cfg.seq_len / mean_tokens))
    flat = batching == "flat"
    cuda = device.type == "cuda"
    # flex_attention has no backward on the CPU (a harness check there): sdpa, which also keeps
    # flattened conversations apart by their position ids, only with a dense mask.
    model = build_model(cfg, device=device, attn_implementation="flex_attention" if flat and cuda else "sdpa")
    inner = (DataCollatorWithFlattening(return_position_ids=True) if flat
             else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX))
    collator = CountingCollator(inner)
    args = TrainingArguments(
        output_dir=str(ctx.scratch_dir / "hf-trainer"), max_steps=cfg.steps, per_device_train_batch_size=per_batch,
        gradient_accumulation_steps=cfg.grad_accum_steps, learning_rate=cfg.lr, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1], max_grad_norm=cfg.grad_clip, bf16=cfg.mixed_precision and cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", use_liger_kernel=cuda and liger_available(),
        gradient_checkpointing=cfg.model.activation_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no",
        report_to=[], seed=cfg.seed, dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, use_cpu=not cuda, **_grouping(by_length=not flat),
    )

    losses = loss_recorder()
    heartbeat = Heartbeat(model, say=print if ctx.rank == 0 else (lambda line: None))
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collator,
                      callbacks=[losses, heartbeat.callback()])
    try:
        trainer.train()
    finally:
        heartbeat.remove()
    micro_steps = cfg.steps * cfg.grad_accum_steps
    counted = collator.tokens[:micro_steps]
    tokens_per_step = sum(counted) / len(counted) * cfg.grad_accum_steps if counted else None
    summary = {"example_tokens_per_step": tokens_per_step, "examples_per_micro_batch": per_batch,
               "batching": batching, "padding_free": flat, "liger": args.use_liger_kernel,
               "micro_batches": len(collator.tokens), "mean_conversation_tokens": round(mean_tokens, 1),
               "steps_per_epoch": math.ceil(len(examples) / (per_batch * cfg.grad_accum_steps))}
    return StrategyResult(losses=losses.losses, self_reported=[{"summary": summary}])


def train_hf_trainer_padded(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
    return train_hf_trainer(cfg, ctx=ctx, device=device, batching="padded")
