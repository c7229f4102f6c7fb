"""MLflow's and the hub's credentials never travel with a job: a password in the tracking URI, MLflow's
token and HF_TOKEN, given the documented way (the URI or the variables on the submitting machine, the
Kubernetes Secret the Ray pods mount on a stack), appear in no entrypoint, job metadata,
runtime_env, uploaded file, log line, report.json or MLflow param, tag or artifact; the job reads them
from the Secret's files; the Ray pods mount it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.config import StackConfig
from infra.raycluster import build_raycluster
from workloads.client import submit
from workloads.local import run as local
from workloads.client import tracking as client_tracking
from workloads.client.report import write_report
from workloads.launch.credentials import CREDENTIAL_NAMES, CREDENTIALS_DIR, CREDENTIALS_SECRET, load_credentials
from workloads.train.config import TrainConfig

PASSWORD, TOKEN, HF = "pw-Zq8x!secret", "mlflow-tok-7f3a", "hf_tok_91bd"
SECRETS = (PASSWORD, TOKEN, HF)
URI = f"https://alice:{PASSWORD.replace('!', '%21')}@mlflow.example.com/"


@pytest.fixture
def credentials_here(monkeypatch):
    """The submitting machine as the docs describe it: the tracker's URI (with its password), MLflow's
    token and the hub's token in the environment."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", URI)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.setenv("HF_TOKEN", HF)


class _JobsApi:
    """The Jobs API's side of a submission: what the cluster stores and shows to whoever lists jobs,
    and every file of the uploaded working_dir."""

    def __init__(self) -> None:
        self.submitted: dict = {}
        self.uploaded = ""

    def list_jobs(self):
        return []

    def submit_job(self, **request):
        self.submitted = request
        folder = Path(request["runtime_env"]["working_dir"])
        self.uploaded = "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())
        return request["submission_id"]


def test_a_submission_carries_no_credential_and_says_where_the_job_finds_them(credentials_here, monkeypatch, capsys):
    api = _JobsApi()
    monkeypatch.setattr(submit, "client_factory", lambda conn: lambda: api)
    code = submit.main("submit", ["--address", "http://127.0.0.1:8265", "--no-follow", "--preset", "demo-cpu",
                                  "--storage-path", "/tmp/runs", "--run-name", "r1"])
    out, err = capsys.readouterr()
    assert code == submit.EXIT_OK and api.submitted
    stored = json.dumps({k: api.submitted[k] for k in ("entrypoint", "runtime_env", "metadata")})
    for secret in SECRETS:
        assert secret not in stored and secret not in api.uploaded and secret not in out + err
    assert PASSWORD.replace("!", "%21") not in stored
    # The job still logs to the tracker, at the URI without its credentials.
    train = json.loads(api.submitted["entrypoint"].split("--config-json ", 1)[1].split(" --run-name")[0].strip("'"))
    assert train["tracking"]["uri"] == "https://mlflow.example.com/"
    note = " ".join(out.split())
    names = "HF_TOKEN, MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME"
    assert f"{names} stay on this machine" in note
    assert f"Kubernetes Secret {CREDENTIALS_SECRET}" in note


def test_credentials_in_a_uri_the_user_set_are_removed_too():
    train = {"tracking": {"uri": URI}}
    assert client_tracking.with_tracking(train, uri="", run_name="r")["tracking"]["uri"] == "https://mlflow.example.com/"
    assert client_tracking.split_credentials(URI) == ("https://mlflow.example.com/", {
        "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": PASSWORD})
    assert client_tracking.split_credentials("arn:aws:sagemaker:us-west-2:1:mlflow-tracking-server/x") == (
        "arn:aws:sagemaker:us-west-2:1:mlflow-tracking-server/x", {})


def test_a_local_runs_report_params_tags_artifacts_and_log_lines_hold_no_credential(
        credentials_here, tmp_path, capsys):
    from test_tracking import ScriptedSink, start

    args = SimpleNamespace(no_tracking=False, runs_dir=tmp_path)
    base = TrainConfig.from_dict(submit._train_config(SimpleNamespace(config=None, set=[]), expect="any",
                                                      preset_name="demo-cpu")).to_dict()
    train, uri = local.local_tracking(base, args, run_name="demo-1", console=submit.Console(file=None))
    clean_uri, moved = client_tracking.split_credentials(uri)
    assert moved == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    # What the job logs to MLflow, from the config it receives.
    sink, said = ScriptedSink(), []
    tracker = start(TrainConfig.from_dict(train), sink, said=said)
    tracker.finish({"steps_done": 0, "resumed_from_step": 0})
    report, _ = write_report(tmp_path, records=[{"step": 1, "loss": 1.0}],
                             summary=_summary(), meta={"config": train}, final=None)
    logged = json.dumps([list(map(str, call)) for call in sink.calls]) + "\n".join(said)
    for secret in (*SECRETS, PASSWORD.replace("!", "%21")):
        assert secret not in report.read_text() and secret not in logged
    assert clean_uri == "https://mlflow.example.com/"
    # The local cluster's processes get the URI's credentials in their environment instead.
    import os

    with local.environment_with(moved):
        assert os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def _summary():
    from workloads.client.report import summarize

    return summarize([{"step": 1, "loss": 1.0, "tokens_per_s_per_device": 1.0, "step_time_s": 1.0}], final=None)


def test_the_job_reads_its_credentials_from_the_mounted_secrets_files(tmp_path):
    for name, value in (("MLFLOW_TRACKING_PASSWORD", PASSWORD + "\n"), ("HF_TOKEN", HF), ("OTHER", "x")):
        (tmp_path / name).write_text(value)
    environ = {"HF_TOKEN": "mine"}
    assert load_credentials(folder=tmp_path, environ=environ) == ["MLFLOW_TRACKING_PASSWORD"]
    assert environ == {"HF_TOKEN": "mine", "MLFLOW_TRACKING_PASSWORD": PASSWORD}  # a variable set wins
    assert load_credentials(folder=tmp_path / "absent", environ={}) == []


@pytest.mark.parametrize("capacity", ["on-demand", "spot"])
def test_every_ray_pod_mounts_the_credentials_secret_and_no_variable_carries_one(capacity):
    cfg = StackConfig(region="us-west-2", gpu_availability_zone="us-west-2a", gpu_availability_zone_id="usw2-az1",
                      gpu_capacity_type=capacity)
    spec = build_raycluster(cfg)["spec"]
    for template in (spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CREDENTIALS_DIR]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {"secretName": CREDENTIALS_SECRET, "optional": True,
                                                    "defaultMode": 0o444}
        names = {e["name"] for e in container["env"]}
        assert not names & set(CREDENTIAL_NAMES) and "envFrom" not in container
