"""The user's `--set KEY=VALUE` overrides of a preset, as `with_overrides` takes them.

A preset's `data.path` belongs to its `data.kind`: the GPU presets' `HuggingFaceH4/ultrachat_200k` is
a hub dataset id, no JSONL file. An override that changes the kind without naming a path therefore
drops the preset's path, so that the config's own check says what the new kind needs ("data.path is
empty: kind "jsonl" needs the path ...") instead of judging a value the user never wrote.
"""

from __future__ import annotations

import json


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


def user_overrides(base: dict, assignments: list[str]) -> list[str]:
    """`assignments` for the config `base` (TrainConfig.to_dict()), with `data.path=` first when
    they change data.kind and set no data.path."""
    given = given_keys(assignments)
    kind = given.get("data.kind", base["data"]["kind"])
    if kind != base["data"]["kind"] and "data.path" not in given and base["data"].get("path"):
        return ["data.path=", *assignments]
    return list(assignments)
