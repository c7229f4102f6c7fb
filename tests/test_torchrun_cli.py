"""The torchrun adapter end to end: two gloo ranks launched by torchrun itself, then a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workloads.client.cluster import free_port
from workloads.launch import torchrun


def launch(repo_root, out, *extra: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(free_port())]
    job = ["-m", "workloads.launch.torchrun", "--preset", "demo-cpu", "--out", str(out)]
    job += ["--set", "log_every=2", "--set", "checkpoint_every=2", *extra]
    cmd = launcher + job
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_trains_reports_checkpoints_and_resumes(repo_root, tmp_path):
    first = launch(repo_root, tmp_path, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == 4 and summary["resumed_from_step"] == 0
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 4
    for rank in (0, 1):
        records = [
            json.loads(line)
            for line in (tmp_path / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
        ]
        assert [r["metrics"]["step"] for r in records] == [2, 4]
        assert all(r["checkpoint_dir"] for r in records)
    assert (tmp_path / "checkpoint-0000004" / ".metadata").is_file()
    assert sum(line.startswith("[train] ") for line in first.stdout.splitlines()) == 2

    resumed = launch(repo_root, tmp_path, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps_done"] == 2


def test_a_bad_override_exits_2_before_any_process_group(capsys, tmp_path):
    assert torchrun.main(["--preset", "demo-cpu", "--out", str(tmp_path), "--set", "stepz=3"]) == 2
    assert "error: unknown config key 'stepz'; did you mean 'steps'?" in capsys.readouterr().err


def test_newest_checkpoint_ignores_unfinished_folders(tmp_path):
    for step, done in ((2, True), (4, True), (6, False)):
        folder = tmp_path / f"checkpoint-{step:07d}"
        folder.mkdir()
        if done:
            (folder / ".metadata").write_bytes(b"")
    assert torchrun.newest_checkpoint(tmp_path) == tmp_path / "checkpoint-0000004"
    assert torchrun.newest_checkpoint(tmp_path / "checkpoint-0000006") is None
