"""Training data: a learnable synthetic stream, or JSONL text packed to the sequence length.

Both are indexed by a global sample number g = 0, 1, 2, ...: the k-th batch after position p
(samples consumed so far by all ranks together) on rank r of w takes samples
g = p + (k * micro_batch + j) * w + r for j < micro_batch. So ranks read disjoint samples,
together they read every sample of an epoch before any repeats, and the data position saved in
a checkpoint is that one number p, still valid if the job resumes on another number of ranks.

A sample is seq_len + 1 tokens: inputs are its first seq_len, labels its last seq_len.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from workloads.train.config import DataConfig
from workloads.train.paths import resolve_path


class SampleSource(Protocol):
    def sample(self, index: int) -> torch.Tensor:
        """Sample `index` (any int >= 0): int64 tokens of length seq_len + 1."""


@dataclass(frozen=True, kw_only=True)
class SyntheticSource:
    """Arithmetic progressions modulo the vocabulary: token t+1 = token t + stride, with a random
    start and a stride from a small set per sample. A model learns the transition rule and then
    infers each sample's stride from its context, so the loss falls far below log(vocab)."""

    vocab_size: int
    seq_len: int
    seed: int
    strides: tuple[int, ...] = (1, 2, 3, 5)

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = self.strides[int(torch.randint(len(self.strides), (1,), generator=gen))]
        return (start + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab_size


def pack_tokens(documents: list[list[int]], *, seq_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate documents, each followed by EOS, into [n, seq_len + 1] windows that overlap by
    one token, so every token but the first is a label exactly once. The tail that does not fill
    a window is dropped."""
    stream = torch.tensor([t for doc in documents for t in (*doc, eos_id)], dtype=torch.int64)
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"the JSONL data has {stream.numel()} tokens, fewer than one sample of seq_len + 1 = "
            f"{seq_len + 1}: add text or lower seq_len"
        )
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


def read_jsonl_texts(path: Path, *, text_field: str) -> list[str]:
    if not path.is_file():
        raise ValueError(f"data.path {str(path)!r} is not a file: point it at a JSONL file")
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{number}: no string field {text_field!r} (set data.text_field)")
            texts.append(record[text_field])
    return texts


@dataclass(frozen=True, kw_only=True)
class PackedSource:
    """Packed samples, visited in a seeded order that is reshuffled every epoch."""

    samples: torch.Tensor
    seed: int
    shuffle: bool = True

    def sample(self, index: int) -> torch.Tensor:
        n = self.samples.shape[0]
        epoch, offset = divmod(index, n)
        if not self.shuffle:
            return self.samples[offset]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        return self.samples[order[offset]]


def load_jsonl_source(
    cfg: DataConfig, *, seq_len: int, seed: int, tokenizer_name: str, vocab_size: int
) -> PackedSource:
    from transformers import AutoTokenizer

    tokenizer_name = resolve_path(tokenizer_name, field="data.tokenizer", hub_id_allowed=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer_name!r} has no EOS token: documents cannot be separated")
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_name!r} has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{vocab_size}: use the model's own tokenizer"
        )
    texts = read_jsonl_texts(Path(resolve_path(cfg.path, field="data.path", hub_id_allowed=False)),
                             text_field=cfg.text_field)
    documents = tokenizer(texts, add_special_tokens=False)["input_ids"]
    samples = pack_tokens(documents, seq_len=seq_len, eos_id=tokenizer.eos_token_id)
    return PackedSource(samples=samples, seed=seed, shuffle=cfg.shuffle)


def global_indices(*, position: int, batch: int, micro_batch: int, rank: int, world_size: int) -> list[int]:
    """Global sample numbers of rank `rank` in the `batch`-th batch after `position`."""
    return [position + (batch * micro_batch + j) * world_size + rank for j in range(micro_batch)]


def samples_per_step(*, micro_batch: int, world_size: int) -> int:
    return micro_batch * world_size


@dataclass(frozen=True)
class Batch:
    """[micro_batch, seq_len + 1] tokens, kept whole so that one contiguous copy moves them."""

    tokens: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def labels(self) -> torch.Tensor:
        return self.tokens[:, 1:]

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Batch:
        return Batch(tokens=self.tokens.to(device, non_blocking=non_blocking))


def batches(
    source: SampleSource,
    *,
    position: int,
    micro_batch: int,
    rank: int,
    world_size: int,
    pin_memory: bool = False,
) -> Iterator[Batch]:
    """This rank's batches from data position `position` on, forever."""
    batch = 0
    while True:
        idx = global_indices(
            position=position, batch=batch, micro_batch=micro_batch, rank=rank, world_size=world_size
        )
        tokens = torch.stack([source.sample(i) for i in idx])
        if pin_memory:
            tokens = tokens.pin_memory()
        yield Batch(tokens=tokens)
        batch += 1


def build_source(
    cfg: DataConfig, *, seq_len: int, seed: int, vocab_size: int, model_name_or_path: str
) -> SampleSource:
    if cfg.kind == "synthetic":
        return SyntheticSource(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    return load_jsonl_source(
        cfg,
        seq_len=seq_len,
        seed=seed,
        tokenizer_name=cfg.tokenizer or model_name_or_path,
        vocab_size=vocab_size,
    )
