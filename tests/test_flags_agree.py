"""The commands' flags follow one convention (README, "Commands and flags"): `plan` and `submit`
assume the same GPU nodes; `submit` and `run`, which run a job, show progress and `--verbose` shows
every log line (`submit --quiet`, the old way to ask for progress only, still works), while `logs
--follow` prints the job's log itself, every line; `run` needs no `--local` (its only mode; the flag
still works); the hint to resume a local run is a whole command."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from workloads.client import plan, runs, submit
from workloads.local import run as local
from workloads.client.outcome import JobOutcome

NO_CLUSTER = "http://127.0.0.1:9"


def test_plan_and_submit_assume_the_same_gpu_nodes(capsys):
    """plan --nodes defaulted to 2 and submit --nodes to 1."""
    assert plan.main("plan", ["--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["nodes"] == plan.DEFAULT_NODES == 2
    code = submit.main("submit", ["--address", NO_CLUSTER, "--instance-type", planned["instance_type"],
                                  "--preset", "qwen2.5-1.5b-24gb", "--storage-path", "/tmp/runs"])
    out = capsys.readouterr().out
    assert code != 0  # nothing answers there; the fit is checked before
    assert f"on {planned['nodes']} x {planned['instance_type']}" in " ".join(out.split())


def _submitted_quiet(monkeypatch, *argv: str) -> bool:
    requests = []

    def follow(conn, request, *, console, on_submitted):
        requests.append(request)
        return JobOutcome(job_id="r-job1", status="SUCCEEDED", reason="")

    monkeypatch.setattr(submit, "submit_and_follow", follow)
    monkeypatch.setattr(submit, "report_outcome", lambda outcome, console: None)
    submit.main("submit", ["--address", "http://127.0.0.1:1", "--preset", "demo-cpu", "--storage-path", "/tmp/r",
                           "--run-name", "r", *argv])
    (request,) = requests
    return request.quiet


def test_submit_shows_progress_unless_verbose_and_quiet_still_works(monkeypatch):
    assert _submitted_quiet(monkeypatch) is True
    assert _submitted_quiet(monkeypatch, "--verbose") is False
    assert _submitted_quiet(monkeypatch, "--quiet") is True


def test_logs_follow_prints_every_line_of_the_log(monkeypatch):
    printers = []
    monkeypatch.setattr(submit, "job_client", lambda conn: object())

    def follow(factory, job_id, printer, **kwargs):
        printers.append(printer)
        return "SUCCEEDED"

    monkeypatch.setattr(submit, "follow", follow)
    assert submit.main("logs", ["r-job1", "--follow", "--address", "http://127.0.0.1:1"]) == 0
    assert printers[0].quiet is False


def test_run_needs_no_local_flag_and_shows_progress_unless_verbose():
    assert local._arg_parser().parse_args([]).verbose is False
    assert local._arg_parser().parse_args(["--local", "--verbose"]).verbose is True  # old scripts keep working


def test_the_resume_hint_is_a_whole_command(tmp_path, capsys):
    assert local.resume_command("my-ft") == "python -m workloads run --run-name my-ft"
    runs.write_run(tmp_path / "my-ft", {"name": "my-ft", "status": "interrupted", "train": {"steps": 9}})
    assert runs.main("runs", ["--runs-dir", str(tmp_path)]) == 0
    assert "python -m workloads run --run-name NAME resumes a run" in capsys.readouterr().out


def test_an_interrupted_local_run_says_how_to_resume_it_as_a_whole_command(monkeypatch, tmp_path):
    console = Console(record=True, width=300)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "local_ray_cluster", interrupted)
    with pytest.raises(KeyboardInterrupt):
        local._train_on_local_cluster(local._arg_parser().parse_args([]), console,
                                      spec=local.LocalClusterSpec(), run_dir=tmp_path / "my-ft", run_name="my-ft",
                                      train={}, inputs=None, tracking_uri="", uri_credentials={})
    assert "python -m workloads run --run-name my-ft resumes it" in console.export_text()
