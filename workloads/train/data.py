"""Training data: a learnable synthetic stream, or records (text or chats) packed to seq_len.

Both are indexed by a global sample number g = 0, 1, 2, ...: the k-th batch after position p
(samples consumed so far by all ranks together) on rank r of w takes samples
g = p + (k * micro_batch + j) * w + r for j < micro_batch. So ranks read disjoint samples,
together they read every sample of an epoch before any repeats, and the data position saved in
a checkpoint is that one number p, still valid if the job resumes on another number of ranks.

A sample is seq_len input tokens and seq_len labels (the next token, or -100 where nothing is
learned); packed samples also carry position ids that restart with each example they hold
(workloads/train/packing.py says how attention is kept inside an example).

Records come from a JSONL file (local or s3://) or a hub dataset's split, fetched once per node
(workloads/model_io/sources.py). A share of them (`data.eval_fraction`) is held out for the eval
loss, chosen by the seed before anything is packed, so no example is in both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Protocol

import torch

from workloads.train.attention import cumulative_lengths
from workloads.model_io.sources import fetch_data_file, fetch_hub_dataset
from workloads.train.config import DataConfig
from workloads.train.encode import encode_records, end_of_turn_id, load_tokenizer
from workloads.train.loss import IGNORE_INDEX
from workloads.train.packing import PackedRows, pack
from workloads.train.paths import resolve_path
from workloads.train.records import hold_out, read_records  # noqa: F401  (hold_out: this module's too)

EVAL_STREAM = 7_919
"""Offset of the seed of the synthetic held-out stream: samples drawn apart from the training ones."""


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    """None: one sequence from position 0 (plain causal attention)."""
    example_tokens: Optional[int] = None
    """Positions holding an example rather than padding; None: every position."""


class SampleSource(Protocol):
    def sample(self, index: int) -> Sample:
        """Sample `index` (any int >= 0; sources without an end wrap around)."""


@dataclass(frozen=True, kw_only=True)
class SyntheticSource:
    """Arithmetic progressions modulo the vocabulary: token t+1 = token t + stride, with a random
    start and a stride from a small set per sample. A model learns the transition rule and then
    infers each sample's stride from its context, so the loss falls far below log(vocab)."""

    vocab_size: int
    seq_len: int
    seed: int
    strides: tuple[int, ...] = (1, 2, 3, 5)

    def sample(self, index: int) -> Sample:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = self.strides[int(torch.randint(len(self.strides), (1,), generator=gen))]
        tokens = (start + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab_size
        return Sample(input_ids=tokens[:-1], labels=tokens[1:])


@dataclass(frozen=True, kw_only=True)
class PackedSource:
    """Packed rows, visited in a seeded order that is reshuffled every epoch."""

    rows: PackedRows
    seed: int
    shuffle: bool = True

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, index: int) -> Sample:
        offset = row_of(index, rows=len(self.rows), seed=self.seed, shuffle=self.shuffle)
        return Sample(input_ids=self.rows.input_ids[offset], labels=self.rows.labels[offset],
                      position_ids=self.rows.position_ids[offset], example_tokens=int(self.rows.lengths[offset]))


def row_of(index: int, *, rows: int, seed: int, shuffle: bool) -> int:
    """The row that global sample number `index` reads: the rows in order, or in a seeded order
    reshuffled every epoch (a pass over the rows), the same on every rank and after a resume."""
    epoch, offset = divmod(index, rows)
    if not shuffle:
        return offset
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return int(order[offset])


def global_indices(*, position: int, batch: int, micro_batch: int, rank: int, world_size: int) -> list[int]:
    """Global sample numbers of rank `rank` in the `batch`-th batch after `position`."""
    return [position + (batch * micro_batch + j) * world_size + rank for j in range(micro_batch)]


def samples_per_step(*, micro_batch: int, world_size: int) -> int:
    return micro_batch * world_size


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    """[micro_batch, seq_len]."""
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    """Packed rows: int32 [N + 1], where each of the N sequences (samples, padding) of the
    flattened rows starts, then the total; computed here on the host, so the step never waits for
    the device to find them (workloads/train/attention.py)."""
    example_tokens: Optional[int] = None
    """Positions holding an example, not padding: what throughput counts; None: every position."""

    @staticmethod
    def stack(samples: list[Sample]) -> Batch:
        packed = samples[0].position_ids is not None
        position_ids = torch.stack([s.position_ids for s in samples]) if packed else None
        return Batch(
            input_ids=torch.stack([s.input_ids for s in samples]),
            labels=torch.stack([s.labels for s in samples]),
            position_ids=position_ids,
            cu_seqlens=None if position_ids is None else cumulative_lengths(position_ids),
            example_tokens=sum(len(s.input_ids) if s.example_tokens is None else s.example_tokens for s in samples),
        )

    def _map(self, fn) -> Batch:
        keep = lambda t: None if t is None else fn(t)  # noqa: E731
        return Batch(input_ids=fn(self.input_ids), labels=fn(self.labels), position_ids=keep(self.position_ids),
                     cu_seqlens=keep(self.cu_seqlens), example_tokens=self.example_tokens)

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def attention(self) -> dict:
        """The model's keyword arguments that keep packed samples apart (none for unpacked rows).
        The longest sequence is bounded by the row length: a static bound, so neither a host sync
        nor a recompilation per batch."""
        if self.cu_seqlens is None:
            return {}
        longest = self.input_ids.shape[-1]
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": longest, "max_length_k": longest}


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
        out = Batch.stack([source.sample(i) for i in idx])
        yield out.pin_memory() if pin_memory else out
        batch += 1


def eval_batches(source: SampleSource, *, rows: int, micro_batch: int, rank: int, world_size: int,
                 max_rows: int) -> list[Batch]:
    """This rank's share of the first min(rows, max_rows) held-out samples, each used once across
    ranks, so one evaluation scores the same samples at every world size. Every rank gets the same
    number of micro-batches (each one is a collective under FSDP), the surplus slots holding a
    sample with all labels ignored."""
    used = max(1, min(rows, max_rows))
    count = math.ceil(used / (micro_batch * world_size))
    out = []
    for k in range(count):
        samples = []
        for g in global_indices(position=0, batch=k, micro_batch=micro_batch, rank=rank, world_size=world_size):
            sample = source.sample(g % used)
            if g >= used:
                sample = dataclasses.replace(sample, labels=torch.full_like(sample.labels, IGNORE_INDEX))
            samples.append(sample)
        out.append(Batch.stack(samples))
    return out


@dataclass(frozen=True, kw_only=True)
class Data:
    train: SampleSource
    eval: Optional[SampleSource]
    eval_rows: int
    """Samples in the held-out set (for a synthetic stream: as many as one evaluation uses)."""
    tokenizer: Optional[object]
    """The tokenizer the records were encoded with (None for synthetic tokens)."""
    end_of_turn: Optional[int]
    """The chat template's end-of-turn token when chats were trained on (generation stops there)."""
    stats: dict
    """Records, examples, rows, label tokens, fill... for the `[data]` line."""


def data_files(cfg: DataConfig, *, cache_dir: str) -> list[Path]:
    if cfg.kind == "hub":
        return fetch_hub_dataset(cfg.path, split=cfg.split, revision=cfg.revision, cache_dir=cache_dir)
    return [fetch_data_file(cfg.path, cache_dir=cache_dir)]


def load_records_data(cfg: DataConfig, *, seq_len: int, seed: int, vocab_size: int, tokenizer_name: str,
                      cache_dir: str = "") -> Data:
    tokenizer = load_tokenizer(resolve_path(tokenizer_name, field="data.tokenizer", hub_id_allowed=True))
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_name!r} has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{vocab_size}: use the model's own tokenizer"
        )
    records = read_records(data_files(cfg, cache_dir=cache_dir), text_field=cfg.text_field,
                           messages_field=cfg.messages_field, limit=cfg.max_examples, data_format=cfg.format)
    examples = encode_records(tokenizer, records)
    held = hold_out(len(records), fraction=cfg.eval_fraction, seed=seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0

    def packed(indices: list[int]):
        return pack([examples[i] for i in indices], seq_len=seq_len, pad_id=pad_id,
                    split_long=[records[i].is_document for i in indices])

    train_rows, train_stats = packed([i for i in range(len(records)) if i not in held])
    stats = {"records": len(records), "chats": sum(r.is_chat for r in records), "held_out": len(held),
             "seq_len": seq_len, **asdict(train_stats)}
    eval_source, eval_rows = None, 0
    if held:
        rows, eval_stats = packed(sorted(held))
        eval_source, eval_rows = PackedSource(rows=rows, seed=seed, shuffle=False), len(rows)
        stats["eval_rows"] = eval_stats.rows
    chats = any(r.is_chat for r in records)
    return Data(train=PackedSource(rows=train_rows, seed=seed, shuffle=cfg.shuffle), eval=eval_source,
                eval_rows=eval_rows, tokenizer=tokenizer, end_of_turn=end_of_turn_id(tokenizer) if chats else None,
                stats=stats)


def build_data(cfg: DataConfig, *, seq_len: int, seed: int, vocab_size: int, model_name_or_path: str,
               eval_rows: int = 0, cache_dir: str = "") -> Data:
    """The training source and the held-out one. `eval_rows`: samples a synthetic evaluation takes."""
    if cfg.kind == "synthetic":
        return Data(
            train=SyntheticSource(vocab_size=vocab_size, seq_len=seq_len, seed=seed),
            eval=(SyntheticSource(vocab_size=vocab_size, seq_len=seq_len, seed=seed + EVAL_STREAM)
                  if eval_rows else None),
            eval_rows=eval_rows, tokenizer=None, end_of_turn=None, stats={"kind": "synthetic"},
        )
    return load_records_data(cfg, seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                             tokenizer_name=cfg.tokenizer or model_name_or_path, cache_dir=cache_dir)


def reading_of_data(stats: dict, *, steps: int, rows_per_step: int) -> dict:
    """How the run's steps read its training rows: the rows per step and, for records, the passes
    over them, with a note when that is more than one (the `[data]` line carries both)."""
    reading: dict = {"rows_per_step": rows_per_step}
    rows = stats.get("rows")
    if not rows:  # synthetic tokens: an endless stream
        return reading
    passes = steps * rows_per_step / rows
    reading["passes"] = round(passes, 2)
    if passes > 1:
        one_pass = max(1, rows // rows_per_step)
        reading["note"] = (f"{steps} steps of {rows_per_step} rows read the {rows:,} training rows {passes:.2f} "
                           f"times: each row is trained on that often; {one_pass} steps make one pass "
                           "(--set steps=...), or give more data (data.max_examples)")
    return reading
