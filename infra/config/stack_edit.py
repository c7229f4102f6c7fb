"""Editing a stack file without touching what the edit is not about.

The file is loaded through a ruamel.yaml round trip with the indentation that reproduces it exactly;
only then are the edited keys set or removed. A final line diff checks that every line that changed is
one of those keys, so other keys and comments are kept byte for byte, or the file is not written at
all. `python -m capacity probe` (capacity/stackfile.py) and `python -m infra lock-images` edit stack
files this way.
"""

from __future__ import annotations

import difflib
import io
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ruamel.yaml import YAML

LAYOUTS = ((2, 4, 2), (2, 2, 0), (4, 4, 2), (4, 4, 0), (4, 6, 4), (2, 4, 0), (4, 2, 0))
"""(mapping, sequence, offset) indentations tried in order; the first that reproduces the file is used."""


class StackFileError(ValueError):
    """The stack file cannot be updated as asked; the file is left untouched."""


@dataclass(frozen=True, kw_only=True)
class StackUpdate:
    """A planned change of one stack file."""

    path: Path
    """The stack file."""
    before: str | None
    """Its text now; None when it does not exist."""
    after: str
    """Its text once written."""

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        before = (self.before or "").splitlines(keepends=True)
        label = str(self.path) if self.before is not None else "/dev/null"
        return "".join(difflib.unified_diff(before, self.after.splitlines(keepends=True),
                                            fromfile=label, tofile=str(self.path)))


def round_trip_yaml(layout: tuple[int, int, int] = LAYOUTS[0]) -> YAML:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines
    mapping, sequence, offset = layout
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    return yaml


def dump(yaml: YAML, doc: Any) -> str:
    buf = io.StringIO()
    yaml.dump(doc, buf)
    return buf.getvalue()


def faithful_load(text: str, path: Path, *, keys: Iterable[str]) -> tuple[YAML, Any]:
    """The YAML that reproduces `text` exactly, and the document; StackFileError (naming `keys`, to be
    set by hand) when no layout does."""
    for layout in LAYOUTS:
        yaml = round_trip_yaml(layout)
        doc = yaml.load(text)
        if dump(yaml, doc) == text:
            return yaml, doc
    raise StackFileError(f"{path}: its layout cannot be reproduced exactly by a YAML round trip, "
                         f"so it is left untouched; set {', '.join(keys)} by hand")


def check_only_keys_changed(before: str, after: str, path: Path, *, keys: Iterable[str], fix: str) -> None:
    """StackFileError unless every line that differs between `before` and `after` is one of `keys`."""
    key_line = re.compile(r"^\s*(" + "|".join(re.escape(k) for k in keys) + r")\s*:")
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        touched = a[i1:i2] + b[j1:j2]
        if not all(key_line.match(line) for line in touched):
            raise StackFileError(f"{path}: updating it would also change other lines "
                                 f"({touched[0].strip()!r}), so it is left untouched; {fix}")


def write(update: StackUpdate) -> None:
    """Atomically replace the file (never a half-written stack file), keeping its permissions."""
    path = update.path
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(update.after)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
