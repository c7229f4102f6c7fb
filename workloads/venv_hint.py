"""A command run by an interpreter without the project's dependencies (`python3 -m capacity probe`
with `.venv` not activated) says in one line how to run it, instead of a ModuleNotFoundError
traceback.

Standard library only: it is what runs when nothing else can be imported. Each `__main__` of the
project (capacity, infra, workloads) runs its command inside `dependencies_of`.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PROJECT_ROOT = Path(__file__).resolve().parents[1]
OWN_PACKAGES = ("capacity", "infra", "workloads", "policy")
EXIT_NO_DEPENDENCIES = 2
"""A usage mistake, as the commands' other ones: nothing was run."""


def _in_project_venv() -> bool:
    return Path(sys.prefix).resolve() == (PROJECT_ROOT / ".venv").resolve()


def hint(command: str, missing: str) -> str:
    """The one line: which module is missing, and the ways to run `python -m <command>` with it."""
    venv = PROJECT_ROOT / ".venv"
    shown = ".venv" if Path.cwd().resolve() == PROJECT_ROOT.resolve() else str(venv)
    if _in_project_venv():
        return (f"error: {shown} lacks {missing}, a dependency of this project: reinstall it with "
                f"`rm {shown}/.installed && make venv` in {PROJECT_ROOT}")
    where = "" if (venv / "bin" / "python").exists() else f" (`make venv` in {PROJECT_ROOT} creates it first)"
    return (f"error: {os.path.basename(sys.executable)} cannot import {missing}, a dependency of this project: "
            f"run the command with the project's .venv{where}: `source {shown}/bin/activate` first, or "
            f"`{shown}/bin/python -m {command} ...`")


@contextmanager
def dependencies_of(command: str) -> Iterator[None]:
    """Run `python -m <command>`'s code; a third-party module it cannot import ends the process with
    the hint on stderr and exit code 2. A missing module of the project itself is a bug, raised."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if not missing or missing in OWN_PACKAGES:
            raise
        print(hint(command, missing), file=sys.stderr)
        raise SystemExit(EXIT_NO_DEPENDENCIES) from None
