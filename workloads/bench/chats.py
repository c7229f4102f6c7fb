"""Generated chats for the benchmark: the shape of the job users run, with nothing downloaded.

The default presets fine-tune on multi-turn chats (ultrachat_200k), trained on the assistant
tokens only and packed into rows. What the loop's speed depends on is that shape: how many tokens
a conversation has, how they split between prompts and answers, and so how rows pack and how many
positions carry a label. The generator draws it from a chosen distribution, not one fitted to the
dataset (which cannot be fetched here): 1 to 6 user/assistant turns (3 on average), prompts of
about 60 tokens and answers of about 240 (log-normal, long-tailed), so a conversation has about
950 tokens, ~75% of them in answers, and a few exceed a 2,048-token row (they are truncated, as the
loop truncates real ones). `describe` reports the figures of a generated set.

Every message's text is made of words that the toy tokenizer (workloads/model_io/toy.py) encodes
as one token each, so lengths are exact in tokens.
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

from workloads.model_io.toy import toy_tokenizer, write_chat_jsonl

TURN_WEIGHTS = {1: 20, 2: 25, 3: 22, 4: 15, 5: 10, 6: 8}
"""User/assistant turns per conversation, by relative frequency."""
PROMPT_TOKENS = (45, 0.8, 3, 600)
"""Prompt length in tokens: median, log-normal sigma, least, most."""
ANSWER_TOKENS = (200, 0.6, 5, 1200)
"""Answer length in tokens: median, log-normal sigma, least, most."""
MESSAGE_OVERHEAD = 5
"""Tokens ChatML adds around each message: <|im_start|>, the role, a newline, <|im_end|>, a newline."""

_WORDS = [" is", " the", " capital", " of", " opposite", " France", " Japan", " Italy", " Spain", " Norway"]
"""Each one token of the toy tokenizer, space included (so a message's text starts with a space)."""


def _length(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    median, sigma, least, most = spec
    return max(least, min(most, round(rng.lognormvariate(math.log(median), sigma))))


def turn_lengths(count: int, *, seed: int) -> list[list[tuple[int, int]]]:
    """Per conversation, the (prompt, answer) token counts of each turn."""
    rng = random.Random(seed)
    turns, weights = zip(*TURN_WEIGHTS.items())
    return [[(_length(rng, PROMPT_TOKENS), _length(rng, ANSWER_TOKENS))
             for _ in range(rng.choices(turns, weights)[0])] for _ in range(count)]


def conversation_lengths(count: int, *, seed: int) -> list[int]:
    """Tokens of each generated conversation, template included (what packing sees, before any
    truncation to a row)."""
    return [sum(p + a + 2 * MESSAGE_OVERHEAD for p, a in conv) for conv in turn_lengths(count, seed=seed)]


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(_WORDS) for _ in range(tokens))


def generate_chats(count: int, *, seed: int) -> list[dict]:
    """`count` chat records ({"messages": [...]}) of the lengths `turn_lengths` draws."""
    rng = random.Random(seed + 1)
    records = []
    for conv in turn_lengths(count, seed=seed):
        messages = []
        for prompt, answer in conv:
            messages += [{"role": "user", "content": _text(rng, prompt)},
                         {"role": "assistant", "content": _text(rng, answer)}]
        records.append({"messages": messages})
    return records


def describe(count: int, *, seed: int, seq_len: int) -> dict:
    """The generated set's shape: conversations, mean tokens, answer share, turns, truncated share."""
    convs = turn_lengths(count, seed=seed)
    lengths = conversation_lengths(count, seed=seed)
    answers = sum(a for conv in convs for _, a in conv)
    return {
        "conversations": count,
        "mean_tokens": round(statistics.fmean(lengths), 1),
        "median_tokens": statistics.median(lengths),
        "answer_share": round(answers / sum(lengths), 3),
        "mean_turns": round(statistics.fmean(len(c) for c in convs), 2),
        "longer_than_row": round(sum(n > seq_len + 1 for n in lengths) / count, 4),
    }


def write_chat_data(folder: Path, *, count: int, seed: int) -> tuple[Path, Path]:
    """The chats as a JSONL file and the toy tokenizer as a folder: (jsonl, tokenizer folder)."""
    tokenizer_dir = folder / "tokenizer"
    toy_tokenizer().save_pretrained(tokenizer_dir)
    return write_chat_jsonl(folder / "chats.jsonl", generate_chats(count, seed=seed)), tokenizer_dir
