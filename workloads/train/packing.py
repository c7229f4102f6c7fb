"""Examples packed into rows of exactly seq_len positions, without attention across them.

Each example becomes seq_len-or-fewer positions (inputs: its tokens but the last; labels: the next
token where it is a target, else -100; position ids 0, 1, 2, ... restarting with each example).
Examples fill a row in order until the next one does not fit; the rest of the row is padding
(label -100, its own run of position ids). A long text document is cut into windows of seq_len
positions that overlap by one token, so each of its tokens is a label once; a long conversation
keeps its first seq_len positions (the rest of it would lack its prompt).

Attention stays inside an example because the position ids restart: transformers turns position
ids that restart within a row into a block-diagonal causal mask (sdpa and eager: an explicit
boolean mask; flex_attention: a BlockMask; flash_attention_2: variable-length kernels over the
segments). tests/test_data_chat.py checks it (changing one example's tokens leaves the other
examples' logits unchanged), and the loop checks it again on the cluster before the first step.
"""

from __future__ import annotations

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


def pack(
    examples: list[Example], *, seq_len: int, pad_id: int, split_long: list[bool]
) -> tuple[PackedRows, PackingStats]:
    """Pack `examples` (split_long[i]: cut example i into windows rather than truncate it)."""
    rows_in, rows_lab, rows_pos = [], [], []
    cur_in: list[int] = []
    cur_lab: list[int] = []
    cur_pos: list[int] = []
    packed = truncated = dropped = label_tokens = used = 0

    def close_row() -> None:
        nonlocal cur_in, cur_lab, cur_pos
        pad = seq_len - len(cur_in)
        rows_in.append(cur_in + [pad_id] * pad)
        rows_lab.append(cur_lab + [IGNORE_INDEX] * pad)
        rows_pos.append(cur_pos + list(range(pad)))
        cur_in, cur_lab, cur_pos = [], [], []

    for example, split in zip(examples, split_long, strict=True):
        pieces = fit_to_length(example, seq_len=seq_len, split=split)
        truncated += int(not split and len(example.tokens) > seq_len + 1)
        for piece in pieces:
            labels = [t if target else IGNORE_INDEX
                      for t, target in zip(piece.tokens[1:], piece.targets[1:], strict=True)]
            n_labels = sum(label != IGNORE_INDEX for label in labels)
            if n_labels == 0:
                dropped += 1
                continue
            length = len(piece.tokens) - 1
            if len(cur_in) + length > seq_len:
                close_row()
            cur_in += piece.tokens[:-1]
            cur_lab += labels
            cur_pos += list(range(length))
            packed += 1
            label_tokens += n_labels
            used += length
    if cur_in:
        close_row()
    if not rows_in:
        raise ValueError(f"no example has a token to learn ({dropped} dropped): check the data")
    rows = PackedRows(
        input_ids=torch.tensor(rows_in, dtype=torch.int64),
        labels=torch.tensor(rows_lab, dtype=torch.int64),
        position_ids=torch.tensor(rows_pos, dtype=torch.int64),
    )
    stats = PackingStats(examples=packed, rows=len(rows_in), label_tokens=label_tokens,
                         fill=round(used / (len(rows_in) * seq_len), 4), truncated=truncated, dropped=dropped)
    return rows, stats
