"""Local runs as folders of the project's runs/: named (`--run-name`), recorded from their start
(run.json), listed (`python -m workloads runs`), resumed by name from their latest checkpoint, their
status kept through a failure or Ctrl-C; and `python -m workloads chat` finds a run's model by name.
The cluster's part is replaced here: tests/test_local_demo.py runs it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from workloads.client import runs
from workloads.local import run as local
from workloads.client.chat import model_folder

REPO = Path(__file__).resolve().parent.parent
CHAT = {"messages": [{"role": "user", "content": "What colour is the sky?"}, {"role": "assistant", "content": "Blue."}]}


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    args = local._arg_parser().parse_args(["--local", "--no-tracking", "--out", str(tmp_path / "runs"), *argv])
    return args


@pytest.fixture
def trains(monkeypatch, tmp_path):
    """Runs `run --local` up to its cluster; returns the calls the cluster's part got, which the
    test makes succeed, fail or be interrupted (`outcome`)."""
    (tmp_path / "chats.jsonl").write_text(json.dumps(CHAT) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local.demo, "write_demo_inputs", lambda inputs: None)  # no toy model needed here
    calls: list[dict] = []
    outcome = {"do": lambda: 0}

    def cluster_part(args, console, **kwargs):
        calls.append(kwargs)
        return outcome["do"]()

    monkeypatch.setattr(local, "_train_on_local_cluster", cluster_part)
    return calls, outcome


def test_runs_go_under_the_project_wherever_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert local._arg_parser().parse_args(["--local"]).runs_dir == REPO / "runs" == runs.RUNS_DIR
    assert local._arg_parser().parse_args(["--local", "--out", "elsewhere"]).runs_dir == Path("elsewhere")


def test_a_named_run_is_recorded_resumed_by_name_and_refused_when_done(trains, tmp_path):
    calls, outcome = trains
    args = _args(tmp_path, "--run-name", "my-ft", "--set", "data.path=chats.jsonl", "--set", "steps=50")
    assert local.run_local(args, Console(quiet=True)) == 0
    run_dir = tmp_path / "runs" / "my-ft"
    record = runs.read_run(run_dir)
    assert (record["name"], record["status"], record["resumed"]) == ("my-ft", "succeeded", 0)
    assert calls[-1]["run_name"] == "my-ft" and calls[-1]["run_dir"] == run_dir
    assert record["train"]["steps"] == 50 and record["train"]["data"]["path"] == str(tmp_path / "chats.jsonl")
    # Its checkpoint at step 50: resuming it needs more steps, and keeps its config and name.
    progress = run_dir / "checkpoints" / "my-ft" / "checkpoint_1"
    progress.mkdir(parents=True)
    (progress / "progress.json").write_text(json.dumps({"step": 50, "data_position": 400}))
    with pytest.raises(ValueError, match="run my-ft has trained its 50 steps: --set steps=N"):
        local.run_local(_args(tmp_path, "--run-name", "my-ft"), Console(quiet=True))
    assert local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "steps=80"), Console(quiet=True)) == 0
    resumed = calls[-1]
    assert resumed["run_name"] == "my-ft" and resumed["train"]["steps"] == 80
    assert resumed["train"]["data"] == record["train"]["data"] and resumed["inputs"].model is None
    assert runs.read_run(run_dir)["resumed"] == 1
    # Interrupted, or failed: said so in its record.
    def interrupted():
        raise KeyboardInterrupt
    outcome["do"] = interrupted
    with pytest.raises(KeyboardInterrupt):
        local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "steps=90"), Console(quiet=True))
    assert runs.read_run(run_dir)["status"] == "interrupted"
    outcome["do"] = lambda: 1
    assert local.run_local(_args(tmp_path, "--run-name", "other", "--set", "data.path=chats.jsonl"),
                           Console(quiet=True)) == 1
    assert runs.read_run(tmp_path / "runs" / "other")["status"] == "failed"


def test_a_run_name_is_a_folder_name_and_a_folder_without_a_run_is_left_alone(trains, tmp_path):
    with pytest.raises(ValueError, match="--run-name '../x': use letters, digits"):
        local.run_local(_args(tmp_path, "--run-name", "../x"), Console(quiet=True))
    (tmp_path / "runs" / "notes").mkdir(parents=True)
    (tmp_path / "runs" / "notes" / "todo.txt").write_text("x")
    with pytest.raises(ValueError, match="holds no run to resume"):
        local.run_local(_args(tmp_path, "--run-name", "notes"), Console(quiet=True))


def _run_folder(root: Path, name: str, *, status: str, steps: int, done: int | None, model: bool,
                record: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if record:
        runs.write_run(folder, {"name": name, "status": status, "train": {"steps": steps}})
    if done is not None and status in ("succeeded", "failed"):
        summary = {"steps": done, "first_loss": 6.2, "last_loss": 0.04, "eval_loss": 0.05}
        (folder / "report.json").write_text(json.dumps({"status": status.upper(), "config": {"steps": steps},
                                                        "summary": summary}))
    elif done is not None:
        (folder / "checkpoints" / name / "checkpoint_1").mkdir(parents=True)
        (folder / "checkpoints" / name / "checkpoint_1" / "progress.json").write_text(json.dumps({"step": done}))
    if model:
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text("{}")
    os.utime(folder, (len(list(root.iterdir())), len(list(root.iterdir()))))
    return folder


def test_the_runs_command_lists_each_local_run(tmp_path):
    root = tmp_path / "runs"
    _run_folder(root, "20261204-151716", status="succeeded", steps=200, done=200, model=True, record=False)
    _run_folder(root, "my-ft", status="interrupted", steps=400, done=100, model=False)
    _run_folder(root, "broken", status="failed", steps=200, done=None, model=False)
    (root / "mlflow").mkdir()
    done = subprocess.run([sys.executable, "-m", "workloads", "runs", "--runs-dir", str(root)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    lines = [" ".join(line.split()) for line in done.stdout.splitlines()]
    assert lines[:4] == [
        "NAME STATUS STEPS LOSS MODEL",
        "20261204-151716 succeeded 200/200 6.2000 -> 0.0400 (eval 0.0500) runs/20261204-151716/model",
        "my-ft interrupted 100/400 - -",
        "broken failed 0/200 - -",
    ]
    assert "python -m workloads chat NAME" in done.stdout


def test_chat_finds_a_runs_model_by_name_folder_or_model_folder(tmp_path):
    root = tmp_path / "runs"
    finished = _run_folder(root, "my-ft", status="succeeded", steps=2, done=2, model=True)
    assert model_folder("my-ft", runs_dir=root) == finished / "model"
    assert model_folder(str(finished), runs_dir=root) == finished / "model"
    assert model_folder(str(finished / "model"), runs_dir=root) == finished / "model"
    stopped = _run_folder(root, "stopped", status="interrupted", steps=9, done=3, model=False)
    with pytest.raises(ValueError, match="has no exported model/ .*python -m workloads export"):
        model_folder("stopped", runs_dir=root)
    with pytest.raises(ValueError, match="'nosuch' is neither a run of"):
        model_folder("nosuch", runs_dir=root)
    assert stopped.is_dir()
