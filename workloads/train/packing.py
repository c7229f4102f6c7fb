"""Examples packed into rows of exactly seq_len positions, without attention across them.

Each example becomes seq_len-or-fewer positions (inputs: its tokens but the last; labels: the next
token where it is a target, else -100; position ids 0, 1, 2, ... restarting with each example).
A long text document is cut into windows of seq_len positions that overlap by one token, so each
of its tokens is a label once; a long conversation keeps its first seq_len positions (the rest of
it would lack its prompt).

Rows are filled best-fit decreasing: longest example first, each into the row it fills most
tightly (a new row when none has room). Chats of about a thousand tokens in rows of 2,048 leave
little padding that way, where filling rows in arrival order leaves a large share (figures for
the benchmark's generated chats: docs/PERFORMANCE.md). The rest of a row is padding (label -100,
its own run of position ids).

Attention stays inside an example: the loop's `varlen` attention (workloads/train/attention.py)
takes the examples' boundaries from the batch (where position ids restart); transformers' own
backends build a block-diagonal mask from the restarting position ids (sdpa and eager: a dense
boolean mask; flex_attention: a BlockMask), and flash_attention_2 runs its varlen kernel on the same
boundaries the batch passes (`cu_seq_lens_q/k`), at any micro-batch. tests/test_data_chat.py checks
it (changing one example's tokens leaves the other examples' logits unchanged), and the loop checks
it again on the cluster before the first step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from workloads.train.encode import Example
from workloads.train.loss import IGNORE_INDEX


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor
    """[rows, seq_len] int64."""
    labels: torch.Tensor
    """[rows, seq_len] int64, IGNORE_INDEX where nothing is learned."""
    position_ids: torch.Tensor
    """[rows, seq_len] int64, restarting at 0 with each example (and with the padding)."""
    lengths: torch.Tensor
    """[rows] int64: positions holding examples (the rest is padding)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True, kw_only=True)
class PackingStats:
    examples: int
    """Examples packed (windows of long texts counted separately)."""
    rows: int
    label_tokens: int
    """Positions with a label: what the loss is computed over."""
    fill: float
    """Share of positions holding an example rather than padding."""
    truncated: int
    """Conversations longer than seq_len + 1 tokens, cut to their first seq_len + 1."""
    dropped: int
    """Examples without any label left (too short, or truncated before any assistant token)."""
    longest_cut: int = 0
    """Positions the longest truncated conversation needs whole (its tokens but one): a seq_len of
    at least this keeps every conversation; 0 when none was cut."""


def fit_to_length(example: Example, *, seq_len: int, split: bool) -> list[Example]:
    """The example as pieces of at most seq_len + 1 tokens: windows overlapping by one token when
    `split`, else only the first."""
    n = len(example.tokens)
    if n <= seq_len + 1:
        return [example]
    if not split:
        return [Example(tokens=example.tokens[: seq_len + 1], targets=example.targets[: seq_len + 1])]
    return [Example(tokens=example.tokens[s : s + seq_len + 1], targets=example.targets[s : s + seq_len + 1])
            for s in range(0, n - 1, seq_len)]


def best_fit_decreasing(lengths: list[int], *, capacity: int) -> list[list[int]]:
    """Indices of the items in each bin: longest first, each into the bin with the least room
    that still takes it (ties: the earlier item, the earlier bin)."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            bins.append([i])
            left, b = capacity - lengths[i], len(bins) - 1
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, b))
    return bins


def pack(
    examples: list[Example], *, seq_len: int, pad_id: int, split_long: list[bool]
) -> tuple[PackedRows, PackingStats]:
    """Pack `examples` (split_long[i]: cut example i into windows rather than truncate it)."""
    pieces: list[tuple[list[int], list[int]]] = []  # (input tokens, labels)
    truncated = dropped = longest_cut = 0
    for example, split in zip(examples, split_long, strict=True):
        if not split and len(example.tokens) > seq_len + 1:
            truncated += 1
            longest_cut = max(longest_cut, len(example.tokens) - 1)
        for piece in fit_to_length(example, seq_len=seq_len, split=split):
            labels = [t if target else IGNORE_INDEX
                      for t, target in zip(piece.tokens[1:], piece.targets[1:], strict=True)]
            if all(label == IGNORE_INDEX for label in labels):
                dropped += 1
                continue
            pieces.append((piece.tokens[:-1], labels))
    if not pieces:
        raise ValueError(f"no example has a token to learn ({dropped} dropped): check the data")
    rows_in, rows_lab, rows_pos, lengths = [], [], [], []
    for row in best_fit_decreasing([len(tokens) for tokens, _ in pieces], capacity=seq_len):
        ids: list[int] = []
        lab: list[int] = []
        pos: list[int] = []
        for i in row:
            tokens, labels = pieces[i]
            ids += tokens
            lab += labels
            pos += range(len(tokens))
        pad = seq_len - len(ids)
        lengths.append(len(ids))
        rows_in.append(ids + [pad_id] * pad)
        rows_lab.append(lab + [IGNORE_INDEX] * pad)
        rows_pos.append(pos + list(range(pad)))
    rows = PackedRows(
        input_ids=torch.tensor(rows_in, dtype=torch.int64),
        labels=torch.tensor(rows_lab, dtype=torch.int64),
        position_ids=torch.tensor(rows_pos, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )
    label_tokens = sum(label != IGNORE_INDEX for _, labels in pieces for label in labels)
    stats = PackingStats(examples=len(pieces), rows=len(rows_in), label_tokens=label_tokens,
                         fill=round(sum(lengths) / (len(rows_in) * seq_len), 4), truncated=truncated, dropped=dropped,
                         longest_cut=longest_cut)
    return rows, stats
