"""submit's and cluster's pure parts: stack outputs, the Jobs API request, the log printer, the offline transport check."""

from __future__ import annotations

import io
import json
import shlex
import tomllib
from pathlib import Path

import pytest
from ray.runtime_env import RuntimeEnv
from rich.console import Console

from workloads.client import cluster, submit
from workloads.launch.driver import parse_args as parse_driver_args
from workloads.context import GATE_PREFIX
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
    assert sub.runtime_env["pip"] == {"packages": ["liger-kernel==0.8.5"], "pip_check": False}
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
    assert packages == (["liger-kernel==0.8.5"] if expect == "efa" else [])


def test_the_gpu_packages_are_the_pins_of_pyprojects_gpu_extra():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert list(submit.GPU_PACKAGES) == pyproject["project"]["optional-dependencies"]["gpu"]


def test_the_working_dir_holds_only_the_workloads_package():
    with submit.staged_package() as stage:
        top = sorted(p.name for p in stage.iterdir())
        files = [p for p in stage.rglob("*") if p.is_file()]
        assert top == ["workloads"]
        assert (stage / "workloads" / "driver.py").is_file() and (stage / "workloads" / "loop.py").is_file()
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
        "train step      5/60  loss 2.5000  1,234 tokens/s/worker",
        "train step     10/60  loss 2.0000",
    ]


def test_the_printer_shows_the_loops_gate_line_once():
    printer, out = _printer(quiet=True)
    gate = {"applies": False, "passed": True, "message": "transport gate does not apply: gloo"}
    line = f"(RayTrainWorker pid=7) {GATE_PREFIX}{json.dumps(gate)}\n"
    printer.feed(line + line)
    assert out.getvalue().splitlines() == ["gate transport gate does not apply: gloo"]


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


def test_the_exit_code_is_the_job_status_and_then_the_transport_check():
    passed = submit.GateOutcome(applies=True, passed=True, message="PASS")
    failed = submit.GateOutcome(applies=True, passed=False, message="FAIL")
    assert submit.JobOutcome(job_id="j", status="SUCCEEDED", gate=passed).exit_code == 0
    assert submit.JobOutcome(job_id="j", status="SUCCEEDED", gate=failed).exit_code == 1
    assert submit.JobOutcome(job_id="j", status="FAILED", reason="boom").exit_code == 1
    assert submit.JobOutcome(job_id="j", status="STOPPED").exit_code == 1


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
