"""How the commands set the tracker up: the URI's order, the experiment, run name and tags a job's
config carries, the packages its runtime_env installs, the stack's tracking outputs, the run named
in a job's log, and how a user is told to open it."""

from __future__ import annotations

import argparse
import io
import tomllib
from pathlib import Path

import pytest
from ray.runtime_env import RuntimeEnv
from rich.console import Console

from workloads.client import cluster, submit, tracking
from workloads.client.follow import LogPrinter
from workloads.local.run import local_tracking
from workloads.train.config import TrainConfig, preset

REPO_ROOT = Path(__file__).resolve().parent.parent
ARN = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/ray-eks-us-west-2"
LOG = (
    "(RayTrainWorker pid=77, ip=127.0.0.2) [tracking] {\"run_id\":\"abc123\",\"experiment\":\"local\","
    "\"experiment_id\":\"1\",\"uri\":\"sqlite:////x/runs/mlflow/mlflow.db\",\"continued\":false}\n"
    "(RayTrainWorker pid=77, ip=127.0.0.2) [tracking] warning: http://h:1 did not answer (refused); training "
    "goes on, records are kept (up to 10000) and sent when it answers\n"
)


def test_the_uri_is_the_users_then_the_environments_then_the_stacks_then_the_local_store():
    train = preset("demo-cpu").to_dict()
    assert tracking.resolve_uri(train, stack_uri=ARN, local_default="sqlite:///l.db", environ={}) == ARN
    assert tracking.resolve_uri(train, stack_uri=None, local_default="sqlite:///l.db", environ={}) == "sqlite:///l.db"
    assert tracking.resolve_uri(train, stack_uri=ARN, environ={"MLFLOW_TRACKING_URI": "http://env:5000"}) == \
        "http://env:5000"
    mine = {**train, "tracking": {**train["tracking"], "uri": "http://mine:5000"}}
    assert tracking.resolve_uri(mine, stack_uri=ARN, environ={"MLFLOW_TRACKING_URI": "http://env:5000"}) == \
        "http://mine:5000"
    assert tracking.resolve_uri(train, environ={}) == ""


def test_the_config_gets_the_tracker_where_the_user_set_nothing():
    train = preset("demo-cpu").to_dict()
    train["tracking"].update(experiment="mine", tags={"stack": "my-label"})
    filled = tracking.with_tracking(train, uri=ARN, run_name="qwen-1", experiment="us-west-2",
                                    tags={"stack": "us-west-2", "image": "img:v1.1"})
    cfg = TrainConfig.from_dict(filled)  # still a valid config
    assert (cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.run_name) == (ARN, "mine", "qwen-1")
    assert cfg.tracking.tags == {"stack": "my-label", "image": "img:v1.1"}
    assert train["tracking"]["uri"] == ""  # the caller's dict is left alone


def test_client_tags_name_the_commit_and_with_a_stack_its_name_and_image():
    tags = tracking.client_tags(stack="us-west-2")
    assert tags["stack"] == "us-west-2"
    assert tags["image"] == "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
    if (REPO_ROOT / ".git").exists():  # a checkout, not an unpacked archive
        assert len(tags["mlflow.source.git.commit"].removesuffix("-dirty")) == 40
    assert "stack" not in tracking.client_tags()
    assert tracking.stack_image("no-such-stack") is None


def test_a_tracked_gpu_job_installs_mlflow_and_the_sagemaker_plugin_pinned_as_pyproject_says(tmp_path):
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert list(submit.TRACKING_PACKAGES) == pyproject["project"]["optional-dependencies"]["tracking"]
    assert "mlflow==3.17.2" in pyproject["project"]["optional-dependencies"]["dev"]
    env = submit.runtime_env(working_dir="/w", expect="efa", tracking_uri=ARN)
    assert env["pip"] == {"packages": [*submit.GPU_PACKAGES, "mlflow-skinny==3.17.2", "sagemaker-mlflow==0.5.0"],
                          "pip_check": False}
    parsed = RuntimeEnv(**{**env, "working_dir": str(tmp_path)})  # Ray's own parser takes it
    assert parsed.pip_config()["packages"] == env["pip"]["packages"]
    # Untracked, or tracked from a CPU cluster to a server of its own: as before.
    assert submit.runtime_env(working_dir="/w", expect="efa")["pip"]["packages"] == list(submit.GPU_PACKAGES)
    assert "pip" not in submit.runtime_env(working_dir="/w", expect="any", tracking_uri="http://h:5000")
    # A SageMaker ARN needs the plugin on any cluster; --offline installs nothing.
    assert submit.runtime_env(working_dir="/w", expect="any", tracking_uri=ARN)["pip"]["packages"] == list(
        submit.TRACKING_PACKAGES)
    assert "pip" not in submit.runtime_env(working_dir="/w", expect="efa", tracking_uri=ARN, install=False)


def test_the_submission_takes_the_uri_from_the_jobs_config():
    train = tracking.with_tracking(preset("demo-cpu").to_dict(), uri=ARN, run_name="r")
    sub = submit.build_submission(train=train, run_name="r", storage_path="s3://b/p", max_failures=0,
                                  working_dir="/w", expect="efa")
    assert "sagemaker-mlflow==0.5.0" in sub.runtime_env["pip"]["packages"]
    assert ARN in sub.entrypoint


def test_the_stacks_tracking_server_is_read_from_its_outputs_when_it_has_one():
    from test_submit import OUTPUTS

    plain = cluster.stack_outputs_from_json(OUTPUTS, stack="s")
    assert plain.mlflow_tracking_server_arn is None and plain.mlflow_ui_url is None
    tracked = cluster.stack_outputs_from_json(
        {**OUTPUTS, "mlflowTrackingServerArn": ARN, "mlflowUiUrl": "https://t-abc.us-west-2.experiments.sagemaker.aws"},
        stack="s")
    assert tracked.mlflow_tracking_server_arn == ARN
    assert tracked.mlflow_ui_url == "https://t-abc.us-west-2.experiments.sagemaker.aws"


def test_the_run_a_job_logged_to_is_read_from_its_log():
    run = tracking.tracked_run(LOG)
    assert run == tracking.TrackedRun(run_id="abc123", experiment="local", experiment_id="1",
                                      uri="sqlite:////x/runs/mlflow/mlflow.db")
    assert tracking.tracked_run("no tracker here\n") is None


def test_the_log_printer_shows_the_tracker_run_and_its_warnings_even_when_quiet():
    out = io.StringIO()
    printer = LogPrinter(console=Console(file=out, width=300), quiet=True)
    printer.feed(LOG + LOG)  # Ray forwards worker lines twice
    printer.flush()
    lines = out.getvalue().splitlines()
    assert lines == ["tracking run abc123 in experiment local at sqlite:////x/runs/mlflow/mlflow.db",
                     "tracking warning: http://h:1 did not answer (refused); training goes on, records are kept "
                     "(up to 10000) and sent when it answers"]


def test_a_local_store_is_opened_with_one_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = tracking.local_store_uri(Path("runs"))
    assert uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow' / 'mlflow.db'}" and (tmp_path / "runs" / "mlflow").is_dir()
    command = tracking.ui_command(uri)
    assert command.endswith("mlflow ui --backend-store-uri sqlite:///runs/mlflow/mlflow.db --port 5000")
    run = tracking.TrackedRun(run_id="abc", experiment="local", experiment_id="1", uri=uri)
    assert tracking.where_to_look(run, uri=uri) == (
        f"run abc in experiment local; open the UI: {command} (then http://127.0.0.1:5000)")
    assert tracking.where_to_look(run, uri="http://mlflow.example:5000/") == (
        "run abc in experiment local: http://mlflow.example:5000/#/experiments/1/runs/abc")
    assert "create-presigned-mlflow-tracking-server-url --tracking-server-name ray-eks-us-west-2" in \
        tracking.where_to_look(run, uri=ARN)


@pytest.mark.parametrize("argv, env, want", [
    ([], {}, "store"),
    (["--no-tracking"], {}, ""),
    ([], {"MLFLOW_TRACKING_URI": "http://env:5000"}, "http://env:5000"),
])
def test_a_local_run_tracks_into_the_store_under_runs_unless_told_otherwise(argv, env, want, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = argparse.Namespace(no_tracking="--no-tracking" in argv, runs_dir=tmp_path / "runs")
    train, uri = local_tracking(preset("demo-cpu").to_dict(), args, run_name="demo-cpu-1", console=Console())
    if want == "store":
        want = f"sqlite:///{tmp_path / 'runs' / 'mlflow' / 'mlflow.db'}"
    assert uri == want and train["tracking"]["uri"] == (want or "off")
    if want:
        assert train["tracking"]["run_name"] == "demo-cpu-1" and "mlflow.source.git.commit" in train["tracking"]["tags"]


def test_a_new_local_store_keeps_the_default_experiments_artifacts_beside_it(tmp_path, monkeypatch):
    """The store was made by rank 0 in the job's temporary working folder: its "Default" experiment
    pointed at ./mlruns there, deleted with the job."""
    from mlflow import MlflowClient

    from workloads.client.tracking import local_store_uri

    monkeypatch.chdir(tmp_path)
    uri = local_store_uri(tmp_path / "runs")
    default = MlflowClient(tracking_uri=uri).get_experiment("0")
    assert default.name == "Default"
    assert default.artifact_location == (tmp_path / "runs" / "mlflow" / "artifacts" / "0").as_uri()
    assert local_store_uri(tmp_path / "runs") == uri  # an existing store is left as it is


def test_sigterm_stops_a_local_run_as_ctrl_c_does(monkeypatch, capsys):
    """tests/test_local_demo.py stops a demo with Ctrl-C; SIGTERM (a CI job's end) takes the same way out."""
    import os
    import signal
    import time

    from workloads.local import run as local

    def terminated(args, console):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(local, "run_local", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert local.main("run", ["--local"]) == 143  # 128 + SIGTERM, as a shell says a signal ended a process
    assert "interrupted: the local Ray cluster was stopped" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
