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
        "NAME STATUS STEPS LOSS METHOD MODEL",
        "20261204-151716 succeeded 200/200 6.2000 -> 0.0400 (eval 0.0500) full runs/20261204-151716/model",
        "my-ft interrupted 100/400 - full -",
        "broken failed 0/200 - full -",
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


def test_a_run_without_a_name_has_one_name_for_its_folder_its_job_and_every_command(trains, tmp_path):
    """The demo printed `run demo-cpu-<time>` and titled its plot so, `run --help` promised
    `<preset>-<UTC time>`, but the folder was `<time>`: `chat demo-cpu-<time>` found nothing."""
    calls, _ = trains
    assert local.run_local(_args(tmp_path, "--set", "data.path=chats.jsonl"), Console(quiet=True)) == 0
    name, run_dir = calls[-1]["run_name"], calls[-1]["run_dir"]
    assert name.startswith("demo-cpu-") and run_dir == tmp_path / "runs" / name
    assert runs.read_run(run_dir)["name"] == name
    (run_dir / "model").mkdir()
    (run_dir / "model" / "config.json").write_text("{}")
    assert model_folder(name, runs_dir=tmp_path / "runs") == run_dir / "model"


def test_a_run_made_before_its_folder_took_its_name_is_found_by_its_name(tmp_path):
    root = tmp_path / "runs"
    old = _run_folder(root, "20261205-130115", status="succeeded", steps=2, done=2, model=True, record=False)
    runs.write_run(old, {"name": "demo-cpu-20261205-130115", "status": "succeeded", "train": {"steps": 2}})
    assert runs.find_run(root, "demo-cpu-20261205-130115") == old
    assert runs.find_run(root, "20261205-130115") == old
    assert runs.find_run(root, "nosuch") is None
    assert model_folder("demo-cpu-20261205-130115", runs_dir=root) == old / "model"


def test_export_takes_a_run_name_as_chat_does_and_names_the_run_meant(tmp_path, monkeypatch):
    from workloads.client import export

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    finished = _run_folder(root, "my-ft", status="succeeded", steps=2, done=2, model=True)

    def uri(*argv: str) -> str:
        return export.run_uri(export._arg_parser().parse_args([*argv, "--runs-dir", str(root)]))

    assert uri("my-ft") == str(finished)
    assert uri(str(finished)) == str(finished)
    assert uri("s3://bucket/prefix/my-ft") == "s3://bucket/prefix/my-ft"
    with pytest.raises(ValueError, match=r"'my-fr' is neither a folder here nor a run of .*runs; did you mean "
                                         r"my-ft \(runs/my-ft\)\?"):
        uri("my-fr")


def test_runs_and_the_plot_title_say_a_lora_run_is_lora_with_its_rank_and_trainable_share(tmp_path):
    root = tmp_path / "runs"
    lora = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": []}
    folder = _run_folder(root, "my-lora", status="succeeded", steps=20, done=20, model=True)
    report = json.loads((folder / "report.json").read_text())
    report["loop_summary"] = {"method": "lora", "lora": lora, "trained_params": 1_089_536, "params": 495_122_304}
    (folder / "report.json").write_text(json.dumps(report))
    stopped = _run_folder(root, "lora-stopped", status="interrupted", steps=20, done=5, model=False)
    runs.write_run(stopped, {"name": "lora-stopped", "status": "interrupted",
                             "train": {"steps": 20, "method": "lora", "lora": lora}})
    listed = {run.name: run.method for run in runs.local_runs(root)}
    assert listed == {"my-lora": "lora r16 (0.22% trained)", "lora-stopped": "lora r16"}
    train = {"model": {"name_or_path": str(folder / "base-model")}, "data": {"kind": "synthetic"},
             "method": "lora", "lora": lora}
    title = local.run_title("my-lora", train, nodes=2, final=report["loop_summary"])
    assert title == ("my-lora: toy model on synthetic tokens, LoRA rank 16 (alpha 32): 1,089,536 of 495,122,304 "
                     "parameters trained (0.22%), 2 local worker node(s)")
    assert "full fine-tune" in local.run_title("r", {**train, "method": "full"}, nodes=2, final=None)


def test_resuming_says_what_changed_and_refuses_a_change_that_breaks_the_resume_unless_forced(trains, tmp_path):
    """Resuming with another data.path was accepted without a word; another seq_len or tokenizer
    makes the checkpoint's data position count other rows."""
    calls, _ = trains
    (tmp_path / "more.jsonl").write_text(json.dumps(CHAT) + "\n")
    assert local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "data.path=chats.jsonl", "--set",
                                 "steps=50"), Console(quiet=True)) == 0
    checkpoint = tmp_path / "runs" / "my-ft" / "checkpoints" / "my-ft" / "checkpoint_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "progress.json").write_text(json.dumps({"step": 50, "data_position": 800}))

    console = Console(record=True, width=400)
    assert local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "steps=80", "--set",
                                 "data.path=more.jsonl"), console) == 0
    said = console.export_text()
    assert "resuming with " in said and "steps 50 -> 80" in said
    assert "the run goes on at its checkpoint's data position" in said
    assert f"data.path {tmp_path / 'chats.jsonl'} -> more.jsonl" in said
    assert calls[-1]["train"]["data"]["path"].endswith("more.jsonl")

    for change, why in (("seq_len=128", "seq_len 64 -> 128"), ("data.tokenizer=Qwen/Qwen2.5-1.5B",
                                                                  "data.tokenizer")):
        with pytest.raises(ValueError, match=rf"{why}.*--force-resume"):
            local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "steps=90", "--set", change),
                            Console(quiet=True))
    console = Console(record=True, width=400)
    assert local.run_local(_args(tmp_path, "--run-name", "my-ft", "--set", "steps=90", "--set", "seq_len=128",
                                 "--force-resume"), console) == 0
    assert "seq_len 64 -> 128" in console.export_text() and calls[-1]["train"]["seq_len"] == 128
