"""`make demo`'s code path end to end (`python -m workloads run --local` as a subprocess): a local Ray
cluster in the RayCluster's shape (a head that runs no training worker, two worker nodes), the real
loop, a falling loss, the post-run checks of a cloud run, the run report, the run in the local MLflow
store (read back with MLflow's client), and no process left behind, also when the demo is stopped
with Ctrl-C, which ends its tracker run KILLED."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupts import sigint_at_default

from workloads.client.runs import NOT_RUNS

pytestmark = pytest.mark.slow


def _pgid(pid: int):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _ppid(pid: int):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _in_groups(groups: set[int]) -> set[int]:
    return {pid for pid in _pids() if _pgid(pid) in groups}


def _read_until(proc: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"the demo ended before printing {marker!r}:\n{''.join(lines)}")


def _rest_of_output(proc: subprocess.Popen, *, timeout_s: float, runs_dir: Path) -> str:
    """The demo's output to its end; one that does not end in time fails with its last output and
    the tail of each node's log (a failure of a full test run is found from what it printed)."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0] or ""  # all of it: communicate keeps what it read before the timeout
        logs = "".join(f"\n--- {log}, last 30 lines\n" + "".join(log.read_text(errors="replace").splitlines(True)[-30:])
                       for log in sorted(runs_dir.glob("*/ray/*.log")))
        raise AssertionError(f"the demo did not end in {timeout_s:g} s; its output:\n{out[-6000:]}{logs}") from None


class Demos:
    """The demos a test starts (`run --local` subprocesses) and their Ray nodes' process groups."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = runs_dir
        self.started: list[subprocess.Popen] = []
        self.groups: set[int] = set()

    def start(self, *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workloads", "run", "--local", "--runs-dir", str(self.runs_dir), *extra],
            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=sigint_at_default,  # so that a Ctrl-C test's SIGINT is not lost
            # The evaluation after training (lm-eval, datasets) reads only the run's files: nothing from the hub.
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        )
        self.started.append(proc)
        return proc

    def node_groups(self, proc: subprocess.Popen, *, workers: int = 2) -> set[int]:
        """The process groups of the demo's Ray nodes (the head and its worker nodes): each `ray
        start` is a child leading its own group."""
        groups = {pid for pid in _pids() if _ppid(pid) == proc.pid and _pgid(pid) == pid}
        assert len(groups) == 1 + workers, groups
        self.groups |= groups
        return groups

    def kill_what_is_left(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


@pytest.fixture()
def demos(tmp_path):
    """Whatever a test's outcome, nothing of its demos is left running: a demo killed because it did
    not end leaves its nodes behind, and they trained on beside the rest of a full suite, which then
    took 1,269 s instead of about 800."""
    started = Demos(tmp_path)
    yield started
    started.kill_what_is_left()


def _assert_all_stopped(groups: set[int]) -> None:
    deadline = time.monotonic() + 10
    while _in_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _in_groups(groups)  # the nodes, and every process they started in their groups


def test_the_demo_trains_on_two_nodes_writes_its_report_and_stops_everything(tmp_path, demos):
    proc = demos.start("--set", "steps=20", "--set", "log_every=5", "--set", "eval_every=10",
                       "--set", "evaluate.max_new_tokens=6")
    head = _read_until(proc, "Jobs API at")
    groups = demos.node_groups(proc)
    out = "".join(head) + _rest_of_output(proc, timeout_s=300, runs_dir=tmp_path)
    assert proc.returncode == 0, out
    # The head joined the cluster but hosts no worker: the plan, the ranks and the check agree on 2.
    assert "2 CPU workers on 2 node(s)" in out and "train step 20/20" in " ".join(out.split())
    assert "method full fine-tune: trainable params: " in out and "trainable%: 100.0000" in out
    assert "placement check passed: 2 ranks trained on 2 node(s), as planned" in out
    assert "on 2 node(s)" in out.split("summary", 1)[1]

    (run_dir,) = [p for p in tmp_path.iterdir() if p.name not in NOT_RUNS]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "SUCCEEDED" and report["cluster"]["worker_nodes"] == 2
    assert report["trained_on_nodes"] == 2 and report["summary"]["nodes"] == 2
    assert [c["passed"] for c in report["checks"]] == [True, True, True]
    _assert_evaluated(run_dir, report, out)
    assert [r["step"] for r in report["steps"]] == [5, 10, 15, 20]
    summary = report["summary"]
    assert summary["last_loss"] < 0.8 * summary["first_loss"]
    assert f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" in out
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    job_log = (run_dir / "job.log").read_text()
    assert "\x1b[" not in job_log  # no terminal colour codes
    assert [line.split("[train] ", 1)[1][:10] for line in job_log.splitlines() if "[train] " in line] == [
        '{"step":5,', '{"step":10', '{"step":15', '{"step":20']  # each step once
    _assert_all_stopped(groups)
    # The demo fine-tunes a toy pretrained model on toy chats (sent with the job), evaluates on held-out
    # chats, exports the model to runs/<stamp>/model/, loads it back and asks it a question.
    assert report["config"]["model"]["name_or_path"] == str(run_dir / "base-model")
    assert report["loop_summary"]["data"]["chats"] > 0
    assert [r["step"] for r in report["steps"] if "eval_loss" in r] == [10, 20]
    assert f"(eval {summary['eval_loss']:.4f})" in out
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (run_dir / "model").iterdir()}
    assert "generate What is the capital of France? -> " in out
    assert json.loads((run_dir / "run.json").read_text())["status"] == "succeeded"  # `runs` lists it so
    assert f"python -m workloads chat {run_dir.name}" in out
    _assert_tracked(tmp_path, run_dir, report, out)


def _assert_evaluated(run_dir: Path, report: dict, out: str) -> None:
    """The stage after training: lm-eval on the run's 60 held-out chats, the tuned model and its base
    each a Ray task on its own worker node, the result where the user looks."""
    evaluation = report["evaluation"]
    (row,) = evaluation["rows"]
    assert (row["task"], row["metric"], row["samples"]) == ("heldout", "exact_match", 60)
    assert {u["role"]: u["node"] for u in evaluation["units"]}.keys() == {"tuned", "base"}
    assert {u["node"] for u in evaluation["units"]} == {"127.0.0.2", "127.0.0.3"}  # spread over the nodes
    assert "evaluate: 2/2 " in out and "evaluation: heldout:exact_match" in out
    assert (run_dir / "evaluation.png").read_bytes()[:4] == b"\x89PNG"
    (final,) = {p.parent for p in run_dir.glob("checkpoints/*/*/evaluation.json")}
    assert json.loads((final / "evaluation.json").read_text())["rows"] == evaluation["rows"]
    assert "| heldout | exact_match |" in (run_dir / "model" / "README.md").read_text()


def _assert_tracked(runs_dir: Path, run_dir: Path, report: dict, out: str) -> None:
    """The run is in runs/mlflow with every step's metrics, its report, plot and model, and the demo
    said how to open the UI on it."""
    from mlflow import MlflowClient

    store = f"sqlite:///{runs_dir / 'mlflow' / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {store} --port 5000" in " ".join(out.split())
    mlflow = MlflowClient(tracking_uri=store)
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("local").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name  # one name per run
    assert run_dir.name.startswith("demo-cpu-") and f"run {run_dir.name}" in out
    assert f"tracking run {run.info.run_id} in experiment local;" in " ".join(out.split())
    assert [(m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, "train_loss")] == [
        (r["step"], r["loss"]) for r in report["steps"]]
    assert [m.step for m in mlflow.get_metric_history(run.info.run_id, "eval_loss")] == [10, 20]
    assert run.data.params["steps"] == "20" and run.data.params["model.name_or_path"] == str(run_dir / "base-model")
    assert run.data.tags["model_location"] == str(run_dir / "model")
    assert run.data.tags["checkpoint"].startswith(str(run_dir / "checkpoints"))
    assert {"summary.json", "report.json", "loss.png", "evaluation.json", "evaluation.png"} <= {
        a.path for a in mlflow.list_artifacts(run.info.run_id)}
    assert run.data.metrics["eval/heldout/exact_match/tuned"] == report["evaluation"]["rows"][0]["tuned"]
    # No experiment of the store points at a folder that is gone (its Default one did: a rank's temp folder).
    default = mlflow.get_experiment("0")
    assert default.artifact_location == (runs_dir / "mlflow" / "artifacts" / "0").as_uri()


NOISE = ("Traceback", "Exception ignored", "Unclosed client session", "Event loop is closed", "aclose()",
         "Task was destroyed")
"""What an interrupted follow printed around the right lines: the log stream's generator, session and
event loop closed after the loop."""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_demo_its_cluster_and_its_tracker_run(tmp_path, demos, sig):
    """Ctrl-C once the job trains; SIGTERM (which takes the same way out, workloads/client/interrupts.py)
    as soon as the job's driver has planned its workers, while they start: a run stopped then, and
    one that costs the suite a minute less than waiting for training again."""
    # Steps enough to be training still when the interruption comes (the demo's 200 take seconds);
    # one worker node: what is stopped is the same, and the suite's two cores start one node less.
    proc = demos.start("--nodes", "1", "--set", "steps=100000", "--set", "checkpoint_every=0")
    _read_until(proc, "Jobs API at")
    groups = demos.node_groups(proc, workers=1)
    run_id = None
    if sig == signal.SIGINT:
        opened = _read_until(proc, " in experiment local ")[-1]  # the job trains, and its tracker run is open
        run_id = re.search(r"tracking run (\S+) in experiment", opened).group(1)
    else:
        _read_until(proc, "starting the workers")
    proc.send_signal(sig)  # Ctrl-C, or the system's SIGTERM
    out = _rest_of_output(proc, timeout_s=90, runs_dir=tmp_path)
    assert proc.returncode == 128 + sig, out  # 130, 143: as a shell says a signal ended a process
    assert "the local Ray cluster was stopped" in out
    assert [noise for noise in NOISE if noise in out] == [], out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name not in NOT_RUNS]
    assert f"the job's log so far is in {run_dir / 'job.log'}" in " ".join(out.split()).replace("\n", "")
    assert "Running entrypoint for job demo-cpu-" in (run_dir / "job.log").read_text()  # <run name>-job1
    # The run says it was interrupted, and how to go on with it.
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert f"python -m workloads run --run-name {run_dir.name} resumes it" in " ".join(out.split())
    _assert_all_stopped(groups)
    if run_id is None:  # stopped before the job's rank 0 opened a tracker run
        return
    # Its tracker run ended KILLED: neither left RUNNING, nor FAILED as its ranks and the driver saw
    # the worker nodes go (the demo ends it once its cluster is down).
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert MlflowClient(tracking_uri=store).get_run(run_id).info.status == "KILLED"
