"""Training records read from JSONL or Parquet files: plain text, or a chat of role/content messages.

A record is a JSON object (a Parquet row) in one of these formats (`data.format`):
- "messages": `messages`, a list of {"role", "content"} with at least one assistant turn;
- "text": a string under the text field;
- "alpaca" (Stanford Alpaca's, as HF Trainer, TRL and torchtune users have it): `instruction`, an
  optional `input` (joined to the instruction by a blank line) and `output`, with an optional
  `system`: a user turn and its answer;
- "sharegpt": `conversations`, a list of {"from", "value"} with `from` one of system, human (user),
  gpt (assistant) or tool;
- "prompt_completion" (TRL's prompt-completion datasets): `prompt` and `completion`, both strings
  (standard) or both lists of messages (conversational, the completion the assistant's turns). As
  TRL's SFTTrainer trains them, only the completion is learned: a string prompt is context before
  the completion's text (which ends with EOS), a conversational prompt's own assistant turns are
  context too.
"auto" (the default) tells each record's format by its keys, and refuses a record that fits two
(the fix: set data.format). Every format becomes the same messages or text, and every mistake names
the file and the line (the row for Parquet), so a bad line in a million-line file is found at once.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROLES = ("system", "user", "assistant", "tool")
DATA_FORMATS = ("auto", "messages", "text", "alpaca", "sharegpt", "prompt_completion")
SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool"}
"""ShareGPT's `from` values and the role each is."""
ALPACA_FIELDS = ("instruction", "output")
"""The keys an Alpaca record must have (`input` and `system` are optional)."""
PROMPT_COMPLETION_FIELDS = ("prompt", "completion")
"""The keys of TRL's prompt-completion records."""


@dataclass(frozen=True, kw_only=True)
class Record:
    where: str
    """`file:line` (or `file:row N`), for messages about this record."""
    text: Optional[str] = None
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    """A text record's prompt: context before `text`, which alone is learned (a TRL prompt-completion)."""
    learned_from: int = 0
    """A chat's first message whose assistant turns are learned (a conversational prompt-completion's
    completion); the turns before it are context."""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def is_document(self) -> bool:
        """Plain text learned whole, which packing may split across rows (no prompt, no chat)."""
        return self.messages is None and self.prompt is None


def formats_of(obj: dict, *, text_field: str, messages_field: str) -> list[str]:
    """The formats whose keys the record has (by key only: its values are checked once it is read)."""
    found = []
    if messages_field in obj:
        found.append("messages")
    if SHAREGPT_FIELD in obj and SHAREGPT_FIELD != messages_field:
        found.append("sharegpt")
    if all(key in obj for key in ALPACA_FIELDS):
        found.append("alpaca")
    if isinstance(obj.get(text_field), str):
        found.append("text")
    if all(key in obj for key in PROMPT_COMPLETION_FIELDS):
        found.append("prompt_completion")
    return found


def _chat(messages, *, where: str, field: str) -> Record:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i} needs a string 'content'")
        if message.get("role") not in ROLES:
            raise ValueError(
                f"{where}: message {i} has role {message.get('role')!r}: use one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant message, so nothing to learn")
    return Record(where=where, messages=[{"role": m["role"], "content": m["content"]} for m in messages])


def _sharegpt(obj: dict, *, where: str) -> Record:
    turns = obj[SHAREGPT_FIELD]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: {SHAREGPT_FIELD!r} must be a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError(f"{where}: turn {i} of {SHAREGPT_FIELD!r} needs a string 'value'")
        if turn.get("from") not in SHAREGPT_ROLES:
            raise ValueError(f"{where}: turn {i} is from {turn.get('from')!r}: ShareGPT turns are from one of "
                             f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return _chat(messages, where=where, field=SHAREGPT_FIELD)


def _alpaca(obj: dict, *, where: str) -> Record:
    for key in (*ALPACA_FIELDS, "input", "system"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            raise ValueError(f"{where}: the Alpaca record's {key!r} must be a string")
    instruction, extra, system = obj["instruction"], obj.get("input") or "", obj.get("system") or ""
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": obj["output"]}]
    return Record(where=where, messages=messages)


def _prompt_completion(obj: dict, *, where: str) -> Record:
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise ValueError(f"{where}: 'completion' is empty: nothing to learn")
        return Record(where=where, text=completion, prompt=prompt)
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages "
                         f"(TRL's standard or conversational prompt-completion), got {type(prompt).__name__} and "
                         f"{type(completion).__name__}")
    for i, message in enumerate(completion):
        if isinstance(message, dict) and message.get("role") != "assistant":
            raise ValueError(f"{where}: the completion's message {i} has role {message.get('role')!r}: a completion "
                             "is the assistant's turns")
    chat = _chat([*prompt, *completion], where=where, field="prompt' and 'completion")
    return dataclasses.replace(chat, learned_from=len(prompt))


def _record(obj, *, where: str, text_field: str, messages_field: str, data_format: str = "auto") -> Record:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    found = formats_of(obj, text_field=text_field, messages_field=messages_field)
    if data_format == "auto":
        if len(found) > 1:
            raise ValueError(f"{where}: the record fits the formats {' and '.join(found)}: set data.format to the "
                             f"one it is (one of {', '.join(DATA_FORMATS[1:])})")
        if not found:
            raise ValueError(
                f"{where}: no {messages_field!r} list, no string {text_field!r} field, no Alpaca "
                f"{' and '.join(map(repr, ALPACA_FIELDS))}, no ShareGPT {SHAREGPT_FIELD!r} and no TRL "
                f"{' and '.join(map(repr, PROMPT_COMPLETION_FIELDS))} (set data.format, data.messages_field or "
                "data.text_field)")
        data_format = found[0]
    elif data_format not in found:
        keys = {"messages": f"a {messages_field!r} list", "text": f"a string {text_field!r} field",
                "alpaca": f"Alpaca's {' and '.join(map(repr, ALPACA_FIELDS))}",
                "sharegpt": f"ShareGPT's {SHAREGPT_FIELD!r} list",
                "prompt_completion": f"TRL's {' and '.join(map(repr, PROMPT_COMPLETION_FIELDS))}"}
        raise ValueError(f"{where}: data.format is {data_format!r} but the record has no {keys[data_format]}")
    if data_format == "messages":
        return _chat(obj[messages_field], where=where, field=messages_field)
    if data_format == "sharegpt":
        return _sharegpt(obj, where=where)
    if data_format == "alpaca":
        return _alpaca(obj, where=where)
    if data_format == "prompt_completion":
        return _prompt_completion(obj, where=where)
    return Record(where=where, text=obj[text_field])


def _jsonl_objects(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None


def _parquet_objects(path: Path, *, columns: list[str]) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    present = [c for c in columns if c in parquet.schema_arrow.names]
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=present or None):
        for obj in batch.to_pylist():
            yield f"{path}:row {row}", obj
            row += 1


def read_records(paths: list[Path], *, text_field: str = "text", messages_field: str = "messages",
                 limit: int = 0, data_format: str = "auto") -> list[Record]:
    """The records of the files in order, each read as `data_format` ("auto": by its keys); at most
    `limit` (0: all). Parquet files are read only as far as needed, and only the columns of the
    formats."""
    records: list[Record] = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"data file {str(path)!r} is not a file")
        columns = [text_field, messages_field, SHAREGPT_FIELD, *ALPACA_FIELDS, "input", "system",
                   *PROMPT_COMPLETION_FIELDS]
        objects = _parquet_objects(path, columns=columns) if path.suffix == ".parquet" else _jsonl_objects(path)
        for where, obj in objects:
            records.append(_record(obj, where=where, text_field=text_field, messages_field=messages_field,
                                   data_format=data_format))
            if limit and len(records) >= limit:
                return records
    if not records:
        raise ValueError(f"{', '.join(map(str, paths))}: no records (the file is empty)")
    return records


def hold_out(count: int, *, fraction: float, seed: int) -> set[int]:
    """A seeded choice of round(count * fraction) record numbers (at least one if fraction > 0): the
    held-out records of the eval loss (the client asks the trained model one of them)."""
    if fraction <= 0 or count < 2:
        return set()
    n = min(count - 1, max(1, round(count * fraction)))
    return set(random.Random(seed).sample(range(count), n))


def file_objects(path: Path, *, columns: list[str]) -> Iterator[tuple[str, object]]:
    """Each object of a JSONL or Parquet file (only `columns` of a Parquet file) with its place,
    `file:line` or `file:row N`: for readers of other kinds of records (preference pairs)."""
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} is not a file")
    return _parquet_objects(path, columns=columns) if path.suffix == ".parquet" else _jsonl_objects(path)
