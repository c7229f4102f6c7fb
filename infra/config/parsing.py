"""Parsing a stack file's `config:` mapping into a StackConfig: values coerced to their types, unknown
keys refused with a hint, and every problem of the config reported at once."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import MISSING, fields
from datetime import datetime
from typing import Any, Iterator, Mapping, Sequence

from infra.config.errors import ConfigError, fix_cmd, raise_all
from infra.config.reservation_rules import reservation_problems
from infra.config.rules import capacity_type_problems, placement_problems, settings_problems
from infra.config.schema import (FIELDS, KNOWN_KEYS, PLACEMENT_FIELDS, PROJECT, RESERVATION_FIELDS, SPOT_FIELDS,
                                 StackConfig,
                                 config_key, format_utc)


def _as_int(key: str, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ConfigError(key, raw, "must be a whole number", fix_cmd(key, 2))
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise ConfigError(key, raw, "must be a whole number", fix_cmd(key, 2))


def _as_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ConfigError(key, raw, "must be true or false", fix_cmd(key, "true"))


def _as_str(key: str, raw: Any) -> str:
    if isinstance(raw, float):
        # A stack file's float keeps its spelling (infra.config.stack_file.WrittenFloat).
        written = getattr(raw, "text", repr(raw))
        raise ConfigError(key, raw, f"is a number to YAML, not text: unquoted, {written} is read as "
                          f"{float(raw)!r} (trailing zeros dropped)",
                          f'quote it in the stack file: {key}: "{written}"')
    if isinstance(raw, (str, int)) and not isinstance(raw, bool):
        return str(raw).strip()
    if isinstance(raw, datetime):  # an unquoted timestamp in hand-written YAML
        return format_utc(raw)
    raise ConfigError(key, raw, "must be a string", fix_cmd(key, "<value>"))


def _as_str_list(key: str, raw: Any) -> tuple[str, ...]:
    # Pulumi hands structured values to the program as JSON strings; stack files hold YAML lists.
    # A plain string is a scalar in the stack file (`pulumi config set` without --path): refused,
    # as `pulumi config set --path 'key[1]'` and every reader of the file expect a list.
    def fix(value: str = "<value>") -> str:
        return f"pulumi config set --path '{key}[0]' {value}: a list (in the stack file, `- {value}` under the key)"

    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            first = raw.split(",")[0].strip()
            raise ConfigError(key, raw, "is a single value, not a list", fix(first or "<value>")) from None
    if not isinstance(raw, (list, tuple)) or not all(isinstance(x, str) for x in raw):
        raise ConfigError(key, raw, "must be a list of strings", fix())
    return tuple(x.strip() for x in raw)


def _coerce(name: str, key: str, raw: Any) -> Any:
    annotation = str(FIELDS[key].type)
    if annotation == "int":
        return _as_int(key, raw)
    if annotation == "bool":
        return _as_bool(key, raw)
    if annotation.startswith("tuple"):
        return _as_str_list(key, raw)
    return _as_str(key, raw)


def _problems(cfg: StackConfig, *, placement: bool = True,
              known_bad: Sequence[ConfigError] = ()) -> list[ConfigError]:
    """Every problem of `cfg`, after those already found (`known_bad`), one per key: a key whose
    value is already refused is not judged again."""
    found = list(known_bad)

    def add(problems: Iterator[ConfigError]) -> None:
        for problem in problems:
            if problem.key not in {e.key for e in found}:
                found.append(problem)

    if placement:
        add(placement_problems(cfg, skip={e.key for e in known_bad}))
        add(capacity_type_problems(cfg))
        # The reservation is judged against the placement: only once both read cleanly, so that
        # one bad value is one problem, not a cascade.
        watched = {config_key(name) for name in PLACEMENT_FIELDS + SPOT_FIELDS + RESERVATION_FIELDS}
        if not watched & {e.key for e in found}:
            add(reservation_problems(cfg))
    add(settings_problems(cfg))
    return found


def parse_stack_config(values: Mapping[str, Any]) -> StackConfig:
    """Build a StackConfig from `key -> value` (a stack file's `config:` or Pulumi's config).

    Keys of other namespaces (aws:profile, pulumi:tags, ...) are left alone; unknown keys in this
    program's namespace are refused with the nearest known key as a hint.
    """
    kwargs, errors = coerce_values(values)
    for f in fields(StackConfig):
        if f.name not in kwargs and f.default is MISSING:  # no default: required
            key = config_key(f.name)
            if key not in {e.key for e in errors}:
                errors.append(ConfigError(key, None, "is required",
                                          "run `python -m capacity probe --stack <stack>` to write it"))
            kwargs[f.name] = ""
    cfg = StackConfig(**kwargs)
    raise_all(_problems(cfg, known_bad=errors))
    return cfg


def check_settings(values: Mapping[str, Any]) -> None:
    """Validate every key of a stack file except the placement the probe is about to write, so a
    bad value fails before the probe makes any cloud call."""
    values_by_name, errors = coerce_values(values)
    kwargs = {name: value for name, value in values_by_name.items()
              if name not in PLACEMENT_FIELDS + SPOT_FIELDS + RESERVATION_FIELDS}
    cfg = StackConfig(region="", gpu_availability_zone="", gpu_availability_zone_id="", **kwargs)
    raise_all(_problems(cfg, placement=False, known_bad=errors))


def coerce_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigError]]:
    """Field name -> typed value for this program's keys, and the problems: values of the wrong
    type, unknown keys of its namespace, and keys that look meant for it under another namespace."""
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []
    for key, raw in values.items():
        try:
            if key in FIELDS:
                if isinstance(raw, Mapping) and "secure" in raw:
                    raise ConfigError(key, "<secret>", "is not a secret value",
                                      fix_cmd(key, "<value>") + " without --secret")
                kwargs[FIELDS[key].name] = _coerce(FIELDS[key].name, key, raw)
            elif key.startswith(f"{PROJECT}:"):
                hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                raise ConfigError(key, raw, "is not a setting of this program",
                                  f"did you mean {hint[0]}?" if hint else
                                  f"remove it; known keys: {', '.join(KNOWN_KEYS)}")
            elif (meant := _meant_for_this_program(key)) is not None:
                raise ConfigError(key, raw, f"is not read: this program's keys are under "
                                  f"`{PROJECT}:`", f"did you mean {meant}?")
        except ConfigError as exc:
            errors.append(exc)
    return kwargs, errors


_NAMES = {key.split(":", 1)[1].lower(): key for key in KNOWN_KEYS if key.startswith(f"{PROJECT}:")}


def _meant_for_this_program(key: str) -> str | None:
    """The key of this program that `key` (of another namespace, or of none) was probably meant
    as: a namespace spelt close to the project's (`rayeks:`), or a setting's own name under
    another namespace (`aws:gpuNodeCount`). None for genuine keys of other namespaces."""
    namespace, _, name = key.rpartition(":")
    close_namespace = difflib.SequenceMatcher(a=namespace.lower(), b=PROJECT).ratio() >= 0.75
    if name.lower() in _NAMES:
        return _NAMES[name.lower()]
    if close_namespace:
        hint = difflib.get_close_matches(f"{PROJECT}:{name}", KNOWN_KEYS, n=1)
        return hint[0] if hint else f"{PROJECT}:{name}"
    return None
