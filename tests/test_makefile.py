"""The Makefile's bootstrap, run by `make` in a copy of the repository's Makefile and pyproject.toml
with stand-in interpreters: it checks the Python version before and after the venv exists, says
what the first install does, and never installs anything here."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

FAKE_PYTHON = """#!/bin/sh
# Answers the version probe with $FAKE_VERSION, creates a venv by copying itself, logs the rest.
case "$1" in
  -c) echo "$FAKE_VERSION" ;;
  -m) if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
      else echo "$*" >> "$FAKE_LOG"; fi ;;
esac
"""


@pytest.fixture
def project(tmp_path: Path, repo_root: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(repo_root / name, tmp_path / name)
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def make(project: Path, *args: str, version: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAKE_VERSION": version, "FAKE_LOG": str(project / "pip.log")}
    return subprocess.run(["make", "--no-print-directory", *args, f"PYTHON={project / 'fakepython'}"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=60)


def test_the_first_install_says_what_it_installs_and_shows_pips_progress(project):
    done = make(project, "venv", version="3.12")
    assert done.returncode == 0, done.stderr
    assert "about 2.5 GB of wheels" in done.stdout and "5-10 minutes the first time" in done.stdout
    assert re.search(r"\.venv ready in \d+ s", done.stdout)
    (pip,) = (project / "pip.log").read_text().splitlines()
    assert pip == "-m pip install --progress-bar on -e .[dev]"  # not --quiet
    assert (project / ".venv" / ".installed").exists()
    again = make(project, "venv", version="3.12")  # installed: nothing to do, no message
    assert again.returncode == 0 and "Installing" not in again.stdout


def test_a_wrong_python_is_refused_before_any_venv_exists(project):
    done = make(project, "demo", version="3.13")
    assert done.returncode != 0
    assert "fakepython is Python 3.13; this project needs 3.11 or 3.12" in done.stderr
    assert "make demo PYTHON=python3.12" in done.stderr
    assert not (project / ".venv").exists() and not (project / "pip.log").exists()


def test_a_venv_made_by_a_wrong_python_says_how_to_recover(project):
    assert make(project, "venv", version="3.12").returncode == 0
    # The venv is installed and up to date; its interpreter is now the wrong one.
    done = make(project, "test", version="3.13")
    assert done.returncode != 0
    assert ".venv/bin/python is Python 3.13" in done.stderr
    assert "remove it (rm -rf .venv) and run make again with PYTHON=python3.12" in done.stderr
    assert "make clean" not in done.stderr  # it would suggest more than the venv's removal


def test_clean_keeps_the_runs_and_clean_runs_removes_them(project):
    assert make(project, "venv", version="3.12").returncode == 0
    report = project / "runs" / "20261201-011428" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text("{}")
    (project / "mutants").mkdir()
    done = make(project, "clean", version="3.12")
    assert done.returncode == 0, done.stderr
    assert not (project / ".venv").exists() and not (project / "mutants").exists()
    assert report.read_text() == "{}"  # every demo's report, checkpoints and model are kept
    done = make(project, "clean-runs", version="3.12")
    assert done.returncode == 0, done.stderr
    assert not (project / "runs").exists()


def test_the_checked_versions_are_those_pyproject_allows(repo_root):
    makefile = (repo_root / "Makefile").read_text()
    versions = re.search(r"^PYTHON_VERSIONS := (.+)$", makefile, re.M).group(1).split()
    spec = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["requires-python"]
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", spec).groups()
    assert versions == [f"3.{minor}" for minor in range(int(low), int(high))]


def test_lint_runs_ruff_from_the_venv(project):
    assert make(project, "venv", version="3.12").returncode == 0
    done = make(project, "lint", version="3.12")
    assert done.returncode == 0, done.stderr
    assert (project / "pip.log").read_text().splitlines()[-1] == "-m ruff check ."


def test_the_code_passes_the_linter(repo_root):
    """What `make lint` runs, configured in pyproject.toml ([tool.ruff])."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_test_fast_runs_the_tests_not_marked_slow_and_test_runs_them_all(project):
    (project / ".venv" / "bin").mkdir(parents=True)
    for target, expected in (("test-fast", '-m pytest -m "not slow"'), ("test", "-m pytest")):
        done = subprocess.run(["make", "--no-print-directory", "-n", target, "-o", ".venv/.installed"], cwd=project,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == f".venv/bin/python {expected}"
