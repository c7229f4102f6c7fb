"""What a resumed run changes of the config it started with: each change said, and a change that
breaks the resume refused unless forced.

A checkpoint keeps the model, the optimizer and the data position: the global samples (rows) read
so far. Rows are packed records of `seq_len` tokens, as the tokenizer cuts them: with another
seq_len or another tokenizer (data.tokenizer, or model.name_or_path, whose tokenizer is the
default) the same position counts other rows and the model has learned other token ids, so the run
would go on from a point its new data never had. Other data (data.path) resumes at the same number
of rows into the new data: said, not refused."""

from __future__ import annotations

from typing import Any

BREAKING = {
    "seq_len": "the checkpoint's data position counts rows of the old seq_len",
    "data.tokenizer": "the model learned the old tokenizer's ids, and the data position counts its rows",
    "model.name_or_path": "the checkpoint holds another model's weights (and its tokenizer's rows)",
    "method": "the checkpoint holds another method's state (a full model, or LoRA's adapters)",
}
"""Keys whose change makes the checkpoint another run's, and why."""


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(before: dict, after: dict) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every field the configs differ in, dotted keys in the config's order."""
    old, new = _flat(before), _flat(after)
    return [(key, old.get(key), new.get(key)) for key in dict.fromkeys([*old, *new]) if old.get(key) != new.get(key)]


def _shown(value: Any) -> str:
    return "''" if value == "" else str(value)


def resume_changes(before: dict, after: dict, *, run_name: str, force: bool) -> list[str]:
    """The lines that say how the resumed run differs from its start; ValueError naming the change
    and the way out for a change that breaks the resume, unless `force`."""
    changes = config_changes(before, after)
    breaking = [(key, old, new) for key, old, new in changes if key in BREAKING]
    if breaking and not force:
        key, old, new = breaking[0]
        raise ValueError(f"resuming run {run_name} with {key} {_shown(old)} -> {_shown(new)}: {BREAKING[key]}; "
                         f"start a new run (another --run-name), or pass --force-resume to go on anyway")
    lines = []
    if changes:
        lines.append("resuming with " + ", ".join(f"{key} {_shown(old)} -> {_shown(new)}" for key, old, new in changes))
    if any(key.startswith("data.") and key != "data.tokenizer" for key, _, _ in changes):
        lines.append("the data changed: the run goes on at its checkpoint's data position (the rows it has read), "
                     "counted in the new data")
    for key, _, _ in breaking:
        lines.append(f"forced: {key} changed although {BREAKING[key]}")
    return lines
