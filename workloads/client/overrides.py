"""The user's `--set KEY=VALUE` overrides of a preset, as `with_overrides` takes them.

A preset's `data.path` belongs to its `data.kind`: the GPU presets' `HuggingFaceH4/ultrachat_200k` is
a hub dataset id, no JSONL file. An override that changes the kind without naming a path therefore
drops the preset's path, so that the config's own check says what the new kind needs ("data.path is
empty: kind "jsonl" needs the path ...") instead of judging a value the user never wrote.

The other way round, a `data.path` without a `data.kind` names its kind: a file (`.jsonl`, `.json`,
`.parquet`, an s3:// object, or a file that exists here) is read as kind "jsonl", an ORG/NAME that is
no file here is a hub dataset. A path that says neither is refused with the fix, rather than left to
the preset's kind: the demo's "synthetic" would ignore it and train on generated tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The data files kind "jsonl" reads (workloads/train/records.py reads Parquet by its suffix)."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _value(raw: str) -> object:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def given_keys(assignments: list[str]) -> dict[str, object]:
    """The keys `--set` assignments set, with their values."""
    given = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if sep:
            given[key.strip()] = _value(raw)
    return given


def kind_of_path(path: str, *, cwd: Path) -> Optional[str]:
    """The data kind a `data.path` names: "jsonl" for a data file, "hub" for a hub dataset id; None
    when it says neither."""
    if path.startswith("s3://") or path.lower().endswith(FILE_SUFFIXES) or (cwd / path).expanduser().is_file():
        return "jsonl"
    if _HUB_ID.match(path) and not (cwd / path).exists():
        return "hub"
    return None


def user_overrides(base: dict, assignments: list[str], *, cwd: Optional[Path] = None) -> list[str]:
    """`assignments` for the config `base` (TrainConfig.to_dict()): with `data.path=` first when they
    change data.kind and set no data.path, and with the kind their data.path names first when they
    set no data.kind. ValueError for a data.path whose kind cannot be told."""
    given = given_keys(assignments)
    if "data.path" in given and "data.kind" not in given and str(given["data.path"] or ""):
        path = str(given["data.path"])
        kind = kind_of_path(path, cwd=cwd or Path.cwd())
        if kind is None:
            raise ValueError(
                f"data.path is {path!r} but data.kind is not set (the preset's is {base['data']['kind']!r}), and the "
                f"path names no kind: add --set data.kind=jsonl for a JSONL or Parquet file, or --set data.kind=hub "
                "for a hub dataset id (ORG/NAME)")
        if kind != base["data"]["kind"]:
            return [f"data.kind={kind}", *assignments]
        return list(assignments)
    kind = given.get("data.kind", base["data"]["kind"])
    if kind != base["data"]["kind"] and "data.path" not in given and base["data"].get("path"):
        return ["data.path=", *assignments]
    return list(assignments)
