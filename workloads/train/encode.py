"""Records into token sequences, each token marked as a training target or not.

Plain text: every token is a target and the document ends with the tokenizer's EOS. A text with a
prompt (TRL's prompt-completion): prompt and completion tokenized together, as TRL does, and only the
completion's tokens and the EOS after it are targets.
Chat: the conversation is rendered with the tokenizer's own chat template and tokenized once; the
targets are the tokens the assistant turns add (their content and end-of-turn token), found as
character spans: each assistant turn's span runs from the end of the conversation so far rendered
with the generation prompt to the end of the conversation rendered through that turn. A turn that
opens the conversation has no conversation before it to render: its span starts where its content
does, found where the rendering through it parts from the same rendering with other content, so
the template's default system prompt (Qwen2.5's) and the turn's header are context too. Prompts,
system and user turns, and the template's markup are context only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from workloads.train.records import Record


@dataclass(frozen=True)
class Example:
    tokens: list[int]
    targets: list[bool]
    """targets[i]: token i is a label (predicted from tokens[:i]); targets[0] is never used."""


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load a tokenizer from {name_or_path!r}: {reason}") from None


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _before_first_turn(tokenizer, message: dict, *, through: str) -> str:
    """What the rendering `through` a conversation's first message holds before that message's
    content: the rendering parts from the same one with other content where the content starts."""
    other = "\ue000" if not message["content"].startswith("\ue000") else "\ue001"  # private-use characters
    probe = _render(tokenizer, [{**message, "content": other}], generation_prompt=False)
    return through[: len(os.path.commonprefix([through, probe]))]


def assistant_spans(tokenizer, messages: list[dict], *, where: str,
                    learned_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span each assistant turn from message
    `learned_from` on adds to it."""
    text = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < learned_from:
            continue
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        before = (_render(tokenizer, messages[:i], generation_prompt=True) if i
                  else _before_first_turn(tokenizer, message, through=through))
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"{where}: the tokenizer's chat template does not render this conversation's prefixes as "
                "prefixes of the whole, so its assistant tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_chat(tokenizer, record: Record) -> Example:
    if not tokenizer.chat_template:
        raise ValueError(
            f"{record.where}: a chat record, but the tokenizer has no chat template: set data.tokenizer to one "
            "that has one (e.g. the model's -Instruct tokenizer)"
        )
    text, spans = assistant_spans(tokenizer, record.messages, where=record.where, learned_from=record.learned_from)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    targets = [any(s <= start < e for s, e in spans) for start, _ in encoded["offset_mapping"]]
    return Example(tokens=list(encoded["input_ids"]), targets=targets)


def encode_prompted(tokenizer, record: Record, *, eos_id: int) -> Example:
    """A completion after its prompt: the tokens of both (one tokenization, as TRL's), the
    completion's and the EOS after it the targets."""
    assert record.prompt is not None and record.text is not None
    encoded = tokenizer(record.prompt + record.text, add_special_tokens=False, return_offsets_mapping=True)
    targets = [start >= len(record.prompt) for start, _ in encoded["offset_mapping"]]
    return Example(tokens=[*encoded["input_ids"], eos_id], targets=[*targets, True])


def encode_texts(tokenizer, texts: list[str], *, eos_id: int) -> list[Example]:
    if not texts:
        return []
    documents = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [Example(tokens=[*doc, eos_id], targets=[True] * (len(doc) + 1)) for doc in documents]


def encode_records(tokenizer, records: list[Record]) -> list[Example]:
    """Examples in record order (text records batched through the tokenizer)."""
    if tokenizer.eos_token_id is None and not all(r.is_chat for r in records):
        raise ValueError("the tokenizer has no EOS token: text documents cannot be separated")
    texts = [i for i, r in enumerate(records) if r.is_document]
    out: list[Optional[Example]] = [None] * len(records)
    encoded = encode_texts(tokenizer, [records[i].text for i in texts], eos_id=tokenizer.eos_token_id)
    for i, example in zip(texts, encoded, strict=True):
        out[i] = example
    for i, record in enumerate(records):
        if record.is_chat:
            out[i] = encode_chat(tokenizer, record)
        elif record.prompt is not None:
            out[i] = encode_prompted(tokenizer, record, eos_id=tokenizer.eos_token_id)
    return out  # type: ignore[return-value]


def end_of_turn_id(tokenizer) -> Optional[int]:
    """The special token the chat template closes an assistant turn with (`<|im_end|>` for ChatML),
    which generation must stop at; None when the template has none."""
    if not tokenizer.chat_template:
        return None
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    text, ((start, end),) = assistant_spans(tokenizer, messages, where="chat template")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    for token, (s, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        if start <= s < end and token in special:
            return token
    return None


def tokenizer_difference(tokenizer, other) -> Optional[str]:
    """How `other` reads text differently from `tokenizer` (their vocabularies: another token id for a
    token, or tokens only one has), or None when they are the same."""
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    if mine == theirs:
        return None
    moved = sorted(t for t in mine.keys() & theirs.keys() if mine[t] != theirs[t])
    only = sorted(mine.keys() ^ theirs.keys())
    example = (f"{moved[0]!r} is token {mine[moved[0]]} in one and {theirs[moved[0]]} in the other" if moved
               else f"{only[0]!r} is in only one of them")
    return f"{len(moved)} token(s) have other ids and {len(only)} are in one vocabulary only ({example})"
