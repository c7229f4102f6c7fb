"""Stack files (`Pulumi.<stack>.yaml`) read and judged: every problem at once, each with its file and line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, TypeVar

from infra.config.errors import NO_VALUE, ConfigError, ConfigErrors
from infra.config.parsing import check_settings, parse_stack_config
from infra.config.rules import looks_like_region
from infra.config.schema import StackConfig

_T = TypeVar("_T")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this package belongs to: its Pulumi.yaml is beside the stack files."""


def stack_file(stack: str, project_dir: Path | str = ".") -> Path:
    return Path(project_dir) / f"Pulumi.{stack}.yaml"


class WrittenFloat(float):
    """A YAML float that remembers how the file spelt it (`1.30`, which float() makes 1.3), so that
    a message about it shows the value as written."""

    text: str

    def __repr__(self) -> str:
        return self.text


def _safe_yaml():
    from ruamel.yaml import YAML
    from ruamel.yaml.constructor import SafeConstructor

    class Constructor(SafeConstructor):
        def construct_yaml_float(self, node):  # type: ignore[override]
            value = WrittenFloat(super().construct_yaml_float(node))
            value.text = str(node.value)
            return value

    Constructor.add_constructor("tag:yaml.org,2002:float", Constructor.construct_yaml_float)
    yaml = YAML(typ="safe")
    yaml.Constructor = Constructor
    return yaml


def read_stack_values(path: Path) -> dict[str, Any]:
    """The `config:` mapping of a stack file; ConfigError when the file is not a stack file."""
    from ruamel.yaml import YAMLError

    try:
        doc = _safe_yaml().load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), NO_VALUE, "does not exist", _missing_fix(path)) from None
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


def require_stack_file(stack: str, project_dir: Path | str = ".") -> Path:
    """The stack file of `stack`; ConfigError naming the stack meant (or how to create it) when
    there is none: every stack of the project has one."""
    path = stack_file(stack, project_dir)
    if not path.is_file():
        raise ConfigError(str(path), NO_VALUE, "does not exist", _missing_fix(path))
    return path


def _missing_fix(path: Path) -> str:
    folder = path.parent
    if not (folder / "Pulumi.yaml").is_file():  # not the project's folder: creating it here is wrong
        root = f" ({PROJECT_ROOT})" if (PROJECT_ROOT / "Pulumi.yaml").is_file() else ""
        shown = str(folder.resolve()) if str(folder) == "." else str(folder)
        return (f"the stack files are in the project's root{root}, beside Pulumi.yaml, and {shown} "
                "has no Pulumi.yaml: run the command from the project's root")
    stack = _stack_name(path)
    # The probe takes a stack named after a region; any other name only with --new-stack.
    flag = "" if looks_like_region(stack) else " --new-stack"
    create = f"run `python -m capacity probe --stack {stack}{flag}` to create it"
    stacks = sorted(_stack_name(p) for p in path.parent.glob("Pulumi.*.yaml"))
    close = difflib.get_close_matches(stack, stacks, n=1)
    if close:
        return f"did you mean --stack {close[0]}? Or {create}"
    return create + (f"; stacks here: {', '.join(stacks)}" if stacks else "")


def _stack_name(path: Path) -> str:
    return path.name.removeprefix("Pulumi.").removesuffix(".yaml")


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
