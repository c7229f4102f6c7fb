"""The stack configuration's errors: the key, the value and the fix, one line each."""

from __future__ import annotations

from typing import Any, Sequence


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()
"""The `value` of a problem with a whole file rather than with one key's value."""


class ConfigError(ValueError):
    """A user mistake in the stack configuration: the key, the value, and how to fix it; `where`
    is the file and line it was read from, when known."""

    def __init__(self, key: str, value: Any, problem: str, fix: str, *, where: str = ""):
        self.key, self.value, self.problem, self.fix, self.where = key, value, problem, fix, where
        subject = key if value is NO_VALUE else f"{key} = {value!r}"
        super().__init__(f"{where + ': ' if where else ''}{subject}: {problem}. Fix: {fix}")


class ConfigErrors(ConfigError):
    """Several problems of one config, each a ConfigError; one line each. The attributes of the
    first are this error's own."""

    def __init__(self, errors: Sequence[ConfigError]):
        self.errors = tuple(errors)
        first = self.errors[0]
        self.key, self.value, self.problem, self.fix, self.where = (
            first.key, first.value, first.problem, first.fix, first.where)
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))


def raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise the one problem as it is, several as ConfigErrors, nothing when there is none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def fix_cmd(key: str, example: Any) -> str:
    return f"pulumi config set {key} {example}  (or edit it in Pulumi.<stack>.yaml)"
