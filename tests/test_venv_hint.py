"""Commands run without the project's virtualenv (`python3 -m capacity probe` before `source
.venv/bin/activate`) say in one line how to run them, not a ModuleNotFoundError traceback.

The interpreter is the one the venv was made from, with `-S` so that no site-packages of any kind
is on its path: as a fresh machine's python3, it has none of the project's dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workloads import venv_hint

BARE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def run_bare(*args: str, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([BARE_PYTHON, "-S", "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("command", "missing"), [
    (("capacity", "probe", "--stack", "us-west-2"), "boto3"),
    (("infra", "render", "--stack", "us-west-2"), "ruamel"),
    (("workloads", "run", "--local"), "rich"),
    (("workloads", "submit", "--stack", "us-west-2"), "rich"),  # ray: only once it reaches the cluster
])
def test_a_command_without_the_venv_says_how_to_run_it(command, missing, repo_root):
    done = run_bare(*command, cwd=repo_root)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    name = Path(BARE_PYTHON).name
    made = "" if (repo_root / ".venv" / "bin" / "python").exists() else \
        f" (`make venv` in {repo_root} creates it first)"
    assert line == (f"error: {name} cannot import {missing}, a dependency of this project: run the command "
                    f"with the project's .venv{made}: `source .venv/bin/activate` first, or "
                    f"`.venv/bin/python -m {command[0]} ...`")


def test_from_another_folder_the_hint_names_the_venv_by_its_path(repo_root, tmp_path):
    done = run_bare("capacity", "probe", cwd=tmp_path, pythonpath=str(repo_root))
    assert done.returncode == 2
    assert f"`source {repo_root}/.venv/bin/activate` first, or `{repo_root}/.venv/bin/python -m capacity" \
        in done.stderr


def test_without_a_venv_it_says_how_to_make_one(monkeypatch, tmp_path):
    monkeypatch.setattr(venv_hint, "PROJECT_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert "(`make venv` in " + str(tmp_path) + " creates it first)" in venv_hint.hint("workloads", "rich")


def test_a_venv_that_lacks_a_dependency_is_told_to_reinstall(monkeypatch, repo_root):
    monkeypatch.setattr(sys, "prefix", str(repo_root / ".venv"))
    monkeypatch.chdir(repo_root)
    assert venv_hint.hint("workloads", "rich") == (
        f"error: .venv lacks rich, a dependency of this project: reinstall it with "
        f"`rm .venv/.installed && make venv` in {venv_hint.PROJECT_ROOT}")


def test_a_missing_module_of_the_project_itself_is_not_hidden():
    with pytest.raises(ModuleNotFoundError):
        with venv_hint.dependencies_of("workloads"):
            import workloads.no_such_module  # noqa: F401
