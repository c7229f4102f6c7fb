"""Chats whose answers have very different lengths, so packed rows hold very different numbers of
labels: where a loss that averages per micro-batch or per rank, instead of per token, shows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch

from workloads.model_io.toy import toy_tokenizer, write_chat_jsonl
from workloads.train.config import DataConfig, ModelConfig
from workloads.train.data import Batch, build_data
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy
from workloads.train.model import CausalLMWithLoss, build_causal_lm

WORDS = [" is", " the", " capital", " of", " France", " Japan"]  # one toy token each
SEQ_LEN = 64


def write_uneven_chats(folder: Path, *, count: int = 24, seed: int = 0) -> tuple[Path, Path]:
    """(JSONL, tokenizer folder): a quarter of the answers 39 or 40 tokens long, the rest 1 token.
    (The first 8 rows then hold 267 labels: over 4 ranks a divisor of 66.75, which bf16 rounds to 67.)"""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(WORDS) for _ in range(n))

    def answer(i: int) -> int:
        return (39 if i % 8 == 0 else 40) if i % 4 == 0 else 1

    records = [{"messages": [{"role": "user", "content": text(4)},
                             {"role": "assistant", "content": text(answer(i))}]} for i in range(count)]
    tokenizer = folder / "tokenizer"
    toy_tokenizer().save_pretrained(tokenizer)
    return write_chat_jsonl(folder / "uneven.jsonl", records), tokenizer


def data_overrides(jsonl: Path, tokenizer: Path) -> list[str]:
    return ["data.kind=jsonl", f"data.path={jsonl}", f"data.tokenizer={tokenizer}", "data.eval_fraction=0",
            f"seq_len={SEQ_LEN}", "eval_every=0"]


def with_bf16_compute(model: CausalLMWithLoss) -> CausalLMWithLoss:
    """The model as FSDP2's mixed precision computes with it: bf16 copies of its parameters (its
    buffers, such as the rotary frequencies, stay fp32, as FSDP2 leaves them)."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return model


def one_batch_step(jsonl: Path, tokenizer: Path, *, rows: int, seed: int = 0,
                   pieces: Optional[list[list[int]]] = None) -> dict[str, float]:
    """The first `rows` rows as one batch in one process: the mean over every label of the step,
    what any split into micro-batches and ranks must give; {"loss", "grad_norm", "labels"}.

    Without `pieces`: fp32, full logits and transformers' own sdpa with its mask from the
    restarting position ids (not the loop's attention or loss). With `pieces` (the rows of each
    micro-batch on each rank): bf16 compute as FSDP2's mixed precision does it, each piece's
    forward and backward apart and their gradients summed in fp32 (FSDP2's fp32 reduction), with
    the loop's attention and chunked loss (both checked against the fp32 references elsewhere)
    and the step's label count as the exact divisor."""
    data = build_data(DataConfig(kind="jsonl", path=str(jsonl), tokenizer=str(tokenizer), eval_fraction=0.0),
                      seq_len=SEQ_LEN, seed=seed, vocab_size=512, model_name_or_path="")
    batch = Batch.stack([data.train.sample(g) for g in range(rows)])
    labelled = (batch.labels != IGNORE_INDEX).sum(dim=1)
    assert labelled.max() > 3 * labelled.min(), "the rows must hold very different label counts"
    mixed_precision = pieces is not None
    attention = "varlen" if mixed_precision else "sdpa"
    lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2", attn_implementation=attention),
                         device=torch.device("cpu"), seed=seed)
    model = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="chunked" if mixed_precision else "plain"))
    if not mixed_precision:
        loss = model(batch.input_ids, batch.labels, batch.position_ids, **batch.attention())
        loss.backward()
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        return {"loss": loss.item(), "grad_norm": _norm(grads), "labels": int(labelled.sum())}
    assert sorted(i for piece in pieces for i in piece) == list(range(rows))
    model = with_bf16_compute(model)
    count = labelled.sum()
    loss = torch.zeros((), dtype=torch.float64)
    grads = [torch.zeros(p.shape, dtype=torch.float32) for p in model.parameters()]
    for piece in pieces:
        part = Batch.stack([data.train.sample(g) for g in piece])
        piece_loss = model(part.input_ids, part.labels, part.position_ids, divisor=count, **part.attention())
        piece_loss.backward()
        loss += piece_loss.detach().double()
        for total, p in zip(grads, model.parameters(), strict=True):
            total += p.grad.float()
            p.grad = None
    return {"loss": loss.item(), "grad_norm": _norm([g.double() for g in grads]), "labels": int(count)}


def _norm(grads: list[torch.Tensor]) -> float:
    return torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
