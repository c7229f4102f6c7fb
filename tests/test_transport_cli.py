"""`python -m workloads verify-transport` as a user runs it: one subprocess per exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SYNTHETIC = Path(__file__).parent / "fixtures" / "nccl_synthetic"


def verify(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workloads", "verify-transport", *args],
        cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )


def test_exit_0_single_node_nvlink_under_expect_efa(repo_root, shared_dir):
    out = verify(str(shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log"), "--expect", "efa", "--nodes", "1",
                 cwd=repo_root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        "PASS: 2 rank-to-rank link(s) on 1 node(s) (vm); 2 link(s) within a node over P2P/CUMEM")


def test_exit_1_forced_socket_names_ranks_hosts_and_transport(repo_root, shared_dir):
    out = verify(str(shared_dir / "fixtures/nccl/h200x2-forced-socket.log"), cwd=repo_root)
    assert out.returncode == 1
    assert "wrong transport: rank 0 (vm) -> rank 1 (vm): NET/Socket within a node" in out.stdout


def test_exit_1_tcp_between_nodes_across_several_logs(repo_root, tmp_path):
    # Per-node files given separately are judged together.
    lines = (SYNTHETIC / "tcp-fallback-2x4.log").read_text().splitlines()
    files = []
    for host in ("ip-10-0-1-5", "ip-10-0-1-6"):
        path = tmp_path / f"{host}.log"
        path.write_text("\n".join(line for line in lines if line.startswith(host)))
        files.append(str(path))
    out = verify(*files, "--nodes", "2", cwd=repo_root)
    assert out.returncode == 1
    assert "rank 3 (ip-10-0-1-5) -> rank 4 (ip-10-0-1-6): NET/Socket between nodes" in out.stdout


def test_exit_0_expect_any_accepts_sockets_between_nodes(repo_root):
    out = verify(str(SYNTHETIC / "tcp-fallback-2x4.log"), "--expect", "any", "--nodes", "2", cwd=repo_root)
    assert out.returncode == 0, out.stdout


def test_exit_3_no_connection_lines(repo_root):
    out = verify(str(SYNTHETIC / "no-connections-2x4.log"), cwd=repo_root)
    assert out.returncode == 3
    assert "no NCCL connection lines" in out.stdout


def test_stdin_dash(repo_root):
    out = verify("-", cwd=repo_root, stdin=(SYNTHETIC / "efa-2x4-aws-libfabric.log").read_text())
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/nccl.log"], "cannot read /nonexistent/nccl.log: No such file or directory"),
        (["--expect", "ib", "x.log"], "argument --expect: invalid choice: 'ib'"),
        (["--nodes", "0", "x.log"], "argument --nodes: must be a whole number >= 1, got '0'"),
        ([], "the following arguments are required: LOG"),
        (["."], "cannot read .: Is a directory"),
    ],
)
def test_exit_2_bad_input_is_one_line(repo_root, args, message):
    out = verify(*args, cwd=repo_root)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert message in out.stderr


def test_json_report(repo_root):
    out = verify(str(SYNTHETIC / "efa-2x4-one-socket-link.log"), "--nodes", "2", "--json", cwd=repo_root)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["status"] == "fail" and report["exit_code"] == 1
    assert report["expect"] == "efa" and report["nodes"] == 2
    assert report["hosts"] == ["ip-10-0-1-5", "ip-10-0-1-6"]
    bad = [link for link in report["links"] if not link["ok"]]
    assert [(b["src"], b["dst"], b["src_host"], b["dst_host"], b["scope"], b["transports"]) for b in bad] == [
        (7, 0, "ip-10-0-1-6", "ip-10-0-1-5", "inter", ["NET/Socket"])
    ]
    assert len(report["links"]) == 8


def test_json_report_inconclusive(repo_root, shared_dir):
    out = verify(str(shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log"), "--nodes", "2", "--json", cwd=repo_root)
    assert out.returncode == 3
    report = json.loads(out.stdout)
    assert report["status"] == "inconclusive" and report["problems"] == [] and len(report["gaps"]) == 1


GLOO_JOB_LOG = """\
[driver] {"cpus_per_worker": 1.0, "event": "plan", "nodes": 2, "num_workers": 2, "run_name": "demo-cpu-1", \
"use_gpu": false}
(RayTrainWorker pid=5920) [transport-gate] {"applies":false,"passed":true,"message":"transport gate does not apply \
to the gloo backend (it checks NCCL transports)"}
"""
"""The lines of a `make demo` job's log that say how its ranks talked (a real run's, trimmed)."""


def test_a_gloo_job_log_is_said_to_be_no_nccl_run(repo_root, tmp_path):
    log = tmp_path / "job.log"
    log.write_text(GLOO_JOB_LOG)
    out = verify(str(log), cwd=repo_root)
    assert out.returncode == 3  # nothing to judge, as for any log without NCCL connections
    assert out.stdout.splitlines()[0].startswith("INCONCLUSIVE: not an NCCL run: the ranks talked over gloo")
    assert "NCCL_DEBUG" not in out.stdout  # no advice to turn on NCCL's logging for a run without NCCL
    assert "its ranks used the gloo backend (CPU workers), so NCCL made no connection to check" in out.stdout


@pytest.mark.parametrize("as_json", [True, False])
def test_a_reader_that_leaves_early_is_no_crash(repo_root, as_json):
    """`verify-transport --json LOG | head -1`: head exits before the report is written."""
    args = [str(SYNTHETIC / "efa-2x4-libfabric.log"), "--nodes", "2"] + (["--json"] if as_json else [])
    proc = subprocess.Popen([sys.executable, "-m", "workloads", "verify-transport", *args], cwd=repo_root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo_root)})
    proc.stdout.close()  # the reader is gone before the first write
    _, err = proc.communicate(timeout=60)
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert proc.returncode == verify(*args, cwd=repo_root).returncode == 0  # the verdict's code still
