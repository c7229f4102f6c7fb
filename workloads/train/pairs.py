"""Preference data: pairs (workloads/train/pair_records.py reads them) tokenized as TRL's DPOTrainer
tokenizes them and packed, a pair's two sequences in one row.

Tokenized as TRL 1.16 does (so that a run's numbers can be held against TRL's): conversations with
the tokenizer's chat template (the prompt with the generation prompt), texts with the tokenizer,
each answer ending with EOS; the answer starts where the prompt's tokens and the prompt-and-answer's
part (`common_prefix_length`).

Packing: a pair's sequences, prompt + chosen and prompt + rejected, share a row of seq_len positions,
each cut to at most seq_len // 2 positions (at its end, as TRL's `max_length` cuts); a pair whose
prompt alone takes that much is dropped, counted with the seq_len that keeps it. Rows are filled
best-fit decreasing with whole pairs (workloads/train/packing.py); position ids restart at every
sequence, so the loop's varlen attention keeps each sequence to itself. Labels are the answers'
tokens only: a sequence's log-probability is the sum over its answer (workloads/train/preference.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from workloads.train.attention import cumulative_lengths
from workloads.train.data import Batch, Data, data_files, global_indices, row_of
from workloads.train.encode import end_of_turn_id, load_tokenizer
from workloads.train.loss import IGNORE_INDEX
from workloads.train.packing import best_fit_decreasing
from workloads.train.paths import resolve_path
from workloads.train.pair_records import PreferenceRecord, read_pairs
from workloads.train.records import hold_out

SEQ_LEN_STEP = 64
"""A seq_len suggested to keep dropped pairs is rounded up to a multiple of this."""

@dataclass(frozen=True)
class EncodedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def encode_pair(tokenizer, record: PreferenceRecord) -> EncodedPair:
    """The record's prompt and answers as tokens, as TRL 1.16's DPOTrainer makes them."""
    if record.conversational:
        if not tokenizer.chat_template:
            raise ValueError(f"{record.where}: conversations, but the tokenizer has no chat template: set "
                             "data.tokenizer to one that has one (e.g. the model's -Instruct tokenizer)")

        def ids(messages: list[dict], **kwargs) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])

        prompt = ids(record.prompt, add_generation_prompt=True)
        with_chosen, with_rejected = ids(record.prompt + record.chosen), ids(record.prompt + record.rejected)
    else:
        eos = tokenizer.eos_token

        def ended(answer: str) -> str:
            return answer if answer.endswith(eos) else answer + eos

        prompt = list(tokenizer(text=record.prompt)["input_ids"])
        with_chosen = list(tokenizer(text=record.prompt + ended(record.chosen))["input_ids"])
        with_rejected = list(tokenizer(text=record.prompt + ended(record.rejected))["input_ids"])
    # Where a template renders the prompt alone otherwise than before an answer, the answer starts
    # where they part (TRL's rule).
    start = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
    pair = EncodedPair(prompt=prompt[:start], chosen=with_chosen[start:], rejected=with_rejected[start:])
    if not pair.prompt:
        raise ValueError(f"{record.where}: the prompt has no tokens: a pair needs a prompt its answers follow")
    if pair.chosen == pair.rejected:
        raise ValueError(f"{record.where}: 'chosen' and 'rejected' are the same tokens, so the pair prefers nothing")
    if not pair.chosen or not pair.rejected:
        raise ValueError(f"{record.where}: an answer has no tokens after the prompt")
    return pair


@dataclass(frozen=True)
class PairRows:
    input_ids: torch.Tensor
    """[rows, seq_len] int64."""
    labels: torch.Tensor
    """[rows, seq_len] int64: each answer's tokens, IGNORE_INDEX elsewhere."""
    position_ids: torch.Tensor
    """[rows, seq_len] int64, restarting at 0 with each sequence (and with the padding)."""
    sequence: torch.Tensor
    """[rows, seq_len] int64: 2 * (the pair's slot in its row) + (0 chosen, 1 rejected) at each
    label; -1 elsewhere."""
    pair_ids: torch.Tensor
    """[rows, slots] int64: the pair (its number among the data's pairs) in each slot, -1 for none."""
    lengths: torch.Tensor
    """[rows] int64: positions holding sequences (the rest is padding)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True, kw_only=True)
class PairPackingStats:
    pairs: int
    rows: int
    label_tokens: int
    fill: float
    truncated: int
    """Pairs with a sequence longer than seq_len // 2 positions, cut at the end."""
    dropped: int
    """Pairs whose prompt alone takes seq_len // 2 positions (no answer token would be left)."""
    keeps_dropped: int = 0
    """A seq_len that keeps every dropped pair whole (0 when none was dropped)."""
    keeps_truncated: int = 0
    """A seq_len that keeps every truncated pair whole (0 when none was cut)."""
    pairs_per_row: float = 0.0


def _round_up(n: int) -> int:
    return -(-n // SEQ_LEN_STEP) * SEQ_LEN_STEP


def pack_pairs(pairs: list[EncodedPair], ids: list[int], *, seq_len: int, pad_id: int
               ) -> tuple[Optional[PairRows], PairPackingStats]:
    """Pack the pairs (`ids`: each one's number) into rows of seq_len positions; None when every
    pair was dropped."""
    cap = seq_len // 2  # positions per sequence, so that both sequences of a pair share a row
    kept: list[tuple[int, list[tuple[list[int], list[int]]]]] = []
    truncated = dropped = keeps_dropped = keeps_truncated = 0
    for pair_id, pair in zip(ids, pairs, strict=True):
        whole = 2 * (len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) - 1)
        if len(pair.prompt) > cap:
            dropped += 1
            keeps_dropped = max(keeps_dropped, _round_up(whole))
            continue
        sequences = []
        cut = False
        for answer in (pair.chosen, pair.rejected):
            tokens = (pair.prompt + answer)[: cap + 1]
            cut |= len(pair.prompt) + len(answer) > cap + 1
            labels = [IGNORE_INDEX] * (len(pair.prompt) - 1) + tokens[len(pair.prompt):]
            sequences.append((tokens[:-1], labels))
        if cut:
            truncated += 1
            keeps_truncated = max(keeps_truncated, _round_up(whole))
        kept.append((pair_id, sequences))
    stats = dict(pairs=len(kept), truncated=truncated, dropped=dropped, keeps_dropped=keeps_dropped,
                 keeps_truncated=keeps_truncated)
    if not kept:
        return None, PairPackingStats(rows=0, label_tokens=0, fill=0.0, **stats)
    bins = best_fit_decreasing([sum(len(ids_) for ids_, _ in seqs) for _, seqs in kept], capacity=seq_len)
    slots = max(len(b) for b in bins)
    rows_in, rows_lab, rows_pos, rows_seq, rows_pairs, lengths = [], [], [], [], [], []
    for row in bins:
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        sequence: list[int] = []
        for slot, k in enumerate(row):
            pair_id, seqs = kept[k]
            for role, (tokens, labs) in enumerate(seqs):
                inputs += tokens
                labels += labs
                positions += range(len(tokens))
                sequence += [2 * slot + role if lab != IGNORE_INDEX else -1 for lab in labs]
        pad = seq_len - len(inputs)
        lengths.append(len(inputs))
        rows_in.append(inputs + [pad_id] * pad)
        rows_lab.append(labels + [IGNORE_INDEX] * pad)
        rows_pos.append(positions + list(range(pad)))
        rows_seq.append(sequence + [-1] * pad)
        rows_pairs.append([kept[k][0] for k in row] + [-1] * (slots - len(row)))
    rows = PairRows(input_ids=torch.tensor(rows_in), labels=torch.tensor(rows_lab),
                    position_ids=torch.tensor(rows_pos), sequence=torch.tensor(rows_seq),
                    pair_ids=torch.tensor(rows_pairs), lengths=torch.tensor(lengths))
    label_tokens = int((rows.labels != IGNORE_INDEX).sum())
    return rows, PairPackingStats(rows=len(bins), label_tokens=label_tokens,
                                  fill=round(sum(lengths) / (len(bins) * seq_len), 4),
                                  pairs_per_row=round(len(kept) / len(bins), 3), **stats)


@dataclass(frozen=True)
class PairSample:
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    sequence: torch.Tensor
    pair_ids: torch.Tensor
    example_tokens: int


@dataclass(frozen=True, kw_only=True)
class PairSource:
    """Packed pair rows, visited in a seeded order reshuffled every epoch (as PackedSource's)."""

    rows: PairRows
    seed: int
    shuffle: bool = True

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, index: int) -> PairSample:
        offset = row_of(index, rows=len(self.rows), seed=self.seed, shuffle=self.shuffle)
        r = self.rows
        return PairSample(input_ids=r.input_ids[offset], labels=r.labels[offset], position_ids=r.position_ids[offset],
                          sequence=r.sequence[offset], pair_ids=r.pair_ids[offset],
                          example_tokens=int(r.lengths[offset]))


@dataclass(frozen=True)
class PairBatch(Batch):
    """A micro-batch of pair rows: what Batch holds, and where each pair's log-probabilities go."""

    sequence: Optional[torch.Tensor] = None
    """[micro_batch * seq_len] int64: at each label, 2 * (its pair's index in `pair_index`'s table)
    + (0 chosen, 1 rejected); -1 elsewhere."""
    pair_index: Optional[torch.Tensor] = None
    """[P] int64: the table rows (of micro_batch * slots) that hold this micro-batch's P pairs."""
    pair_ids: Optional[torch.Tensor] = None
    """[P] int64: those pairs' numbers (their reference log-probabilities when precomputed)."""
    slots: int = 0
    """Pairs a row can hold (the width of the table)."""
    label_index: Optional[torch.Tensor] = None
    """[labels] int64: the flat positions whose log-probabilities count (`sequence` >= 0)."""

    @staticmethod
    def stack(samples: list[PairSample], *, keep: Optional[list[bool]] = None) -> PairBatch:
        """The samples as one micro-batch; `keep[i]` False leaves sample i's pairs out (a surplus
        evaluation slot: its rows run, nothing of them counts)."""
        keep = keep or [True] * len(samples)
        slots = samples[0].pair_ids.numel()
        sequence, table = [], []
        for row, (sample, kept) in enumerate(zip(samples, keep, strict=True)):
            offset = row * slots
            sequence.append(torch.where(sample.sequence >= 0, sample.sequence + 2 * offset, -1)
                            if kept else torch.full_like(sample.sequence, -1))
            if kept:
                table += [(offset + slot, int(p)) for slot, p in enumerate(sample.pair_ids.tolist()) if p >= 0]
        labels = torch.stack([s.labels if k else torch.full_like(s.labels, IGNORE_INDEX)
                              for s, k in zip(samples, keep, strict=True)])
        position_ids = torch.stack([s.position_ids for s in samples])
        sequence = torch.cat(sequence)
        return PairBatch(
            input_ids=torch.stack([s.input_ids for s in samples]), labels=labels, position_ids=position_ids,
            cu_seqlens=cumulative_lengths(position_ids), example_tokens=sum(s.example_tokens for s in samples),
            sequence=sequence, pair_index=torch.tensor([i for i, _ in table], dtype=torch.int64),
            pair_ids=torch.tensor([p for _, p in table], dtype=torch.int64), slots=slots,
            label_index=torch.nonzero(sequence >= 0).flatten(),
        )

    def _map(self, fn) -> PairBatch:
        return PairBatch(input_ids=fn(self.input_ids), labels=fn(self.labels), position_ids=fn(self.position_ids),
                         cu_seqlens=fn(self.cu_seqlens), example_tokens=self.example_tokens,
                         sequence=fn(self.sequence), pair_index=fn(self.pair_index), pair_ids=fn(self.pair_ids),
                         slots=self.slots, label_index=fn(self.label_index))

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def pairs(self) -> int:
        return self.pair_index.numel()


def pair_batches(source: PairSource, *, position: int, micro_batch: int, rank: int, world_size: int,
                 pin_memory: bool = False) -> Iterator[PairBatch]:
    """This rank's micro-batches from data position `position` on, forever (data.batches' order)."""
    batch = 0
    while True:
        idx = global_indices(position=position, batch=batch, micro_batch=micro_batch, rank=rank,
                             world_size=world_size)
        out = PairBatch.stack([source.sample(i) for i in idx])
        yield out.pin_memory() if pin_memory else out
        batch += 1


def eval_pair_batches(source: PairSource, *, rows: int, micro_batch: int, rank: int, world_size: int,
                      max_rows: int) -> list[PairBatch]:
    """This rank's share of the first min(rows, max_rows) held-out rows, each used once across ranks
    (data.eval_batches' order); surplus slots run a row whose pairs do not count."""
    used = max(1, min(rows, max_rows))
    count = math.ceil(used / (micro_batch * world_size))
    out = []
    for k in range(count):
        indices = global_indices(position=0, batch=k, micro_batch=micro_batch, rank=rank, world_size=world_size)
        out.append(PairBatch.stack([source.sample(g % used) for g in indices], keep=[g < used for g in indices]))
    return out


def all_pair_batches(source: PairSource, *, micro_batch: int, rank: int, world_size: int) -> list[PairBatch]:
    """Every row of the source once, in its stored order, this rank's share (for the reference pass)."""
    unshuffled = dataclasses.replace(source, shuffle=False)
    return eval_pair_batches(unshuffled, rows=len(source), micro_batch=micro_batch, rank=rank, world_size=world_size,
                             max_rows=len(source))


def dropped_note(stats: PairPackingStats, *, seq_len: int) -> list[str]:
    """What the `[data]` line says of the pairs it dropped or cut."""
    notes = []
    if stats.dropped:
        notes.append(f"{stats.dropped} pair(s) dropped: their prompt alone takes more than seq_len // 2 = "
                     f"{seq_len // 2} positions (a row of seq_len holds both sequences of a pair); "
                     f"seq_len={stats.keeps_dropped} keeps them")
    if stats.truncated:
        notes.append(f"{stats.truncated} pair(s) cut to seq_len // 2 = {seq_len // 2} positions per sequence; "
                     f"seq_len={stats.keeps_truncated} keeps them whole")
    return notes


SYNTHETIC_PAIRS = 4096
"""Generated pairs of `data.kind: synthetic` (the held-out ones: an eighth as many more)."""
SYNTHETIC_STRIDES = (1, 2, 3, 5)


def synthetic_pairs(count: int, *, vocab_size: int, seed: int) -> list[EncodedPair]:
    """Token-id pairs a model can learn to prefer, as SyntheticSource's samples are learnable: the
    prompt is an arithmetic progression modulo the vocabulary, the chosen answer continues it, the
    rejected one continues its last token with another stride."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        start, stride = rng.randrange(vocab_size), rng.choice(SYNTHETIC_STRIDES)
        prompt_len, answer_len = rng.randint(4, 12), rng.randint(2, 6)
        tokens = [(start + stride * k) % vocab_size for k in range(prompt_len + answer_len)]
        other = rng.choice([s for s in SYNTHETIC_STRIDES if s != stride])
        rejected = [(tokens[prompt_len - 1] + other * (k + 1)) % vocab_size for k in range(answer_len)]
        pairs.append(EncodedPair(prompt=tokens[:prompt_len], chosen=tokens[prompt_len:], rejected=rejected))
    return pairs


def synthetic_pair_data(*, seq_len: int, seed: int, vocab_size: int, eval_fraction: float, shuffle: bool) -> Data:
    """`data.kind: synthetic` under objective "dpo": generated token-id pairs (no tokenizer)."""
    held = round(SYNTHETIC_PAIRS * eval_fraction)
    pairs = synthetic_pairs(SYNTHETIC_PAIRS + held, vocab_size=vocab_size, seed=seed)
    ids = list(range(len(pairs)))
    rows, stats = pack_pairs(pairs[:SYNTHETIC_PAIRS], ids[:SYNTHETIC_PAIRS], seq_len=seq_len, pad_id=0)
    if rows is None:
        raise ValueError(f"seq_len {seq_len} is too short for the synthetic pairs: use at least 32")
    eval_source, eval_rows = None, 0
    if held:
        eval_rows_packed, _ = pack_pairs(pairs[SYNTHETIC_PAIRS:], ids[SYNTHETIC_PAIRS:], seq_len=seq_len, pad_id=0)
        if eval_rows_packed is not None:
            eval_source, eval_rows = PairSource(rows=eval_rows_packed, seed=seed, shuffle=False), len(eval_rows_packed)
    return Data(train=PairSource(rows=rows, seed=seed, shuffle=shuffle), eval=eval_source, eval_rows=eval_rows,
                tokenizer=None, end_of_turn=None,
                stats={"kind": "synthetic", "objective": "dpo", "held_out": held, "seq_len": seq_len,
                       **dataclasses.asdict(stats)})


def load_pair_data(cfg, *, seq_len: int, seed: int, vocab_size: int, tokenizer_name: str, cache_dir: str = "") -> Data:
    """The training pairs and the held-out ones (`cfg`: the DataConfig), packed; ValueError, naming
    the record, for a bad one, and when every pair was dropped."""
    tokenizer = load_tokenizer(resolve_path(tokenizer_name, field="data.tokenizer", hub_id_allowed=True))
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_name!r} has {len(tokenizer)} tokens but the model's vocabulary has "
                         f"{vocab_size}: use the model's own tokenizer")
    records = read_pairs(data_files(cfg, cache_dir=cache_dir), limit=cfg.max_examples)
    encoded = [encode_pair(tokenizer, record) for record in records]
    held = hold_out(len(records), fraction=cfg.eval_fraction, seed=seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    train_ids = [i for i in range(len(records)) if i not in held]
    train_rows, train_stats = pack_pairs([encoded[i] for i in train_ids], train_ids, seq_len=seq_len, pad_id=pad_id)
    if train_rows is None:
        raise ValueError(f"every training pair was dropped: {' '.join(dropped_note(train_stats, seq_len=seq_len))}")
    stats = {"records": len(records), "held_out": len(held), "seq_len": seq_len, "objective": "dpo",
             **dataclasses.asdict(train_stats)}
    notes = dropped_note(train_stats, seq_len=seq_len)
    if notes:
        stats["pairs_note"] = "; ".join(notes)
    eval_source, eval_rows = None, 0
    if held:
        rows, eval_stats = pack_pairs([encoded[i] for i in sorted(held)], sorted(held), seq_len=seq_len, pad_id=pad_id)
        if rows is not None:
            eval_source, eval_rows = PairSource(rows=rows, seed=seed, shuffle=False), len(rows)
        stats["eval_rows"], stats["eval_pairs"] = eval_stats.rows, eval_stats.pairs
    chats = any(r.conversational for r in records)
    return Data(train=PairSource(rows=train_rows, seed=seed, shuffle=cfg.shuffle), eval=eval_source,
                eval_rows=eval_rows, tokenizer=tokenizer, end_of_turn=end_of_turn_id(tokenizer) if chats else None,
                stats=stats)
