"""submit, logs, stop and list against a real two-node Ray cluster on 127.0.0.1 (token auth on), and the
stack path with `pulumi` and `kubectl` replaced by scripts that answer like them: the fake
port-forward relays to the real cluster, so the whole path is exercised."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient
from fake_cluster_tools import ForeignListener, calls, install_fake_tools
from test_data_jsonl import write_corpus

from workloads.client import cluster, submit
from workloads.local.run import LocalClusterSpec, local_ray_cluster
from workloads.launch.ray_train import SCRATCH_ROOT
from workloads.launch.task_history import TASK_HISTORY_ENV

pytestmark = pytest.mark.slow

TINY_RUN = ["--preset", "demo-cpu", "--set", "micro_batch=2", "--set", "seq_len=32", "--set", "warmup_steps=1",
            "--set", "log_every=2", "--set", "checkpoint_every=2", "--quiet"]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(LocalClusterSpec(nodes=2, cpus_per_node=1),
                           log_dir=tmp_path_factory.mktemp("ray-logs")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def token_file(ray_cluster, tmp_path_factory) -> Path:
    """The cluster's token in a file of this user's only, as `--token-file` reads it."""
    path = tmp_path_factory.mktemp("token") / "ray-token"
    path.write_text(ray_cluster.token)
    path.chmod(0o600)
    return path


@pytest.fixture()
def target(ray_cluster, token_file) -> list[str]:
    return ["--address", ray_cluster.address, "--token-file", str(token_file)]


def _client(cluster) -> JobSubmissionClient:
    return JobSubmissionClient(cluster.address, headers={"Authorization": f"Bearer {cluster.token}"})


def _job_id(output: str) -> str:
    return re.search(r"job submitted (\S+) on ", output).group(1)


def test_submit_follows_the_run_to_success_and_a_resubmitted_run_resumes(target, tmp_path, monkeypatch, capsys):
    """The run reads a relative JSONL file and tokenizer folder of this machine: Ray Train runs
    workers in a folder of its own, so they reach them only through the job's upload."""
    write_corpus(tmp_path)  # corpus.jsonl and tokenizer/ in the current folder
    monkeypatch.chdir(tmp_path)
    run_name = f"resume-me-{tmp_path.name}"
    run = [*target, *TINY_RUN, "--storage-path", str(tmp_path / "storage"), "--run-name", run_name,
           "--set", "data.kind=jsonl", "--set", "data.path=corpus.jsonl", "--set", "data.tokenizer=tokenizer"]
    assert submit.main("submit", [*run, "--set", "steps=2"]) == 0
    first = capsys.readouterr().out
    assert f"job 2 CPU workers on 2 node(s), run {run_name}" in first
    assert "train step 2/2" in " ".join(first.split())
    assert "transport check does not apply" in first and "SUCCEEDED" in first
    assert "placement check passed: 2 ranks trained on 2 node(s), as planned" in first
    # Persisted checkpoints are deleted from the workers' scratch folders (Ray keeps them otherwise).
    scratch = SCRATCH_ROOT / run_name
    assert (scratch / "rank-0").is_dir() and not list(scratch.glob("rank-*/checkpoint-*"))

    assert submit.main("submit", [*run, "--set", "steps=4"]) == 0
    second = capsys.readouterr().out
    assert "step 2/4" not in " ".join(second.split()) and "train step 4/4" in " ".join(second.split())
    assert submit.main("logs", [_job_id(second), *target]) == 0
    logs = capsys.readouterr().out
    summary = json.loads(logs.split("[train-summary] ", 1)[1].splitlines()[0])
    assert summary["resumed_from_step"] == 2 and summary["steps_done"] == 2
    assert summary["data"]["records"] == 60  # the corpus's documents, read by the workers


def test_a_failing_run_exits_1_with_the_reason_on_the_last_line(target, tmp_path, capsys):
    empty_model = tmp_path / "no-model-here"
    empty_model.mkdir()
    argv = [*target, *TINY_RUN, "--storage-path", str(tmp_path / "s"), "--max-failures", "0",
            "--set", f"model.name_or_path={empty_model}"]
    assert submit.main("submit", argv) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"job \S+-job1 FAILED: error: training failed: ranks? [01](, 1)?: .*no-model-here", out), out


def test_list_logs_and_stop(target, ray_cluster, tmp_path, capsys):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = [*target, *TINY_RUN, "--storage-path", str(tmp_path / "s"), "--set", "steps=100000", "--no-follow",
            "--set", f"tracking.uri={store}"]
    assert submit.main("submit", argv) == 0
    job_id = capsys.readouterr().out.strip()
    assert submit.main("list", target) == 0
    assert job_id in capsys.readouterr().out
    opened = _wait_for_line(ray_cluster, job_id, "[tracking] {", timeout_s=180)
    run_id = json.loads(opened.split("[tracking] ", 1)[1])["run_id"]
    assert submit.main("stop", [job_id, *target]) == 0
    out = capsys.readouterr().out
    assert f"job {job_id} STOPPED" in out
    assert _client(ray_cluster).get_job_status(job_id) == JobStatus.STOPPED
    # Its ranks were killed with the job: its tracker run ended KILLED, not left RUNNING (`stop` ends it,
    # also over a FAILED written as the ranks saw each other go).
    from mlflow import MlflowClient

    assert MlflowClient(tracking_uri=store).get_run(run_id).info.status == "KILLED"
    assert submit.main("logs", [job_id, *target]) == 0
    assert "workloads.launch.driver" in capsys.readouterr().out
    assert submit.main("stop", ["raysubmit_nosuchjob", *target]) == 1
    assert "raysubmit_nosuchjob" in capsys.readouterr().err


def _wait_for_line(cluster, job_id: str, marker: str, *, timeout_s: float) -> str:
    """The first line of the job's log that holds `marker`, waiting for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in _client(cluster).get_job_logs(job_id).splitlines() if marker in line]
        if found:
            return found[0]
        time.sleep(1)
    raise AssertionError(f"no {marker!r} in the log of job {job_id} within {timeout_s:g} s")


def _jobs_of(cluster, run_name: str) -> list:
    return [job for job in _client(cluster).list_jobs() if (job.metadata or {}).get("run_name") == run_name]


def test_submitting_a_running_run_again_attaches_to_its_job(target, ray_cluster, tmp_path, capsys):
    run = f"attach-{tmp_path.name}"
    argv = [*target, *TINY_RUN, "--storage-path", str(tmp_path / "s"), "--set", "steps=100000", "--run-name", run,
            "--no-follow"]
    assert submit.main("submit", argv) == 0
    first = capsys.readouterr()
    try:
        assert first.out.strip() == f"{run}-job1"
        assert submit.main("submit", argv) == 0
        again = capsys.readouterr()
        assert again.out.strip() == f"{run}-job1"
        assert f"run {run} is already on the cluster as job {run}-job1" in again.err
        assert [job.submission_id for job in _jobs_of(ray_cluster, run)] == [f"{run}-job1"]
    finally:
        submit.main("stop", [f"{run}-job1", *target])


class _AnswerDroppingRelay:
    """A relay to the Jobs API that passes the first job submission on to the cluster and then closes
    the connection before the answer comes back: the job exists, the submitter never hears of it."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.dropped = target_port, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        first = client.recv(65536)
        drop = first.startswith(b"POST /api/jobs/") and not self.dropped
        upstream.sendall(first)
        threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
        if drop:
            upstream.recv(65536)  # the cluster has answered: the job exists
            self.dropped += 1
            for end in (client, upstream):  # a shutdown, not just a close, ends the pipe's blocked recv too
                end.shutdown(socket.SHUT_RDWR)
                end.close()
            return
        self._pipe(upstream, client)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_a_submission_whose_answer_is_lost_leaves_one_job(ray_cluster, token_file, tmp_path, capsys):
    relay = _AnswerDroppingRelay(int(ray_cluster.address.rsplit(":", 1)[1]))
    run = f"dropped-{tmp_path.name}"
    try:
        code = submit.main("submit", ["--address", f"http://127.0.0.1:{relay.port}", "--token-file", str(token_file),
                                      *TINY_RUN, "--storage-path", str(tmp_path / "s"), "--set", "steps=100000",
                                      "--run-name", run, "--no-follow"])
    finally:
        relay.close()
    out = capsys.readouterr()
    try:
        assert code == 0 and relay.dropped == 1, out
        assert out.out.strip() == f"{run}-job1"
        assert f"no answer to the submission of {run}-job1" in out.err
        assert "asking the cluster whether it arrived" in out.err
        assert [job.submission_id for job in _jobs_of(ray_cluster, run)] == [f"{run}-job1"]
    finally:
        _client(ray_cluster).stop_job(f"{run}-job1")


def test_a_wrong_token_is_refused(ray_cluster, monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    assert submit.main("list", ["--address", ray_cluster.address]) == 3
    err = capsys.readouterr().err
    assert "refused the Ray token: Authentication failed" in err and err.count("\n") == 1



def test_the_heads_gcs_runs_with_the_bounded_task_history(ray_cluster):
    # The caps reach the process that keeps the task events (workloads/launch/task_history.py):
    # the head's GCS server, started by `ray start --head` with the node's environment.
    gcs = [pid for pid in ray_cluster.nodes.pids(0)
           if "gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")]
    assert len(gcs) == 1, gcs
    environ = dict(entry.split("=", 1) for entry in
                   Path(f"/proc/{gcs[0]}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in entry)
    assert {name: environ.get(name) for name in TASK_HISTORY_ENV} == TASK_HISTORY_ENV

# --- the stack path -----------------------------------------------------------------------------


@pytest.fixture()
def fake_tools(ray_cluster, tmp_path, monkeypatch):
    install_fake_tools(tmp_path, monkeypatch, token=ray_cluster.token,
                       dashboard_port=int(ray_cluster.address.rsplit(":", 1)[1]))
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(")")[-1].split()[0] != "Z"


def test_the_stack_path_port_forwards_authenticates_and_cleans_up(fake_tools, ray_cluster, capsys):
    job_id = _client(ray_cluster).submit_job(entrypoint="echo hello-through-the-port-forward")
    assert submit.main("logs", [job_id, "--follow", "--stack", "us-west-2"]) == 0
    assert "hello-through-the-port-forward" in capsys.readouterr().out

    pulumi, secret, forward = calls(fake_tools)
    # Run from any folder, pulumi is pointed at this project.
    assert pulumi == ["pulumi", "stack", "output", "--json", "--show-secrets", "--stack", "us-west-2",
                      "--cwd", str(Path(submit.__file__).resolve().parents[2])]
    assert secret[1:3] == ["--kubeconfig", secret[2]] and secret[3:] [:6] == [
        "--namespace", "ray", "get", "secret", "ray-auth", "-o"]
    assert forward[3:5] == ["--namespace", "ray"] and "svc/ray-head-svc" in forward
    assert forward[-2].endswith(":8265")
    written = forward[-1]
    assert written["kubeconfig_mode"] == "0o600" and json.loads(written["kubeconfig"])["kind"] == "Config"
    assert not Path(forward[2]).exists()  # the private kubeconfig is gone
    pid = int((fake_tools / "pids").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)  # the port-forward was stopped


def test_a_dropped_port_forward_is_restored_while_following(fake_tools, ray_cluster, monkeypatch, capsys):
    """The SDK's "WebSocket connection closed unexpectedly" is not the job failing: a new
    port-forward picks the log up where it broke, and no line is shown twice or lost. The token goes
    only to the restored forward kubectl opened: kubectl binds late, and another process listens on
    the port a choice made before kubectl binds gives the new forward (free_port, then `kubectl
    port-forward PORT:8265`)."""
    taken = ForeignListener(cluster.free_port(), record=fake_tools / "received")
    real_free_port, picks = cluster.free_port, []

    def free_port() -> int:  # the second pick, the restored forward's port, is taken by the other process
        picks.append(None)
        return taken.port if len(picks) == 2 else real_free_port()

    monkeypatch.setattr(cluster, "free_port", free_port)
    monkeypatch.setenv("FAKE_BIND_DELAY_S", "0.5")
    # The job stops half-way until the port-forward is dropped, so the drop lands mid-stream however
    # long `logs --follow` takes to start (under a full suite's load its port-forward once came up
    # after the job had printed tick-3, and there was no pid to kill yet).
    go = fake_tools / "go"
    script = (f"import os, time\nfor i in range(12):\n    print(f'tick-{{i}}', flush=True)\n"
              f"    while i == 5 and not os.path.exists({str(go)!r}):\n        time.sleep(0.1)")
    job_id = _client(ray_cluster).submit_job(entrypoint=f"python -c {shlex.quote(script)}")
    pids_file, requests_file = fake_tools / "pids", fake_tools / "requests"

    def log_stream_is_open() -> bool:
        return requests_file.exists() and "/logs/tail" in requests_file.read_text()

    def drop_the_first_port_forward() -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                    log_stream_is_open() and "tick-5" in _client(ray_cluster).get_job_logs(job_id)):
                time.sleep(0.2)
            os.kill(int(pids_file.read_text().split()[0]), signal.SIGKILL)
        finally:
            go.touch()

    dropper = threading.Thread(target=drop_the_first_port_forward)
    dropper.start()
    try:
        code = submit.main("logs", [job_id, "--follow", "--stack", "us-west-2"])
    finally:
        dropper.join()
        taken.stop()
    out = capsys.readouterr().out
    assert ray_cluster.token.encode() not in taken.received()
    assert code == 0, out
    ticks = [line for line in out.splitlines() if line.startswith("tick-")]
    assert ticks == [f"tick-{i}" for i in range(12)], out
    assert "lost the job's log stream" in out and "reconnecting (attempt 1, for up to 300 s)" in out
    assert len(pids_file.read_text().split()) == 2  # a second port-forward was started


def test_a_port_forward_that_cannot_open_is_exit_3_and_still_cleans_up(fake_tools, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_FORWARD_FAILS", "1")
    assert submit.main("list", ["--stack", "us-west-2"]) == 3
    err = capsys.readouterr().err
    assert 'did not open: error: services "ray-head-svc" not found' in err and err.count("\n") == 1
    forward = calls(fake_tools)[-1]
    assert not Path(forward[2]).exists()


def test_a_stack_without_the_outputs_is_exit_2(fake_tools, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_OUTPUTS", json.dumps({"clusterName": "ray-eks"}))
    assert submit.main("list", ["--stack", "us-west-2"]) == 2
    assert "run `pulumi up --stack us-west-2` first" in capsys.readouterr().err


def test_missing_tools_are_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert submit.main("list", ["--stack", "us-west-2"]) == 3
    assert "pulumi is not on PATH" in capsys.readouterr().err
