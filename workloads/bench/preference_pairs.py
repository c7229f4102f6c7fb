"""Generated preference pairs for the DPO benchmark: the shape of the pairs users train on, with
nothing downloaded.

A pair is a conversation's context up to a user turn (its earlier turns, drawn as the benchmark's
chats are: workloads/bench/chats.py) and two answers to that turn, each of a length drawn as the
chats' answers are, so the two sequences of a pair share their prompt and differ in length, as
UltraFeedback's do. Records are in TRL's conversational shape ({"prompt", "chosen", "rejected"}),
every word one token of the toy tokenizer, so lengths are exact in tokens.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from workloads.bench.chats import ANSWER_TOKENS, MESSAGE_OVERHEAD, _length, _text, turn_lengths
from workloads.model_io.toy import toy_tokenizer, write_chat_jsonl


def generate_pairs(count: int, *, seed: int) -> list[dict]:
    """`count` preference records: the context of one of the chats' shape, the last user turn's two answers."""
    rng = random.Random(seed + 2)
    records = []
    for conv in turn_lengths(count, seed=seed):
        prompt = []
        for i, (question, answer) in enumerate(conv):
            prompt.append({"role": "user", "content": _text(rng, question)})
            if i < len(conv) - 1:
                prompt.append({"role": "assistant", "content": _text(rng, answer)})
        chosen, rejected = (_text(rng, _length(rng, ANSWER_TOKENS)) for _ in range(2))
        records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
    return records


def describe_pairs(records: list[dict]) -> dict:
    """The generated set's shape: pairs, mean tokens of a sequence (prompt and answer, template
    included), of a prompt, and of a pair's two sequences."""
    def tokens(messages: list[dict]) -> int:
        return sum(len(m["content"].split(" ")) - 1 + MESSAGE_OVERHEAD for m in messages)

    prompts = [tokens(r["prompt"]) + 3 for r in records]  # + the generation prompt's header
    sequences = [p + tokens(r[k]) - 3 for p, r in zip(prompts, records) for k in ("chosen", "rejected")]
    return {"pairs": len(records), "mean_prompt_tokens": round(statistics.fmean(prompts), 1),
            "mean_sequence_tokens": round(statistics.fmean(sequences), 1),
            "mean_pair_tokens": round(2 * statistics.fmean(sequences), 1)}


def write_pair_data(folder: Path, *, count: int, seed: int) -> tuple[Path, Path]:
    """The pairs as a JSONL file and the toy tokenizer as a folder: (jsonl, tokenizer folder)."""
    tokenizer_dir = folder / "tokenizer"
    toy_tokenizer().save_pretrained(tokenizer_dir)
    return write_chat_jsonl(folder / "pairs.jsonl", generate_pairs(count, seed=seed)), tokenizer_dir
