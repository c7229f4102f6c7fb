"""Training records read from JSONL or Parquet files: plain text, or a chat of role/content messages.

A record is a JSON object (a Parquet row) holding either `messages`, a list of {"role", "content"}
with at least one assistant turn, or a string under the text field. Every mistake names the file
and the line (the row for Parquet), so a bad line in a million-line file is found at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True)
class Record:
    where: str
    """`file:line` (or `file:row N`), for messages about this record."""
    text: Optional[str] = None
    messages: Optional[list[dict]] = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _record(obj, *, where: str, text_field: str, messages_field: str) -> Record:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    if messages_field in obj:
        messages = obj[messages_field]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: {messages_field!r} must be a non-empty list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: message {i} needs a string 'content'")
            if message.get("role") not in ROLES:
                raise ValueError(
                    f"{where}: message {i} has role {message.get('role')!r}: use one of {', '.join(ROLES)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant message, so nothing to learn")
        return Record(where=where, messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    if isinstance(obj.get(text_field), str):
        return Record(where=where, text=obj[text_field])
    raise ValueError(
        f"{where}: no {messages_field!r} list and no string {text_field!r} field "
        "(set data.messages_field or data.text_field)"
    )


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
                 limit: int = 0) -> list[Record]:
    """The records of the files in order; at most `limit` (0: all). Parquet files are read only as
    far as needed, and only the text and messages columns."""
    records: list[Record] = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"data file {str(path)!r} is not a file")
        objects = (_parquet_objects(path, columns=[text_field, messages_field]) if path.suffix == ".parquet"
                   else _jsonl_objects(path))
        for where, obj in objects:
            records.append(_record(obj, where=where, text_field=text_field, messages_field=messages_field))
            if limit and len(records) >= limit:
                return records
    if not records:
        raise ValueError(f"{', '.join(map(str, paths))}: no records (the file is empty)")
    return records
