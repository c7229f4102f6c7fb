"""Preference records read from JSONL or Parquet files: a prompt with a chosen and a rejected answer.

A record is a JSON object (a Parquet row) in one of the shapes users have (TRL's names):
- explicit prompt: `prompt`, `chosen` and `rejected`, all strings, or all conversations (`prompt`
  the messages up to the answer, `chosen` and `rejected` the assistant's answers);
- implicit prompt: `chosen` and `rejected` only, each the whole conversation (or text): the prompt
  is what they share at the start, as TRL's `extract_prompt` finds it;
- UltraFeedback binarized (HuggingFaceH4/ultrafeedback_binarized): `prompt` a string and `chosen` and
  `rejected` whole conversations that open with it: read as implicit, the string checked against
  the last user turn they share.
Every mistake names the record's file and line (row, for Parquet): a record without `chosen` or
`rejected`, the same answer twice, answers to different prompts. No torch here: the client reads
the records of a local file before anything starts (workloads/client/inputs_check.py), as the job
reads them (workloads/train/pairs.py tokenizes and packs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from workloads.train.records import ROLES, file_objects

PAIR_FIELDS = ("prompt", "chosen", "rejected")

Text = Union[str, list]
"""A string, or a conversation: a list of {"role", "content"} messages."""


@dataclass(frozen=True, kw_only=True)
class PreferenceRecord:
    where: str
    """`file:line` (or `file:row N`)."""
    prompt: Text
    chosen: Text
    rejected: Text

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _conversation(value, *, where: str, key: str) -> list[dict]:
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i} of {key!r} needs a string 'content'")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} of {key!r} has role {message.get('role')!r}: use one of "
                             f"{', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text(value, *, where: str, key: str) -> Text:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _conversation(value, where=where, key=key)
    raise ValueError(f"{where}: {key!r} must be a string or a list of messages, got {type(value).__name__}")


def shared_start(chosen: Text, rejected: Text) -> int:
    """Where the implicit prompt ends: TRL's `extract_prompt` (the first place the two differ, one
    character earlier where that character is a space; where one is a prefix of the other, one
    before the shorter's end)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return idx


def _implicit(chosen: Text, rejected: Text, *, where: str, prompt_text: Optional[str]) -> PreferenceRecord:
    end = shared_start(chosen, rejected)
    prompt, chosen, rejected = chosen[:end], chosen[end:], rejected[end:]
    if not prompt:
        raise ValueError(f"{where}: 'chosen' and 'rejected' share no prompt: they answer different prompts (give "
                         "each record one prompt, under 'prompt' or at the start of both answers)")
    if isinstance(prompt, list) and prompt[-1]["role"] == "assistant":
        raise ValueError(f"{where}: 'chosen' and 'rejected' share their first answer, so the pair prefers nothing "
                         "there: give the answers after the last turn they share")
    if prompt_text is not None:
        users = [m["content"] for m in prompt if m["role"] == "user"]
        if not users or users[-1].strip() != prompt_text.strip():
            answered = users[-1][:60] if users else "no user turn"
            raise ValueError(f"{where}: 'chosen' and 'rejected' answer {answered!r}, not the record's 'prompt' "
                             f"{prompt_text[:60]!r}: they answer different prompts")
    return PreferenceRecord(where=where, prompt=prompt, chosen=chosen, rejected=rejected)


def preference_record(obj, *, where: str) -> PreferenceRecord:
    """One record, in any of the module's shapes; ValueError naming `where` for a mistake."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("chosen", "rejected") if obj.get(key) in (None, "", [])]
    if missing:
        raise ValueError(f"{where}: no {' and no '.join(map(repr, missing))}: a preference record needs a 'chosen' and "
                         "a 'rejected' answer (and a 'prompt', unless both answers open with it)")
    chosen = _text(obj["chosen"], where=where, key="chosen")
    rejected = _text(obj["rejected"], where=where, key="rejected")
    if type(chosen) is not type(rejected):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be strings or both conversations")
    if chosen == rejected:
        raise ValueError(f"{where}: 'chosen' and 'rejected' are the same answer, so the pair prefers nothing: fix or "
                         "drop the record")
    prompt = obj.get("prompt")
    if prompt is None:
        return _implicit(chosen, rejected, where=where, prompt_text=None)
    prompt = _text(prompt, where=where, key="prompt")
    if isinstance(prompt, str) and isinstance(chosen, list):  # UltraFeedback binarized
        if chosen[0]["role"] == "assistant":
            raise ValueError(f"{where}: 'prompt' is a string and the answers are conversations that do not hold it: "
                             "give 'prompt' as messages ([{\"role\": \"user\", \"content\": ...}]) or the answers "
                             "as strings")
        return _implicit(chosen, rejected, where=where, prompt_text=prompt)
    if type(prompt) is not type(chosen):
        raise ValueError(f"{where}: 'prompt' is a {'conversation' if isinstance(prompt, list) else 'string'} and the "
                         f"answers are {'conversations' if isinstance(chosen, list) else 'strings'}: give them alike")
    if isinstance(prompt, list):
        for key, answer in (("chosen", chosen), ("rejected", rejected)):
            if answer[0]["role"] != "assistant":
                if answer[: len(prompt)] != prompt:
                    raise ValueError(f"{where}: {key!r} opens with a {answer[0]['role']} turn that is not the record's "
                                     "'prompt': the answers are to different prompts")
        if chosen[: len(prompt)] == prompt and rejected[: len(prompt)] == prompt:
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
        if not chosen or not rejected or chosen == rejected:
            raise ValueError(f"{where}: 'chosen' and 'rejected' must hold different answers after the 'prompt'")
    return PreferenceRecord(where=where, prompt=prompt, chosen=chosen, rejected=rejected)


def read_pairs(paths: list[Path], *, limit: int = 0) -> list[PreferenceRecord]:
    """The files' preference records in order, at most `limit` (0: all)."""
    records: list[PreferenceRecord] = []
    for path in paths:
        for where, obj in file_objects(path, columns=list(PAIR_FIELDS)):
            records.append(preference_record(obj, where=where))
            if limit and len(records) >= limit:
                return records
    if not records:
        raise ValueError(f"{', '.join(map(str, paths))}: no records (the file is empty)")
    return records
