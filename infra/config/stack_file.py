"""Stack files (`Pulumi.<stack>.yaml`) read and judged: every problem at once, each with its file and line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, TypeVar

from infra.config.errors import NO_VALUE, ConfigError, ConfigErrors
from infra.config.parsing import check_settings, parse_stack_config
from infra.config.schema import StackConfig

_T = TypeVar("_T")


def stack_file(stack: str, project_dir: Path | str = ".") -> Path:
    return Path(project_dir) / f"Pulumi.{stack}.yaml"


def read_stack_values(path: Path) -> dict[str, Any]:
    """The `config:` mapping of a stack file; ConfigError when the file is not a stack file."""
    from ruamel.yaml import YAML, YAMLError

    try:
        doc = YAML(typ="safe").load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), NO_VALUE, "does not exist",
                          f"run `python -m capacity probe --stack {_stack_name(path)}` to create it"
                          f"{_other_stacks_hint(path)}") from None
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise ConfigError(where, NO_VALUE, f"is not valid YAML ({problem})",
                          "fix the syntax, or move the file away and run the probe again") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise ConfigError(str(path), NO_VALUE, "is not a Pulumi stack file (no `config:` mapping)",
                          "fix the file, or move it away and run the probe again")
    return dict(doc.get("config") or {})


def _stack_name(path: Path) -> str:
    return path.name.removeprefix("Pulumi.").removesuffix(".yaml")


def _other_stacks_hint(path: Path) -> str:
    stacks = sorted(_stack_name(p) for p in path.parent.glob("Pulumi.*.yaml"))
    close = difflib.get_close_matches(_stack_name(path), stacks, n=1)
    if close:
        return f"; or did you mean --stack {close[0]}?"
    return f"; stacks here: {', '.join(stacks)}" if stacks else ""


def key_lines(path: Path) -> dict[str, int]:
    """The line (1-based) of each key under `config:` in a stack file that parses."""
    from ruamel.yaml import YAML

    config = (YAML().load(path.read_text()) or {}).get("config") or {}
    return {key: config.lc.key(key)[0] + 1 for key in config}


def located(error: ConfigError, path: Path) -> ConfigError:
    """`error` (each of ConfigErrors) read from the stack file `path`: with the file and the line
    of its key, in line order, and the stack's name in its fix."""
    errors = error.errors if isinstance(error, ConfigErrors) else (error,)
    lines = key_lines(path)
    placed = sorted(((lines.get(e.key, 0), i, e) for i, e in enumerate(errors)), key=lambda t: t[:2])
    out = [ConfigError(e.key, e.value, e.problem,
                       e.fix.replace("Pulumi.<stack>.yaml", path.name).replace("<stack>", _stack_name(path)),
                       where=f"{path}:{line}" if line else str(path))
           for line, _, e in placed]
    return out[0] if len(out) == 1 else ConfigErrors(out)


def _checked(path: Path, check: Callable[[dict[str, Any]], _T]) -> _T:
    values = read_stack_values(path)
    try:
        return check(values)
    except ConfigError as exc:
        raise located(exc, path) from None


def check_stack_file_settings(path: Path) -> None:
    """`check_settings` of a stack file: every problem at once, each with its line."""
    _checked(path, check_settings)


def load_stack_config(stack: str, project_dir: Path | str = ".") -> StackConfig:
    """The validated config of `Pulumi.<stack>.yaml`: every problem at once, each with its line."""
    return _checked(stack_file(stack, project_dir), parse_stack_config)
