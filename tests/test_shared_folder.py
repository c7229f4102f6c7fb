"""Without the shared folder, a user's clone skips the tests that need it, saying why; CI fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parent / "fixtures" / "shared_dir_probe.py"


def run_probe(*, repo_root: Path, shared: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["SHARED_DIR"] = str(shared)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", str(PROBE), "-q", "-p", "no:cacheprovider", "-n", "0"],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_shared_folder_fails_the_run(repo_root, tmp_path, ci):
    run = run_probe(repo_root=repo_root, shared=tmp_path / "nowhere", ci=ci)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"reference files not found at {tmp_path / 'nowhere'}" in run.stdout
    assert "1 error" in run.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_on_a_clone_a_missing_shared_folder_skips_with_the_reason(repo_root, tmp_path, ci):
    run = run_probe(repo_root=repo_root, shared=tmp_path / "nowhere", ci=ci)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout
    assert f"reference files not found at {tmp_path / 'nowhere'}; set SHARED_DIR" in run.stdout


def test_under_ci_the_shared_folder_present_passes(repo_root, shared_dir):
    run = run_probe(repo_root=repo_root, shared=shared_dir, ci="true")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
