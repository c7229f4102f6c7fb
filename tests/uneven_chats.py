"""Chats whose answers have very different lengths, so packed rows hold very different numbers of
labels: where a loss that averages per micro-batch or per rank, instead of per token, shows."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from workloads.model_io.toy import toy_tokenizer, write_chat_jsonl
from workloads.train.config import DataConfig, ModelConfig
from workloads.train.data import Batch, build_data
from workloads.train.loss import LinearCrossEntropy
from workloads.train.model import CausalLMWithLoss, build_causal_lm

WORDS = [" is", " the", " capital", " of", " France", " Japan"]  # one toy token each
SEQ_LEN = 64


def write_uneven_chats(folder: Path, *, count: int = 24, seed: int = 0) -> tuple[Path, Path]:
    """(JSONL, tokenizer folder): a quarter of the answers 40 tokens long, the rest 1 token."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(WORDS) for _ in range(n))

    records = [{"messages": [{"role": "user", "content": text(4)},
                             {"role": "assistant", "content": text(40 if i % 4 == 0 else 1)}]} for i in range(count)]
    tokenizer = folder / "tokenizer"
    toy_tokenizer().save_pretrained(tokenizer)
    return write_chat_jsonl(folder / "uneven.jsonl", records), tokenizer


def data_overrides(jsonl: Path, tokenizer: Path) -> list[str]:
    return ["data.kind=jsonl", f"data.path={jsonl}", f"data.tokenizer={tokenizer}", "data.eval_fraction=0",
            f"seq_len={SEQ_LEN}", "eval_every=0"]


def one_batch_step(jsonl: Path, tokenizer: Path, *, rows: int, seed: int = 0) -> tuple[float, float]:
    """(loss, gradient norm) of the first `rows` rows as one batch in one process, fp32 and full
    logits: the mean over every label of the step, what any split into micro-batches and ranks must
    give."""
    data = build_data(DataConfig(kind="jsonl", path=str(jsonl), tokenizer=str(tokenizer), eval_fraction=0.0),
                      seq_len=SEQ_LEN, seed=seed, vocab_size=512, model_name_or_path="")
    batch = Batch.stack([data.train.sample(g) for g in range(rows)])
    labelled = (batch.labels != -100).sum(dim=1)
    assert labelled.max() > 3 * labelled.min(), "the rows must hold very different label counts"
    # transformers' own sdpa with its mask from the restarting position ids: not the loop's attention.
    lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2", attn_implementation="sdpa"), device=torch.device("cpu"),
                         seed=seed)
    model = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="plain"))
    loss = model(batch.input_ids, batch.labels, batch.position_ids, **batch.attention())
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()
