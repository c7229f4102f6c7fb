"""`python -m workloads run --local` (what `make demo` runs): the fine-tune on a Ray cluster of this machine.

Starts a Ray head on 127.0.0.1 (dashboard and Jobs API on a free port, token authentication on as
on EKS) and a second Ray node, each offering a fixed number of logical CPUs so that the workers
land on both nodes; submits the "demo-cpu" preset through the same code as `submit --address`;
prints a summary; writes runs/<timestamp>/ (report.json, loss.png, job.log, checkpoints, and the
exported model/ with the demo's inputs: workloads/client/demo.py); and
stops every process it started, also on failure, Ctrl-C or SIGTERM. Other Ray clusters on the
machine are left alone: each node is one `ray start --block` in its own process group.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

from rich.console import Console

from workloads.client import demo, submit
from workloads.client.cluster import connect, free_port
from workloads.client.report import format_summary, loop_summary, summarize, write_report

STARTED_MARK = "Ray runtime started"


@dataclass(frozen=True, kw_only=True)
class LocalClusterSpec:
    nodes: int = 2
    """Ray nodes to start: the head and nodes - 1 more, all on 127.0.0.1."""
    cpus_per_node: int = 1
    """Logical CPUs each node offers (one worker each), whatever the machine has."""
    start_timeout_s: float = 120.0
    """How long a node may take to come up."""
    stop_grace_s: float = 5.0
    """How long a node may take to stop after SIGTERM before its process group is killed."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {self.nodes}")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be at least 1, got {self.cpus_per_node}")


@dataclass(frozen=True, kw_only=True)
class LocalCluster:
    address: str
    """The Jobs API URL."""
    token: str
    """The cluster's Ray auth token."""
    temp_dir: Path
    """Ray's session folder root (logs)."""


def _node_argv(*, head: bool, gcs_port: int, dashboard_port: int, temp_dir: Path, cpus: int) -> list[str]:
    ray = Path(sys.executable).with_name("ray")
    if not ray.is_file():
        raise RuntimeError(f"the ray CLI is not installed beside {sys.executable}; run `make venv`")
    free = free_port
    argv = [str(ray), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}", "--num-gpus=0", f"--dashboard-agent-listen-port={free()}",
            f"--dashboard-agent-grpc-port={free()}", f"--metrics-export-port={free()}",
            f"--runtime-env-agent-port={free()}"]
    if head:
        return argv + ["--head", f"--port={gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                       f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free()}",
                       f"--temp-dir={temp_dir}"]
    # All nodes of this machine share the head's log folder, which the head's log monitor
    # already forwards to drivers; a second monitor would forward every worker line again.
    return argv + [f"--address=127.0.0.1:{gcs_port}", "--include-log-monitor=false"]


def _node_env(token: str) -> dict[str, str]:
    # "python" in the job's entrypoint must be this interpreter, as it is the image's on EKS.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
            "RAY_USAGE_STATS_ENABLED": "0"}


def _wait_started(proc: subprocess.Popen, log: Path, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if STARTED_MARK in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting:\n{tail}")
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s (see {log})")


def _wait_http(url: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without a token): it is up
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the Ray dashboard did not answer at {url} within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM the node's `ray start --block` (it stops its children), then kill what is left of
    its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def local_ray_cluster(spec: LocalClusterSpec, *, log_dir: Path) -> Iterator[LocalCluster]:
    """A Ray cluster of `spec.nodes` nodes on 127.0.0.1, stopped (every process) on exit."""
    token = secrets.token_hex(32)
    gcs_port, dashboard_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    log_dir.mkdir(parents=True, exist_ok=True)
    # Ray puts Unix sockets under the temp dir: keep its path short.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-local-", dir="/tmp"))
    try:
        for index in range(spec.nodes):
            head = index == 0
            log = log_dir / ("ray-head.log" if head else f"ray-node-{index}.log")
            argv = _node_argv(head=head, gcs_port=gcs_port, dashboard_port=dashboard_port,
                              temp_dir=temp_dir, cpus=spec.cpus_per_node)
            with log.open("w") as out:
                procs.append(subprocess.Popen(argv, env=_node_env(token), stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            _wait_started(procs[-1], log, timeout_s=spec.start_timeout_s,
                          what="the Ray head" if head else f"Ray node {index}")
            if head:
                _wait_http(f"http://127.0.0.1:{dashboard_port}/api/version", timeout_s=spec.start_timeout_s)
        yield LocalCluster(address=f"http://127.0.0.1:{dashboard_port}", token=token, temp_dir=temp_dir)
    finally:
        for proc in reversed(procs):
            _stop(proc, grace_s=spec.stop_grace_s)
        shutil.rmtree(temp_dir, ignore_errors=True)


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that no library's `except Exception` swallows it."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def _arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workloads run", description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", required=True,
                        help="start the Ray cluster on this machine (the only mode of `run`)")
    parser.add_argument("--preset", default="demo-cpu", help="training preset (default: demo-cpu)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set steps=20 (repeatable)")
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes (default: 2)")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs (= workers) per node")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where run reports go (default: runs)")
    parser.add_argument("--verbose", action="store_true", help="show every job log line, not only progress")
    return parser


def run_local(args: argparse.Namespace, console: Console) -> int:
    from workloads.train.config import preset, with_overrides

    spec = LocalClusterSpec(nodes=args.nodes, cpus_per_node=args.cpus_per_node)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = (args.runs_dir / stamp).resolve()
    inputs = demo.demo_inputs(run_dir, preset_name=args.preset, overrides=args.set)
    train = with_overrides(preset(args.preset), [*inputs, *args.set, "transport.expect=any"]).to_dict()
    console.print(f"[bold cyan]local[/] starting a Ray cluster: {spec.nodes} nodes x {spec.cpus_per_node} CPU "
                  f"on 127.0.0.1 (logs in {run_dir})")
    with local_ray_cluster(spec, log_dir=run_dir / "ray") as cluster:
        console.print(f"[bold cyan]local[/] Jobs API at {cluster.address}")
        with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
            request = submit.SubmitRequest(train=train, run_name=f"{args.preset}-{stamp}",
                                           storage_path=str(run_dir / "checkpoints"), max_failures=0,
                                           expect="any", quiet=not args.verbose)
            outcome = submit.submit_and_follow(conn, request, console=console)
    (run_dir / "job.log").write_text(outcome.logs)
    submit.report_outcome(outcome, console)
    if not outcome.records:
        console.print(f"no training steps were reported; the job's log is {run_dir / 'job.log'}")
        return outcome.exit_code or submit.EXIT_FAILED
    final = loop_summary(outcome.logs.splitlines())
    summary = summarize(outcome.records, final=final)
    json_path, png_path = write_report(run_dir, records=outcome.records, summary=summary, meta={
        "title": f"{args.preset} on {spec.nodes} local Ray nodes", "job_id": outcome.job_id,
        "status": outcome.status, "preset": args.preset, "config": train,
        "cluster": {"nodes": spec.nodes, "cpus_per_node": spec.cpus_per_node}, "loop_summary": final,
    })
    console.print(f"[bold]summary[/] {format_summary(summary)}")
    console.print(f"[bold]report[/]  {json_path}  {png_path}")
    if outcome.exit_code == submit.EXIT_OK:
        demo.show_model(run_dir, console, ask=bool(inputs))
    return outcome.exit_code


def main(command: str, argv: list[str]) -> int:
    console = Console(highlight=False, soft_wrap=True)
    try:
        args = _arg_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return run_local(args, console)
    except ValueError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return submit.EXIT_USAGE
    except RuntimeError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return submit.EXIT_FAILED
    except (KeyboardInterrupt, _Terminated):
        console.print("interrupted: the local Ray cluster was stopped")
        return submit.EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
