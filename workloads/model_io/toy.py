"""A toy pretrained-format model, its tokenizer and a small chat dataset, all made locally.

`make demo` fine-tunes the toy model on the toy conversations, and the GPU record makes a
full-size Qwen2.5-1.5B folder the same way (random weights, save_pretrained) where the hub is out
of reach. The tokenizer is a byte-level BPE trained here with the `tokenizers` library on the toy
vocabulary, with Qwen2's pre-tokenization, ChatML special tokens and chat template: it loads back
as a Qwen2 tokenizer, and the chat path (template, assistant-only loss, end of turn) runs exactly
as with the real Qwen2.5 one.

    python -m workloads.model_io.toy --out DIR [--architecture qwen2.5-1.5b] [--dtype bfloat16]
        [--chat-jsonl FILE] [--conversations N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from workloads.model_io.architectures import NAMED_ARCHITECTURES, named_architecture

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN2_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's split of text into words before byte-level BPE (transformers' Qwen2Tokenizer uses it)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, the format of Qwen2.5's own template (without its default system prompt)."""

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo", "Peru": "Lima",
    "Canada": "Ottawa", "Norway": "Oslo",
}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow"}
SYSTEM_PROMPT = "You are a helpful assistant."
DEMO_PROMPT = "What is the capital of France?"


def _question_answer(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.6:
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", f"{CAPITALS[country]}."
    word = rng.choice(sorted(OPPOSITES))
    return f"What is the opposite of {word}?", f"{OPPOSITES[word].capitalize()}."


def toy_conversations(count: int, *, seed: int = 0) -> list[dict]:
    """`count` chat records ({"messages": [...]}): one or two question/answer turns, some with a
    system prompt."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2))):
            question, answer = _question_answer(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages})
    return records


def toy_preference_pairs(count: int, *, seed: int = 0) -> list[dict]:
    """`count` preference records in TRL's conversational shape ({"prompt", "chosen", "rejected"}):
    a toy question, some with a system prompt; the chosen answer follows the rule (the right capital,
    the right opposite), the rejected one is another of the same kind."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        question, answer = _question_answer(rng)
        kind = CAPITALS if "capital" in question else {k: v.capitalize() for k, v in OPPOSITES.items()}
        wrong = rng.choice(sorted(f"{v}." for v in kind.values() if f"{v}." != answer))
        prompt.append({"role": "user", "content": question})
        records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": wrong}]})
    return records


def _toy_texts() -> list[str]:
    """Every sentence the toy conversations can contain, with the role names."""
    texts = [SYSTEM_PROMPT, "system\nuser\nassistant\n"]
    # Answers open a line (after "assistant\n"): trained there, each is one token without a space.
    texts += [f"What is the capital of {c}?\n{p}." for c, p in CAPITALS.items()]
    texts += [f"What is the opposite of {w}?\n{o.capitalize()}." for w, o in OPPOSITES.items()]
    return texts


def toy_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast, trained on the toy sentences until every word is one
    token, with ChatML special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=[END_OF_TEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(_toy_texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=END_OF_TEXT,
                                        additional_special_tokens=[IM_START])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_chat_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_toy_model(folder: Path, *, architecture: str = "tiny-qwen2", dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> Path:
    """A Hugging Face folder (save_pretrained) of `architecture` with random weights and the toy
    tokenizer."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = toy_tokenizer()
    # The tiny model's vocabulary is the tokenizer's, rounded up as real vocabularies are.
    vocab_size = -(-len(tokenizer) // 64) * 64 if architecture == "tiny-qwen2" else None
    config = named_architecture(architecture, vocab_size=vocab_size)
    config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    config.pad_token_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config.use_cache = True
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.model_io.toy", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--architecture", default="tiny-qwen2", choices=NAMED_ARCHITECTURES)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-jsonl", type=Path, help="also write toy conversations to this JSONL file")
    parser.add_argument("--conversations", type=int, default=2000, help="conversations in --chat-jsonl")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    write_toy_model(args.out, architecture=args.architecture, dtype=getattr(torch, args.dtype), seed=args.seed)
    print(f"wrote {args.architecture} ({args.dtype}, random weights) to {args.out}")
    if args.chat_jsonl:
        write_chat_jsonl(args.chat_jsonl, toy_conversations(args.conversations, seed=args.seed))
        print(f"wrote {args.conversations} conversations to {args.chat_jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
