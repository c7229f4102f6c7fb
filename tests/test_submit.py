"""submit's and cluster's pure parts: stack outputs, the Jobs API request, the log printer, the offline
transport check."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import shlex
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
from fake_clock import FakeClock
from interrupts import sigint_raises
from ray.runtime_env import RuntimeEnv
from rich.console import Console

from workloads.client import cluster, submit
from workloads.client import follow as follow_mod
from workloads.launch.driver import parse_args as parse_driver_args
from workloads.context import DATA_PREFIX, GATE_PREFIX, METHOD_PREFIX
from workloads.train.data import reading_of_data
from workloads.transport.gate import EFA_TRANSPORT_ENV

OUTPUTS = {
    "kubeconfig": {"apiVersion": "v1", "clusters": []},
    "clusterName": "ray-eks",
    "region": "us-west-2",
    "rayNamespace": "ray",
    "rayClusterName": "ray",
    "rayHeadService": "ray-head-svc",
    "rayDashboardPort": 8265,
    "rayAuthSecretName": "ray-auth",
    "rayAuthSecretKey": "token",
    "checkpointBucketUri": "s3://ckpt-bucket",
}


def test_stack_outputs_map_to_a_typed_record():
    outputs = cluster.stack_outputs_from_json(OUTPUTS, stack="us-west-2")
    assert outputs.ray_head_service == "ray-head-svc" and outputs.ray_dashboard_port == 8265
    assert json.loads(outputs.kubeconfig) == OUTPUTS["kubeconfig"]  # an object output becomes text
    assert outputs.checkpoint_bucket_uri == "s3://ckpt-bucket"
    assert outputs.gpu_memory_gib is None  # a stack deployed before the output existed
    assert cluster.stack_outputs_from_json({**OUTPUTS, "gpuMemoryGib": 24}, stack="x").gpu_memory_gib == 24


def test_missing_stack_outputs_are_named_with_the_fix():
    partial = {k: v for k, v in OUTPUTS.items() if k not in ("rayHeadService", "rayAuthSecretKey")}
    with pytest.raises(ValueError, match=r"lacks output\(s\) rayHeadService, rayAuthSecretKey: run `pulumi up"):
        cluster.stack_outputs_from_json(partial, stack="us-west-2")


def test_the_submission_runs_the_driver_with_a_config_that_round_trips():
    train = {"steps": 3, "model": {"name_or_path": "tiny-qwen2"}, "data": {"path": "it's here"}}
    sub = submit.build_submission(train=train, run_name="r1", storage_path="s3://b/runs", max_failures=2,
                                  working_dir="/tmp/stage", expect="efa")
    argv = shlex.split(sub.entrypoint)
    assert argv[:3] == ["python", "-m", "workloads.launch.driver"]
    args = parse_driver_args(argv[3:])
    assert (args.train, args.run_name, args.storage_path, args.max_failures) == (train, "r1", "s3://b/runs", 2)
    assert sub.runtime_env["working_dir"] == "/tmp/stage"
    assert set(sub.runtime_env) == {"working_dir", "env_vars", "pip"}
    assert sub.runtime_env["pip"] == {"packages": list(submit.GPU_PACKAGES), "pip_check": False}
    env = sub.runtime_env["env_vars"]
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_NET_PLUGIN"] == "ofi" and env["RAY_DEDUP_LOGS"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["FI_EFA_FORK_SAFE"] == "1"
    assert EFA_TRANSPORT_ENV.items() <= env.items()  # the pods' declaration, from the same place
    assert sub.metadata == {"run_name": "r1", "storage_path": "s3://b/runs"}


def test_without_efa_the_job_env_declares_no_network_and_installs_nothing():
    sub = submit.build_submission(train={}, run_name="r", storage_path="/tmp/s", max_failures=0,
                                  working_dir="/w", expect="any")
    assert set(sub.runtime_env) == {"working_dir", "env_vars"}  # a CPU run needs no network at job start
    assert not any(key.startswith(("FI_", "NCCL_")) for key in sub.runtime_env["env_vars"])


@pytest.mark.parametrize("expect", ["efa", "any"])
def test_rays_own_parser_accepts_the_runtime_env(expect, tmp_path):
    parsed = RuntimeEnv(**submit.runtime_env(working_dir=str(tmp_path), expect=expect))
    packages = (parsed.pip_config() or {}).get("packages", [])
    assert packages == (list(submit.GPU_PACKAGES) if expect == "efa" else [])


def test_the_gpu_packages_are_the_pins_of_pyprojects_gpu_extra_and_dependencies():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    gpu = pyproject["project"]["optional-dependencies"]["gpu"]
    pins = {*gpu, *pyproject["project"]["dependencies"]}
    assert set(gpu) <= set(submit.GPU_PACKAGES) and all(p in pins for p in submit.GPU_PACKAGES)
    assert "peft==0.21.2" in submit.GPU_PACKAGES  # LoRA's adapters, on an image that may not have it


def test_the_working_dir_holds_only_the_workloads_package():
    with submit.staged_package() as stage:
        top = sorted(p.name for p in stage.iterdir())
        files = [p for p in stage.rglob("*") if p.is_file()]
        assert top == ["workloads"]
        assert (stage / "workloads" / "launch" / "driver.py").is_file()
        assert (stage / "workloads" / "train" / "loop.py").is_file()
        assert not any("__pycache__" in p.parts for p in files)
    assert not stage.exists()


def _printer(*, quiet: bool) -> tuple[submit.LogPrinter, io.StringIO]:
    out = io.StringIO()
    return submit.LogPrinter(console=Console(file=out, width=200, color_system=None), quiet=quiet, total_steps=60), out


def test_the_printer_shows_progress_from_split_chunks_once():
    printer, out = _printer(quiet=True)
    record = '(RayTrainWorker pid=7) [train] {"step":5,"loss":2.5,"tokens_per_s_per_device":1234.5}\n'
    printer.feed('[driver] {"event":"plan","nodes":2,"num_workers":2,"use_gpu":false,"run_name":"d"}\nnoise\n')
    printer.feed(record[:30])
    printer.feed(record[30:] + record)  # Ray Train forwards worker lines twice
    printer.feed('(RayTrainWorker pid=7) [train] {"step":10,"loss":2.0}')
    printer.flush()
    lines = out.getvalue().splitlines()
    assert lines == [
        "job 2 CPU workers on 2 node(s), run d",
        # The workers' start takes tens of seconds before the gate says anything: said at once.
        "job starting the workers: each imports torch and joins the process group, then the transport gate runs",
        "train step      5/60  loss 2.5000  1,234 tokens/s/worker",
        "train step     10/60  loss 2.0000",
    ]


def test_the_printer_shows_the_loops_gate_line_once():
    printer, out = _printer(quiet=True)
    gate = {"applies": False, "passed": True, "message": "transport gate does not apply: gloo"}
    line = f"(RayTrainWorker pid=7) {GATE_PREFIX}{json.dumps(gate)}\n"
    printer.feed(line + line)
    assert out.getvalue().splitlines() == ["gate transport gate does not apply: gloo"]


def test_the_printer_shows_each_record_once_when_ray_forwards_two_records_twice_interleaved():
    """Ray forwards each worker line twice; two records forwarded so, interleaved (A, B, A, B), were
    both shown twice: a record was dropped only when it equalled the line just before it."""
    printer, out = _printer(quiet=True)
    gate = {"applies": False, "passed": True, "message": "transport gate does not apply: gloo"}
    data = {"records": 17, "chats": 17, "seq_len": 64, "examples": 15, "rows": 12, "label_tokens": 135,
            "note": "the run reads its data 3 times"}
    step = {"step": 5, "loss": 2.5}
    lines = [f"(RayTrainWorker pid=7) {GATE_PREFIX}{json.dumps(gate)}\n",
             f"(RayTrainWorker pid=7) {DATA_PREFIX}{json.dumps(data)}\n",
             f'(RayTrainWorker pid=7) [train] {json.dumps(step)}\n']
    printer.feed("".join(lines[:2] + lines[:2] + lines[2:] + lines[1:]))
    assert out.getvalue().splitlines() == [
        "gate transport gate does not apply: gloo",
        "data 17 records: 15 examples in 12 rows of 64 tokens, 135 tokens to learn",
        "data the run reads its data 3 times",
        "train step      5/60  loss 2.5000",
    ]


def test_the_printer_says_which_method_trains_and_how_many_parameters_once():
    """A LoRA run never said it was LoRA; the loop's method record reads as peft's
    print_trainable_parameters."""
    printer, out = _printer(quiet=True)
    lora = {"method": "lora", "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": []},
            "trained_params": 1_089_536, "params": 495_122_304}
    line = f"(RayTrainWorker pid=7) {METHOD_PREFIX}{json.dumps(lora)}\n"
    printer.feed(line + line)
    printer.feed(f"{METHOD_PREFIX}{json.dumps({'method': 'full', 'trained_params': 1000, 'params': 1000})}\n")
    assert out.getvalue().splitlines() == [
        "method LoRA rank 16 (alpha 32): trainable params: 1,089,536 || all params: 495,122,304 || trainable%: 0.2201",
        "method full fine-tune: trainable params: 1,000 || all params: 1,000 || trainable%: 100.0000",
    ]


def test_the_printer_says_on_the_console_what_the_data_lost_to_seq_len():
    """Truncated and dropped conversations were counted only in job.log and report.json."""
    printer, out = _printer(quiet=True)
    data = {"records": 17, "chats": 17, "held_out": 1, "seq_len": 64, "examples": 15, "rows": 12,
            "label_tokens": 135, "fill": 0.87, "truncated": 2, "dropped": 1, "longest_cut": 97, "eval_rows": 1}
    line = f"(RayTrainWorker pid=7) [data] {json.dumps(data)}\n"
    printer.feed(line + line)
    assert [" ".join(out.getvalue().split())] == [  # one line (the console wraps at its width)
        "data 17 records, 1 held out for the eval loss: 15 examples in 12 rows of 64 tokens, 135 tokens to learn; "
        "2 conversation(s) longer than seq_len 64 cut to their start and 1 dropped with nothing left to learn: "
        "--set seq_len=128 keeps every one whole"]
    printer, out = _printer(quiet=True)
    printer.feed(f"[data] {json.dumps({**data, 'truncated': 0, 'dropped': 0, 'longest_cut': 0})}\n")
    assert out.getvalue().splitlines() == [
        "data 17 records, 1 held out for the eval loss: 15 examples in 12 rows of 64 tokens, 135 tokens to learn"]


def test_the_printer_says_when_the_run_reads_its_data_more_than_once():
    data = {"records": 9000, "chats": 9000, "seq_len": 2048, "examples": 9000, "rows": 6400, "label_tokens": 10**6}
    reading = reading_of_data(data, steps=100, rows_per_step=128)
    line = f"(RayTrainWorker pid=7) {DATA_PREFIX}{json.dumps({**data, **reading})}\n"
    printer, out = _printer(quiet=True)
    printer.feed(line + line)
    assert out.getvalue().splitlines() == [
        "data 9000 records: 9000 examples in 6400 rows of 2048 tokens, 1000000 tokens to learn",
        f"data {reading['note']}"]
    once = reading_of_data({**data, "rows": 12_800}, steps=100, rows_per_step=128)
    printer, out = _printer(quiet=True)
    printer.feed(f"{DATA_PREFIX}{json.dumps({**data, 'rows': 12_800, **once})}\n")
    assert out.getvalue().splitlines() == [
        "data 9000 records: 9000 examples in 12800 rows of 2048 tokens, 1000000 tokens to learn"]


def test_the_printer_passes_other_lines_through_unless_quiet():
    printer, out = _printer(quiet=False)
    printer.feed("Traceback (most recent call last):\nValueError: x\n")
    assert out.getvalue().splitlines() == ["Traceback (most recent call last):", "ValueError: x"]


def _job_log(nccl_log: str, *, use_gpu: bool, nodes: int) -> str:
    plan = {"event": "plan", "nodes": nodes, "num_workers": 2, "use_gpu": use_gpu, "run_name": "r"}
    worker = "\n".join(f"(RayTrainWorker pid=631, ip=10.0.1.5) {line}" for line in nccl_log.splitlines())
    return f"[driver] {json.dumps(plan)}\n{worker}\n"


def test_the_offline_check_passes_nvlink_p2p_and_fails_sockets_within_a_node(shared_dir):
    nccl = shared_dir / "fixtures" / "nccl"
    good = submit.transport_check(_job_log((nccl / "h200x2-single-node-p2p.log").read_text(), use_gpu=True, nodes=1),
                                  expect="any")
    assert good.applies and good.passed and "P2P" in good.message
    bad = submit.transport_check(_job_log((nccl / "h200x2-forced-socket.log").read_text(), use_gpu=True, nodes=1),
                                 expect="any")
    assert bad.applies and not bad.passed and "NET/Socket within a node" in bad.message


def test_the_offline_check_does_not_apply_to_cpu_runs(shared_dir):
    nccl = (shared_dir / "fixtures" / "nccl" / "h200x2-forced-socket.log").read_text()
    outcome = submit.transport_check(_job_log(nccl, use_gpu=False, nodes=2), expect="efa")
    assert (outcome.applies, outcome.passed) == (False, True) and "gloo" in outcome.message


def test_the_exit_code_is_the_job_status_and_then_the_post_run_checks():
    passed = submit.GateOutcome(applies=True, passed=True, message="PASS")
    failed = submit.GateOutcome(applies=True, passed=False, message="FAIL")
    assert submit.JobOutcome(job_id="j", status="SUCCEEDED", checks=(passed, passed)).exit_code == 0
    assert submit.JobOutcome(job_id="j", status="SUCCEEDED", checks=(passed, failed)).exit_code == 1
    assert submit.JobOutcome(job_id="j", status="SUCCEEDED", checks=(failed, passed)).exit_code == 1
    assert submit.JobOutcome(job_id="j", status="FAILED", reason="boom").exit_code == 1
    assert submit.JobOutcome(job_id="j", status="STOPPED").exit_code == 1


def test_a_run_on_the_eks_shaped_cluster_passes_the_post_run_checks(shared_dir):
    """The driver's plan on a GPU-less head plus two one-GPU workers, and the NCCL logs of two
    hosts (NCCL_HOSTID per process): the plan's node count is the one the logs show."""
    from workloads.launch.driver import node_resources, plan_workers

    ray_nodes = [{"Alive": True, "Resources": {"CPU": 0.0, "memory": 1e9}}] + [
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}} for _ in range(2)]
    plan = plan_workers(node_resources(ray_nodes))
    assert plan.nodes == 2
    nccl = (shared_dir / "fixtures" / "nccl" / "h200x2-two-hostid-socket.log").read_text()
    logs = _job_log(nccl, use_gpu=True, nodes=plan.nodes) + '[train-summary] {"nodes": 2, "world_size": 2}\n'
    transport = submit.transport_check(logs, expect="any")
    assert transport.passed, transport.message
    placement = submit.placement_check(logs)
    assert placement.passed and placement.message == "placement check passed: 2 ranks trained on 2 node(s), as planned"
    # Counting the head, as the plan once did, turns this healthy run into a failed one.
    assert not submit.transport_check(_job_log(nccl, use_gpu=True, nodes=3), expect="any").passed


def test_the_placement_check_fails_when_the_ranks_ran_elsewhere_than_planned():
    logs = _job_log("", use_gpu=False, nodes=2) + '[train-summary] {"nodes": 1, "world_size": 2}\n'
    outcome = submit.placement_check(logs)
    assert outcome.applies and not outcome.passed
    assert outcome.message == "placement check failed: the driver planned 2 node(s), the ranks trained on 1"


def test_an_elastic_run_passes_the_placement_check_on_fewer_nodes_down_to_its_minimum():
    def logs(*, min_workers: int, trained: int) -> str:
        plan = {"event": "plan", "nodes": 2, "num_workers": 2, "min_workers": min_workers, "use_gpu": False}
        return f"[driver] {json.dumps(plan)}\n" + f'[train-summary] {{"nodes": {trained}, "world_size": {trained}}}\n'

    # --min-nodes 1 of 2: a run that ended on one node, after its other node was lost, passes.
    ended_on_one = submit.placement_check(logs(min_workers=1, trained=1))
    assert ended_on_one.passed and ended_on_one.message == (
        "placement check passed: 1 ranks trained on 1 node(s) at the end, within the elastic run's 1 to 2")
    assert submit.placement_check(logs(min_workers=1, trained=2)).message.endswith("as planned")
    # Never more than the plan; and a run that is not elastic (min_workers = the plan's) still needs every node.
    more = submit.placement_check(logs(min_workers=1, trained=3))
    assert not more.passed
    assert more.message == "placement check failed: the driver planned 1 to 2 node(s), the ranks trained on 3"
    assert not submit.placement_check(logs(min_workers=2, trained=1)).passed


def test_an_elastic_gpu_run_that_ended_on_one_rank_is_judged_by_its_in_band_gate_verdicts():
    """A drained or lost node's attempts never print their NCCL logs (a rank prints them when its
    attempt ends), and a last attempt of one rank makes no NCCL connection: the job's in-band gate
    verdicts, one per start of more than one rank, are what there is to judge."""
    def logs(*gates: dict) -> str:
        plan = {"event": "plan", "nodes": 2, "num_workers": 2, "min_workers": 1, "use_gpu": True}
        lines = [f"[driver] {json.dumps(plan)}"]
        lines += [f"(RayTrainWorker pid=7) [transport-gate] {json.dumps(gate)}" for gate in gates]
        return "\n".join([*lines, '[train-summary] {"nodes": 1, "world_size": 1}']) + "\n"

    passed = {"applies": True, "passed": True, "message": "transport gate passed (expect efa; 2 ranks on 2 node(s))"}
    single = {"applies": False, "passed": True, "message": "transport gate does not apply to a single rank"}
    ok = submit.transport_check(logs(passed, single), expect="efa")
    assert ok.applies and ok.passed and "ended on one rank" in ok.message and "expect efa" in ok.message
    # A verdict for another expectation proves nothing about this one; no verdict at all neither.
    other = submit.transport_check(logs({**passed, "message": "transport gate passed (expect any; ...)"}), expect="efa")
    assert not other.passed and "did not pass expecting efa" in other.message
    assert not submit.transport_check(logs(single), expect="efa").passed
    # Without the one-rank end the NCCL lines are judged as before: none here, so inconclusive.
    two_ranks = logs(passed).replace('"world_size": 1', '"world_size": 2')
    assert not submit.transport_check(two_ranks, expect="efa").passed


class _Stream:
    """A Jobs API client whose log stream breaks after `breaks_after` characters (None: never)."""

    def __init__(self, log: str, breaks_after=None, status="SUCCEEDED") -> None:
        self.log, self.breaks_after, self.status = log, breaks_after, status

    async def tail_job_logs(self, job_id):
        for start in range(0, len(self.log), 7):
            if self.breaks_after is not None and start >= self.breaks_after:
                raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")
            yield self.log[start:start + 7]

    def get_job_status(self, job_id):
        from ray.job_submission import JobStatus

        return JobStatus(self.status)


def test_following_picks_the_stream_up_where_a_dropped_connection_broke_it():
    log = "".join(f'[train] {{"step": {s}, "loss": {1.0 / s}}}\n' for s in range(1, 6))
    clients = iter([_Stream(log, breaks_after=40), _Stream(log, breaks_after=90), _Stream(log)])
    console = Console(record=True, width=200)
    said: list[str] = []
    status = submit.follow(lambda: next(clients), "raysubmit_1", submit.LogPrinter(console=console, quiet=True),
                           sleep=lambda s: None, say=said.append)
    assert str(status) == "SUCCEEDED"
    steps = [line.split()[2] for line in console.export_text().splitlines() if line.startswith("train")]
    assert steps == ["1", "2", "3", "4", "5"]  # each once, in order, none lost
    assert len(said) == 2 and "WebSocket connection closed unexpectedly" in said[0]


def test_following_gives_up_with_a_distinct_error_and_the_job_runs_on():
    def broken():
        return _Stream("x" * 50, breaks_after=0)

    clock, said = FakeClock(), []
    with pytest.raises(submit.FollowLostError, match="WebSocket connection closed"):
        submit.follow(broken, "raysubmit_1", submit.LogPrinter(console=Console(), quiet=True), patience_s=60,
                      sleep=clock.sleep, clock=clock, say=said.append)
    assert 60 <= clock.now < 80  # it kept trying for its patience, then gave up
    assert said[0].endswith("reconnecting (attempt 1, for up to 60 s)")


class _Gone(_Stream):
    """The cluster after its head restarted: it answers, and knows no job."""

    def get_job_status(self, job_id):
        raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")


def test_a_job_the_restarted_cluster_no_longer_knows_is_gone_not_lost():
    clients = iter([_Stream("line\n" * 20, breaks_after=30), _Gone("")])
    with pytest.raises(submit.JobGoneError, match="job raysubmit_1 is gone from the cluster: its Ray head restarted"):
        submit.follow(lambda: next(clients), "raysubmit_1", submit.LogPrinter(console=Console(), quiet=True),
                      sleep=lambda s: None)
    # An id the cluster never had is the caller's mistake, said as the Jobs API says it.
    with pytest.raises(RuntimeError, match="does not exist"):
        submit.follow(lambda: _Gone(""), "raysubmit_typo", submit.LogPrinter(console=Console(), quiet=True))


def test_a_lost_connection_exits_4_with_how_to_reattach(monkeypatch, capsys):
    def lost(conn, request, *, console, on_submitted):
        on_submitted("raysubmit_9")
        raise submit.FollowLostError("WebSocket connection closed unexpectedly")

    monkeypatch.setattr(submit, "submit_and_follow", lost)
    code = submit.main("submit", ["--address", "http://127.0.0.1:1", "--storage-path", "/tmp/x",
                                  "--preset", "demo-cpu"])
    out = capsys.readouterr().out
    assert code == submit.EXIT_DETACHED == 4
    assert "lost the connection (WebSocket connection closed unexpectedly); job raysubmit_9 keeps running" in out
    assert "python -m workloads logs --follow raysubmit_9 --address http://127.0.0.1:1" in out



@pytest.mark.parametrize("min_nodes, max_failures, warned", [("1", "0", True), ("1", "1", False), ("0", "0", False)])
def test_an_elastic_run_without_retries_is_warned_about_before_it_is_submitted(min_nodes, max_failures, warned,
                                                                              monkeypatch, capsys):
    requests = []

    def submitted(conn, request, *, console, on_submitted):
        requests.append(request)
        on_submitted("raysubmit_1")
        raise submit.FollowLostError("stopped here: the test needs the request only")

    monkeypatch.setattr(submit, "submit_and_follow", submitted)
    submit.main("submit", ["--address", "http://127.0.0.1:1", "--storage-path", "/tmp/x", "--preset", "demo-cpu",
                           "--min-nodes", min_nodes, "--max-failures", max_failures])
    out = " ".join(capsys.readouterr().out.split())
    assert (submit.ELASTIC_WITHOUT_RETRIES in out) is warned
    # A warning, not a refusal: the run is submitted as asked.
    assert [(r.min_nodes, r.max_failures) for r in requests] == [(int(min_nodes), int(max_failures))]

def test_the_driver_is_told_how_many_gpus_to_wait_for_and_offline_installs_nothing(tmp_path):
    sub = submit.build_submission(train={}, run_name="r", storage_path="s3://b/p", max_failures=1,
                                  working_dir=str(tmp_path), expect="efa", gpus=8, install=False)
    assert shlex.split(sub.entrypoint)[-2:] == ["--gpus", "8"] and "pip" not in sub.runtime_env
    assert submit.build_submission(train={}, run_name="r", storage_path="s3://b/p", max_failures=1,
                                   working_dir=str(tmp_path), expect="efa").runtime_env["pip"]


def test_the_reattach_hint_repeats_how_the_cluster_was_reached():
    hint = submit.reattach_hint("raysubmit_1", ("--stack", "us-west-2"))
    assert "python -m workloads logs --follow raysubmit_1 --stack us-west-2" in hint
    assert "python -m workloads stop raysubmit_1 --stack us-west-2" in hint


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "demo-cpu"], "say which cluster: --stack NAME"),
        (["--address", "http://127.0.0.1:1", "--preset", "demo-cpu"], "--storage-path is needed with --address"),
        (["--address", "http://127.0.0.1:1", "--preset", "demo"], "unknown preset 'demo'"),
        (["--address", "http://127.0.0.1:1", "--storage-path", "runs"], "'runs' must be a URI"),
        (["--address", "http://127.0.0.1:1", "--set", "stepz=3"], "did you mean 'steps'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_submit_input_is_one_line_and_exit_2(argv, message, capsys):
    assert submit.main("submit", argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_address_without_a_jobs_api_is_exit_3(capsys):
    port = cluster.free_port()  # nothing listens there
    assert submit.main("list", ["--address", f"http://127.0.0.1:{port}"]) == 3
    assert f"no Ray Jobs API at http://127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "url"), [
    ("localhost:8265", "http://localhost:8265"),
    ("127.0.0.1:1", "http://127.0.0.1:1"),
    (" https://ray.example.com/ ", "https://ray.example.com"),
    ("http://[::1]:8265", "http://[::1]:8265"),
])
def test_an_address_without_a_scheme_is_a_jobs_api_url(given, url):
    assert cluster.normalize_address(given) == url


@pytest.mark.parametrize("given", ["ray://127.0.0.1:10001", "http://host:port", "http://", "gcs:6379:x"])
def test_an_address_that_is_no_jobs_api_url_is_refused(given):
    with pytest.raises(ValueError, match="is not a Ray Jobs API URL: use http://HOST:PORT"):
        cluster.normalize_address(given)


@pytest.mark.parametrize("given", ["http://10.0.3.7:8265", "ray-head.example.com:8265", "http://192.0.2.1:8265"])
def test_plain_http_to_another_machine_is_refused_unless_insecure(given, capsys):
    with pytest.raises(ValueError, match="plain http to another machine would send the Ray token, and every job, "
                                         "in the clear: use https://"):
        cluster.normalize_address(given)
    assert cluster.normalize_address(given, insecure=True).startswith("http://")
    assert submit.main("list", ["--address", given]) == submit.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --insecure" in err


def test_the_token_comes_from_the_environment_or_a_file_and_a_token_on_the_command_line_is_warned_about(
        tmp_path, monkeypatch, capsys):
    seen = []

    @contextlib.contextmanager
    def connect(**kwargs):
        seen.append(kwargs["token"])
        raise cluster.UnreachableError("stop here")
        yield

    monkeypatch.setattr(submit, "connect", connect)
    (tmp_path / "token").write_text("from-the-file\n")
    assert submit.main("list", ["--address", "http://127.0.0.1:9", "--token-file", str(tmp_path / "token")]) == 3
    assert seen == ["from-the-file"] and "warning" not in capsys.readouterr().err
    assert submit.main("list", ["--address", "http://127.0.0.1:9", "--token", "on-the-command-line"]) == 3
    assert seen[-1] == "on-the-command-line"
    assert f"warning: {submit.TOKEN_ON_COMMAND_LINE}" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert submit.main("list", ["--address", "http://127.0.0.1:9", "--token-file", str(tmp_path / "empty")]) == 2
    assert "the file is empty" in capsys.readouterr().err


def test_with_an_address_and_no_token_file_the_token_is_ray_auth_token(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-environment")
    with cluster.connect(stack=None, address="http://127.0.0.1:9", token=None) as conn:
        assert conn.token == "from-the-environment"


def test_an_address_that_does_not_answer_fails_within_the_connect_timeout():
    began = time.monotonic()
    # TEST-NET-1 (RFC 5737): never routed, so the connection times out or is refused at once.
    with pytest.raises(cluster.UnreachableError, match=r"no Ray Jobs API at http://192\.0\.2\.1:8265"):
        cluster.check_reachable("http://192.0.2.1:8265", timeout_s=1.0)
    assert time.monotonic() - began < 3


def test_stack_and_address_together_are_refused(capsys):
    assert submit.main("list", ["--stack", "us-west-2", "--address", "http://127.0.0.1:9"]) == 2
    assert "--stack and --address both name a cluster" in capsys.readouterr().err


# --- one job per run: submission ids derived from the run name --------------------------------


class _Jobs:
    """The Jobs API of one cluster as the Ray SDK presents it: ids are unique, a duplicate is refused
    with Ray's message, an unknown id is Ray's 404. `drop_answers` loses the answer of that many
    submissions after the cluster took them (a port-forward that drops mid-request)."""

    def __init__(self, *, drop_answers: int = 0, refuse_first: int = 0, agent_after: int = 0) -> None:
        self.jobs: dict[str, dict] = {}
        self.drop_answers, self.refuse_first, self.agent_after = drop_answers, refuse_first, agent_after
        self.submit_calls = 0

    def list_jobs(self):
        from ray.job_submission import JobDetails, JobType

        return [JobDetails(type=JobType.SUBMISSION, submission_id=job_id, entrypoint="python -m ...",
                           status=job["status"], metadata=job["metadata"], start_time=i)
                for i, (job_id, job) in enumerate(self.jobs.items())]

    def submit_job(self, *, entrypoint, runtime_env, metadata, submission_id):
        import requests
        from ray.job_submission import JobStatus

        self.submit_calls += 1
        if self.agent_after:  # the head's dashboard answers, its job agent is not registered yet
            self.agent_after -= 1
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try "
                               "again later.")
        if self.refuse_first:
            self.refuse_first -= 1
            raise requests.exceptions.ConnectionError("Connection refused")  # never reached the cluster
        if submission_id in self.jobs:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {submission_id} "
                               "already exists. Please use a different submission_id.")
        self.jobs[submission_id] = {"status": JobStatus.RUNNING, "metadata": metadata, "entrypoint": entrypoint}
        if self.drop_answers:
            self.drop_answers -= 1
            raise requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected('Remote end "
                                                      "closed connection without response'))")
        return submission_id

    def get_job_info(self, job_id):
        if job_id not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return self.list_jobs()[list(self.jobs).index(job_id)]

    def finish(self, job_id: str) -> None:
        from ray.job_submission import JobStatus

        self.jobs[job_id]["status"] = JobStatus.SUCCEEDED


def _request(run_name: str = "qwen-run") -> submit.SubmitRequest:
    return submit.SubmitRequest(train={"steps": 2}, run_name=run_name, storage_path="s3://b/runs", max_failures=1,
                                expect="any", quiet=True)


def test_a_run_is_submitted_under_an_id_derived_from_its_name():
    jobs, said = _Jobs(), []
    submitted = submit.submit_or_attach(lambda: jobs, _request(), say=said.append)
    assert submitted == submit.Submitted(job_id="qwen-run-job1", attached=False, index=1)
    assert jobs.jobs["qwen-run-job1"]["metadata"]["run_name"] == "qwen-run" and not said
    assert submit.submission_id("my run/α", 3) == "my-run---job3"


def test_submitting_a_run_that_is_running_attaches_to_its_job():
    jobs = _Jobs()
    first = submit.submit_or_attach(lambda: jobs, _request())
    again = submit.submit_or_attach(lambda: jobs, _request())
    assert again == submit.Submitted(job_id=first.job_id, attached=True, index=1)
    assert list(jobs.jobs) == ["qwen-run-job1"] and jobs.submit_calls == 1


def test_a_finished_run_submitted_again_gets_the_next_id():
    jobs = _Jobs()
    jobs.finish(submit.submit_or_attach(lambda: jobs, _request()).job_id)
    assert submit.submit_or_attach(lambda: jobs, _request()).job_id == "qwen-run-job2"
    # After a lost head the submitter goes on counting from the lost job's id.
    assert submit.submit_or_attach(lambda: _Jobs(), _request(), first_index=3).job_id == "qwen-run-job3"


def test_a_submission_whose_answer_is_lost_is_found_not_sent_twice():
    jobs, said = _Jobs(drop_answers=1), []
    submitted = submit.submit_or_attach(lambda: jobs, _request(), say=said.append, sleep=lambda s: None)
    assert submitted == submit.Submitted(job_id="qwen-run-job1", attached=True, index=1)
    assert list(jobs.jobs) == ["qwen-run-job1"] and jobs.submit_calls == 1
    assert said == ["no answer to the submission of qwen-run-job1 (('Connection aborted.', RemoteDisconnected("
                    "'Remote end closed connection without response'))); asking the cluster whether it arrived (1/4)"]


def test_a_submission_that_never_arrived_is_sent_again_under_the_same_id():
    jobs = _Jobs(refuse_first=2)
    submitted = submit.submit_or_attach(lambda: jobs, _request(), sleep=lambda s: None)
    assert submitted == submit.Submitted(job_id="qwen-run-job1", attached=False, index=1)
    assert list(jobs.jobs) == ["qwen-run-job1"] and jobs.submit_calls == 3


def test_a_submission_waits_for_the_heads_job_agent_as_for_the_head():
    """A local run from another folder failed at once, exit 1: "Request failed with status code 500: No
    available agent to submit job"; a rerun worked."""
    jobs, said, now = _Jobs(agent_after=3), [], [0.0]
    submitted = submit.submit_or_attach(lambda: jobs, _request(), say=said.append, sleep=lambda s: now.append(
        now[-1] + s), clock=lambda: now[-1])
    assert submitted == submit.Submitted(job_id="qwen-run-job1", attached=False, index=1)
    assert list(jobs.jobs) == ["qwen-run-job1"] and jobs.submit_calls == 4
    assert said == ["the cluster's job agent is not up yet; waiting for it"]
    now = [0.0]
    with pytest.raises(cluster.UnreachableError, match="its job agent did not come up within 10 s"):
        submit.submit_or_attach(lambda: _Jobs(agent_after=99), _request(), agent_wait_s=10,
                                sleep=lambda s: now.append(now[-1] + s), clock=lambda: now[-1])


def test_an_id_taken_by_another_run_is_skipped_and_a_cluster_that_never_answers_is_exit_3():
    jobs = _Jobs()
    # "qwen run" and "qwen-run" share the id prefix; the other run's job is not this run's.
    submit.submit_or_attach(lambda: jobs, _request("qwen run"))
    assert submit.submit_or_attach(lambda: jobs, _request("qwen-run")).job_id == "qwen-run-job2"
    with pytest.raises(cluster.UnreachableError, match="could not submit run r: Connection refused"):
        submit.submit_or_attach(lambda: _Jobs(refuse_first=99), _request("r"), sleep=lambda s: None)


def test_a_resubmitted_run_waits_for_the_world_size_it_had_and_the_driver_is_told():
    cpu = submit.same_world_size(_request(), {"event": "plan", "use_gpu": False, "num_workers": 2, "nodes": 2})
    gpu = submit.same_world_size(_request(), {"event": "plan", "use_gpu": True, "num_workers": 8, "nodes": 2})
    assert (cpu.workers, cpu.gpus) == (2, 0) and (gpu.workers, gpu.gpus) == (0, 8)
    assert submit.same_world_size(_request(), None) == _request()
    sub = submit.build_submission(train={}, run_name="r", storage_path="/tmp/s", max_failures=1, working_dir="/w",
                                  expect="any", wait_nodes_s=90, workers=2)
    args = parse_driver_args(shlex.split(sub.entrypoint)[3:])
    assert (args.wait_nodes_s, args.workers) == (90, 2)


def test_changing_data_kind_drops_the_presets_path(capsys):
    """`--set data.kind=jsonl` alone: the preset's hub dataset id is no JSONL file of the user's, and
    the error is about the path the new kind needs, before any cluster is reached."""
    code = submit.main("submit", ["--stack", "us-west-2", "--set", "data.kind=jsonl"])
    assert code == submit.EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        'submit: error: data.path is empty: kind "jsonl" needs the path (or s3:// URI) of a JSONL file')


def test_a_path_given_with_the_kind_and_an_unchanged_kind_keep_their_paths():
    from workloads.client.overrides import user_overrides

    hub = {"data": {"kind": "hub", "path": "HuggingFaceH4/ultrachat_200k"}}
    assert user_overrides(hub, ["data.kind=jsonl", "data.path=a.jsonl"]) == ["data.kind=jsonl", "data.path=a.jsonl"]
    assert user_overrides(hub, ["data.kind=hub", "data.split=test"]) == ["data.kind=hub", "data.split=test"]
    assert user_overrides(hub, ['data.kind="jsonl"']) == ["data.path=", 'data.kind="jsonl"']
    assert user_overrides({"data": {"kind": "synthetic", "path": ""}}, ["data.kind=jsonl"]) == ["data.kind=jsonl"]


class _Answer(http.server.BaseHTTPRequestHandler):
    """A web server that is not a Ray dashboard: each path gives one kind of wrong answer."""

    answers = {"/404/api/version": (404, b"no such page"), "/html/api/version": (200, b"<html>hello</html>"),
               "/json/api/version": (200, b'{"version": "1.0"}')}

    def do_GET(self):  # noqa: N802
        status, body = self.answers.get(self.path, (404, b""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def web_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("path", "answer"), [
    ("/404", "HTTP 404"), ("/html", "not JSON"), ("/json", "a JSON answer without ray_version")])
def test_an_address_that_is_no_ray_jobs_api_says_so(web_server, path, answer):
    conn = cluster.Connection(address=web_server + path, token=None, storage_path=None, target_args=())
    with pytest.raises(cluster.UnreachableError) as info:
        cluster.job_client(conn)
    assert str(info.value) == (f"nothing at {web_server + path} answers as a Ray Jobs API (GET /api/version: "
                               f"{answer}): is this the Ray head's dashboard port (8265 by default)?")
    assert "Ray 1.9" not in str(info.value)


def test_list_at_an_address_that_is_no_ray_jobs_api_exits_3_with_one_line(web_server, repo_root):
    done = subprocess.run([sys.executable, "-m", "workloads", "list", "--address", web_server], cwd=repo_root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == submit.EXIT_UNREACHABLE
    assert done.stderr.strip() == (f"list: error: nothing at {web_server} answers as a Ray Jobs API (GET "
                                   "/api/version: HTTP 404): is this the Ray head's dashboard port (8265 by default)?")


def test_refused_arguments_and_help_do_not_import_ray_or_torch(repo_root):
    """A mistyped option or --help of submit, logs, stop and list answers without importing ray or
    torch (about a second of CPU each); the cluster's refusal of the token is still told apart
    (test_submit_cluster)."""
    script = """if True:
        import contextlib, io, sys
        from workloads.__main__ import main
        codes = []
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            for argv in (["submit", "--max-failures", "x"], ["logs"], ["stop", "a", "b"], ["list", "--bogus"],
                         ["submit", "--preset", "nope"], ["list", "--help"],
                         ["submit", "--address", "http://127.0.0.1:9", "--set", "nosuchkey=1"], ["submit"]):
                try:
                    codes.append(main(argv))
                except SystemExit as exc:
                    codes.append(exc.code)
        print(codes, "ray" in sys.modules, "torch" in sys.modules)
    """
    done = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["[2,", "2,", "2,", "2,", "2,", "0,", "2,", "2]", "False", "False"], \
        done.stdout + done.stderr


def test_export_help_answers_without_importing_torch(repo_root):
    """`export --help` imported torch and transformers (11 s on a cold machine)."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *argv], cwd=repo_root, capture_output=True, text=True, timeout=120)

    done = run("-m", "workloads", "export", "--help")
    assert done.returncode == 0 and "--out FOLDER" in done.stdout
    assert "DEST" not in done.stdout  # every name in the help is a flag or its value
    imported = run("-c", "import sys, workloads.client.export; print('torch' in sys.modules)")
    assert imported.stdout.strip() == "False"


def test_export_offers_the_dtypes_the_exporter_takes():
    from workloads.client.export import DTYPE_CHOICES
    from workloads.model_io.hf_writer import EXPORT_DTYPES

    assert DTYPE_CHOICES == EXPORT_DTYPES


def test_ctrl_c_while_following_is_never_lost_in_the_log_stream(monkeypatch):
    """The first Ctrl-C under asyncio.run only cancels the streaming task; one whose cancellation is
    swallowed ends normally and following went on. Here the stream swallows it: Ctrl-C must still end
    the follow with KeyboardInterrupt, not wait for the job."""
    import asyncio
    import os
    import signal
    import threading

    class Client:
        def get_job_status(self, job_id):
            return "RUNNING"

        async def tail_job_logs(self, job_id):
            threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT)).start()
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                pass  # swallowed, as a library's cleanup may
            yield "done\n"

    waited = []
    monkeypatch.setattr(follow_mod, "wait_terminal", lambda *a, **k: waited.append(1))
    with sigint_raises(), pytest.raises(KeyboardInterrupt):
        follow_mod.follow(Client, "raysubmit_1", submit.LogPrinter(console=Console(), quiet=True))
    assert not waited
