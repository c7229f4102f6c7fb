"""`python -m workloads run --local` (what `make demo` runs): the fine-tune on a Ray cluster of this machine.

The cluster has the RayCluster's shape on EKS: a Ray head on 127.0.0.1 (dashboard and Jobs API on a
free port, token authentication on as on EKS) that offers no CPU or GPU to training workers, as the
GPU-less head pod offers no GPU, and two worker nodes that do, each on its own address as each pod
has its own IP (127.0.0.2, 127.0.0.3). It submits the "demo-cpu" preset
through the same code as `submit --address`, runs the same post-run checks as a cloud run (the
node count the driver planned is the number of nodes that trained), prints a summary, writes
runs/<name>/ under the project (report.json, loss.png, job.log, checkpoints, and the exported
model/ with the demo's inputs: workloads/local/demo.py; run.json from the start, so that `runs`
lists it and `--run-name` resumes it: workloads/client/runs.py), tracks the run into the MLflow
store runs/mlflow (or the tracking URI the user gives: workloads/client/tracking.py) and prints the
command that opens its UI, and stops every process it started,
also on failure, Ctrl-C or SIGTERM. Other Ray clusters on the machine are left alone: each node is
one `ray start --block` in its own process group.
"""

from __future__ import annotations

import argparse
import os
import re
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
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Optional

from rich.console import Console
from rich.markup import escape

from workloads.client import revisions, submit, tracking
from workloads.client.cluster import connect, first_line, free_ports
from workloads.client.datapaths import local_inputs, resolved_for_local_run
from workloads.client.inputs_check import check_inputs
from workloads.client.interrupts import INTERRUPTIONS, sigterm_raises
from workloads.client.interrupts import exit_code as interruption_exit_code
from workloads.client.overrides import user_overrides
from workloads.client.resume_changes import resume_changes
from workloads.client.runs import (RUN_FILE, RUNS_DIR, find_run, latest_checkpoint_step, now, read_run, update_run,
                                   write_run)
from workloads.client.report import (clean_log, eval_warnings, format_summary, loop_summary, method_label,
                                     resize_events, summarize, trained_share, write_report)
from workloads.client.socket_owners import holds_listener
from workloads.train.evaluation_config import EXIT_GATE_FAILED
from workloads.launch.task_history import TASK_HISTORY_ENV
from workloads.local import demo

STARTED_MARK = "Ray runtime started"
REGISTRATION_TIMEOUT_MARK = "The current node timed out during startup"
"""`ray start`'s error when its raylet has not registered with the GCS 30 s after it started: a
fixed wait in Ray 2.58 (ray/_private/node.py), which a worker node can miss on a loaded machine
(seen with the head itself taking 34 s to start). Such a node is started once more."""


@dataclass(frozen=True, kw_only=True)
class LocalClusterSpec:
    nodes: int = 2
    """Worker nodes to start beside the head, each on its own loopback address (127.0.0.2, ...)."""
    cpus_per_node: int = 1
    """Logical CPUs each worker node offers, whatever the machine has."""
    gpus_per_node: int = 0
    """GPUs each worker node offers (give each its own through `worker_env`'s CUDA_VISIBLE_DEVICES)."""
    worker_env: tuple[dict[str, str], ...] = ()
    """Extra environment of each worker node's processes, by node (e.g. its own NCCL_HOSTID, so that
    NCCL sees one host per node). Empty, or one mapping per node."""
    start_timeout_s: float = 120.0
    """How long a node may take to come up."""
    stop_grace_s: float = 5.0
    """How long a node may take to stop after SIGTERM before its process group is killed."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {self.nodes}")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be at least 1, got {self.cpus_per_node}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be 0 or more, got {self.gpus_per_node}")
        if self.worker_env and len(self.worker_env) != self.nodes:
            raise ValueError(f"worker_env has {len(self.worker_env)} entries for {self.nodes} worker nodes")


@dataclass(frozen=True, kw_only=True)
class LocalCluster:
    address: str
    """The Jobs API URL."""
    token: str
    """The cluster's Ray auth token."""
    temp_dir: Path
    """Ray's session folder root (logs)."""
    nodes: "LocalNodes" = field(compare=False, repr=False)
    """The nodes' processes: a fault-injection test stops and starts them as a lost instance, a
    replaced pod or a restarted head would."""


def node_ip(index: int) -> str:
    """Node `index`'s own loopback address (the head's is 127.0.0.1): as pods do, every node has its
    own IP, which is how Ray Train tells nodes apart (node ranks, and the GPUs it shares among the
    workers of one node)."""
    return f"127.0.0.{index + 1}"


def _node_argv(*, index: int, gcs_port: int, dashboard_port: int, temp_dir: Path, cpus: int,
               gpus: int = 0) -> list[str]:
    beside = Path(sys.executable).with_name("ray")
    ray = str(beside) if beside.is_file() else shutil.which("ray")
    if ray is None:
        raise RuntimeError(f"the ray CLI is not installed beside {sys.executable} or on PATH; run `make venv`")
    agent, agent_grpc, metrics, runtime_env, client = free_ports(5, besides=(gcs_port, dashboard_port))
    argv = [ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={node_ip(index)}",
            f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}"]
    if index == 0:
        return argv + ["--head", f"--port={gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                       f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={client}",
                       f"--temp-dir={temp_dir}"]
    # All nodes of this machine share the head's log folder, which the head's log monitor
    # already forwards to drivers; a second monitor would forward every worker line again.
    return argv + [f"--address=127.0.0.1:{gcs_port}", "--include-log-monitor=false"]


LOCAL_NODE_ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_USAGE_STATS_ENABLED": "0",
    # No Prometheus exporter on the nodes: it answers without the token, on every interface of a
    # worker node (Ray binds a node's servers to loopback only for 127.0.0.1 itself, and the worker
    # nodes have 127.0.0.2 and up); nothing of the demo reads Ray's metrics.
    "RAY_enable_metrics_collection": "0",
    # The head's task history bounded as on EKS (infra/raycluster.py).
    **TASK_HISTORY_ENV,
}
"""The environment every local node runs with, besides the token (docs/SECURITY.md lists what still
listens beyond loopback, and why)."""


def _node_env(token: str, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    # "python" in the job's entrypoint must be this interpreter, as it is the image's on EKS.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **LOCAL_NODE_ENV, "RAY_AUTH_TOKEN": token, **(extra or {})}


def _wait_started(proc: subprocess.Popen, log: Path, *, timeout_s: float, what: str, offset: int = 0) -> None:
    """Wait for the node's start message in its log, after `offset` (the node's earlier starts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")[offset:]
        if STARTED_MARK in text:
            return
        if proc.poll() is not None:
            tail = "\n".join(text.strip().splitlines()[-15:])
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting:\n{tail}")
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s (see {log})")


def _wait_http(url: str, *, timeout_s: float, what: str = "the Ray dashboard") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (401 without a token): it is up
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout_s:.0f} s")


def _check_head_holds(pids: list[int], ports: dict[str, int]) -> None:
    """RuntimeError unless a process of the head (`pids`) listens on each of `ports` (by what it is)."""
    for what, port in ports.items():
        if not holds_listener(pids, port=port):
            raise RuntimeError(f"the Ray head's {what} port 127.0.0.1:{port} is held by another process, not by the "
                               "head: the Ray token is not sent there")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the node's process group, and reap its `ray start`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class LocalNodes:
    """The `ray start --block` process of each node (0 is the head), each in its own process group,
    which holds every process of the node: its raylet, its workers and, on the head, the GCS, the
    dashboard and the jobs' drivers."""

    def __init__(self, spec: LocalClusterSpec, *, token: str, log_dir: Path, temp_dir: Path) -> None:
        self.spec, self.token, self.log_dir, self.temp_dir = spec, token, log_dir, temp_dir
        self.gcs_port, self.dashboard_port = free_ports(2)
        self.procs: dict[int, subprocess.Popen] = {}
        self.head_args: list[str] = []
        """More `ray start` options of the head (an autoscaling config: workloads/local/autoscaling.py)."""
        self.head_env: dict[str, str] = {}
        """More environment of the head's processes."""

    def log(self, index: int) -> Path:
        return self.log_dir / ("ray-head.log" if index == 0 else f"ray-node-{index}.log")

    def start(self, index: int) -> None:
        """Start node `index` (again) on its own address and wait until it has joined. Nodes start one
        after another: started together, two nodes of one machine can pick the same raylet socket (Ray
        names it after the session's sockets that exist when the node starts, and the raylet creates
        its file only later), and one of them then never registers: `ray start` exits after 30 s."""
        head = index == 0
        # The head runs the job's driver and Ray Train's controller, which reserve no CPU.
        argv = _node_argv(index=index, gcs_port=self.gcs_port, dashboard_port=self.dashboard_port,
                          temp_dir=self.temp_dir, cpus=0 if head else self.spec.cpus_per_node,
                          gpus=0 if head else self.spec.gpus_per_node) + (self.head_args if head else [])
        extra = self.head_env if head else (self.spec.worker_env[index - 1] if self.spec.worker_env else None)
        log = self.log(index)
        for attempt in (1, 2):
            offset = len(log.read_text(errors="replace")) if log.exists() else 0
            with log.open("a") as out:
                self.procs[index] = subprocess.Popen(argv, env=_node_env(self.token, extra), stdout=out,
                                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                     start_new_session=True)
            try:
                _wait_started(self.procs[index], log, timeout_s=self.spec.start_timeout_s, offset=offset,
                              what="the Ray head" if head else f"Ray node {index}")
                break
            except RuntimeError as error:
                # The head's ports and session are the cluster's own: a head that fails fails the start.
                if head or attempt == 2 or REGISTRATION_TIMEOUT_MARK not in str(error):
                    raise
                self.kill(index)  # its raylet may still be starting
        if head:
            _wait_http(f"http://127.0.0.1:{self.dashboard_port}/api/version", timeout_s=self.spec.start_timeout_s)
            # Jobs go through the head's job agent, which comes up after the dashboard (the submission
            # waits for it to register too: workloads/client/jobs.py).
            agent = next(a.split("=", 1)[1] for a in argv if a.startswith("--dashboard-agent-listen-port="))
            _wait_http(f"http://127.0.0.1:{agent}/", timeout_s=self.spec.start_timeout_s, what="the head's job agent")
            # Anything may answer on a port chosen free: the Jobs API must be the head's before the
            # client sends it the token, the GCS before the worker nodes do.
            _check_head_holds(self.pids(0), {"dashboard (Jobs API)": self.dashboard_port, "GCS": self.gcs_port})

    def kill(self, index: int) -> None:
        """Every process of node `index` SIGKILLed at once, as when its instance is lost: its process
        group, and the workers its raylet started (Ray puts them in process groups of their own)."""
        proc = self.procs.pop(index)
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_group(proc)

    def stop(self, *indices: int) -> None:
        """SIGTERM the nodes `indices` together, then kill what is left of each after the grace time."""
        procs = [self.procs.pop(index) for index in indices]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # its `ray start --block` stops its children
        deadline = time.monotonic() + self.spec.stop_grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc)

    def pids(self, index: int) -> list[int]:
        """Every process of node `index` now: its `ray start` and what descends from it."""
        proc = self.procs[index]
        return [proc.pid, *_descendants(proc.pid)]

    def roots(self) -> dict[int, int]:
        """Each node's `ray start` pid now, by index. Read from a copy of `procs`, taken in one step:
        a fault (a drain, a restart) takes nodes out of it and puts them back on another thread
        while a sampler reads it, and a node gone between listing the indices and reading one was a
        KeyError that ended the soak's memory sampler."""
        return {index: proc.pid for index, proc in dict(self.procs).items()}

    def processes(self) -> dict[int, list[int]]:
        """Every process of every node now, by node index: its `ray start` and what descends from
        it, from one copy of `procs` (roots) and one read of /proc."""
        children = _children()
        return {index: [root, *_descendants(root, children)] for index, root in sorted(self.roots().items())}

    def node_of(self, pid: int) -> Optional[int]:
        """The node whose processes include `pid` (it descends from the node's `ray start`), or None."""
        nodes = {root: index for index, root in self.roots().items()}
        while pid and pid not in nodes:
            pid = _parent_of(pid) or 0
        return nodes.get(pid)

    def restart_head(self) -> None:
        """The head lost and started again, as a head pod restarts: every process of the head is
        killed. Without GCS fault tolerance the worker nodes' raylets cannot rejoin a new head and
        exit, and their pods restart: here they are killed with the head and started again after it."""
        for index in sorted(self.procs):
            self.kill(index)
        for index in range(self.spec.nodes + 1):
            self.start(index)

    def stop_all(self) -> None:
        """The worker nodes first (together), then the head."""
        self.stop(*sorted(i for i in self.procs if i))
        if 0 in self.procs:
            self.stop(0)


def _parent_of(pid: int) -> Optional[int]:
    """The parent of a process, from Linux's /proc; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _children() -> dict[int, list[int]]:
    """Each live process's children, by parent pid, from Linux's /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (parent := _parent_of(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    return children


def _descendants(root: int, children: Optional[dict[int, list[int]]] = None) -> list[int]:
    """Every process that descends from `root`, from Linux's /proc (or `children`, one read of it)."""
    children = _children() if children is None else children
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def node_name(index: int) -> str:
    return "the head" if index == 0 else f"worker node {index}"


@contextmanager
def local_ray_cluster(spec: LocalClusterSpec, *, log_dir: Path,
                      say: Callable[[str], None] = lambda message: None) -> Iterator[LocalCluster]:
    """A Ray head that offers nothing to training workers plus `spec.nodes` worker nodes, all on
    127.0.0.1, stopped (every process) on exit. `say` hears of each node once it is up, with the
    seconds it took (tens of seconds each on a busy machine)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Ray puts Unix sockets under the temp dir: keep its path short.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-local-", dir="/tmp"))
    nodes = LocalNodes(spec, token=secrets.token_hex(32), log_dir=log_dir, temp_dir=temp_dir)
    try:
        for index in range(spec.nodes + 1):
            started = time.monotonic()
            nodes.start(index)
            say(f"{node_name(index)} is up ({time.monotonic() - started:.0f} s)")
        yield LocalCluster(address=f"http://127.0.0.1:{nodes.dashboard_port}", token=nodes.token,
                           temp_dir=temp_dir, nodes=nodes)
    finally:
        nodes.stop_all()
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def log_kept_on_interrupt(conn, job_ids: list[str], *, path: Path, console: Console) -> Iterator[None]:
    """On Ctrl-C or SIGTERM while following, write the submitted job's log so far (cleaned) to
    `path` before the interruption goes on to stop the cluster."""
    try:
        yield
    except INTERRUPTIONS:
        if job_ids:
            try:
                path.write_text(clean_log(submit.job_client(conn).get_job_logs(job_ids[0])))
                console.print(f"the job's log so far is in {path}")
            except Exception as exc:  # the interruption matters more than the log
                console.print(f"could not keep the job's log: {first_line(str(exc))}")
        raise


def _arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workloads run", description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true",
                        help="start the Ray cluster on this machine: the only mode of `run`, so it may be left out")
    parser.add_argument("--preset", default="demo-cpu", help="training preset (default: demo-cpu)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set steps=20 (repeatable)")
    parser.add_argument("--nodes", type=int, default=2,
                        help="Ray worker nodes beside the head, which runs no training worker (default: 2)")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs (= workers) per worker node")
    parser.add_argument("--run-name", help="the run's name (its folder, its Ray Train and tracker run); an existing "
                        "run's name resumes it from its latest checkpoint (default: <preset>-<UTC time>)")
    parser.add_argument("--out", "--runs-dir", dest="runs_dir", type=Path, default=RUNS_DIR,
                        help=f"where runs go, wherever the command runs from (default: {RUNS_DIR})")
    parser.add_argument("--verbose", action="store_true", help="show every job log line, not only progress")
    parser.add_argument("--force-resume", action="store_true",
                        help="resume a run although --set changes what its checkpoint depends on (seq_len, the "
                        "tokenizer, the model, the method)")
    parser.add_argument("--no-tracking", action="store_true",
                        help="do not track the run (default: MLflow, in <runs-dir>/mlflow unless --set tracking.uri "
                        "or MLFLOW_TRACKING_URI names another tracker)")
    return parser


def local_train_config(args: argparse.Namespace, run_dir: Path, *,
                       say: Callable[[str], None] = lambda line: None) -> tuple[dict, demo.DemoInputs]:
    """The run's config, with every local input it names checked (seconds, before any cluster
    starts) and its hub model and dataset pinned to commits (`say` hears of each), and what the
    demo will make for it. ValueError for a mistake."""
    from workloads.train.config import TrainConfig, preset, with_overrides

    inputs = demo.plan_demo_inputs(run_dir, preset_name=args.preset, overrides=args.set)
    base = preset(args.preset)
    cfg = with_overrides(base, [*inputs.overrides, *user_overrides(base.to_dict(), args.set), "transport.expect=any"])
    if not inputs.model:  # model.name_or_path naming a run (an SFT run for DPO): its model
        from workloads.train.starting import with_starting_model

        cfg, started = with_starting_model(cfg)
        if started:
            say(started)
    train = resolved_for_local_run(cfg.to_dict(), cwd=Path.cwd(), made=inputs.fields)
    local = local_inputs(train, cwd=Path.cwd(), made=inputs.fields)
    check_inputs(train, local=local, hub=True)
    # Every rank runs on this machine: refused here when their memory together would not fit. The
    # toy model the demo is about to make has tiny-qwen2's shape.
    from workloads.client.fit import Target, check_fits, host_available_gib
    from workloads.model_io.architectures import named_architecture

    check_fits(TrainConfig.from_dict(train), Target.host(ranks=args.nodes * args.cpus_per_node,
                                                         available_gib=host_available_gib()),
               what=f"{args.preset} (as set)", cwd=Path.cwd(),
               config=named_architecture("tiny-qwen2") if inputs.model is not None else None)
    train, pinned = revisions.pin_hub_revisions(train, local=local)
    for line in pinned:
        say(line)
    return train, inputs


def evaluated_locally(train: dict, *, runs_dir: Path, say: Callable[[str], None],
                      base_made_later: bool = False) -> dict:
    """The run's evaluation checked before the cluster starts (workloads/evaluate/stage.py), and its
    base's scores kept beside the runs, where the next local run on the same base finds them."""
    from workloads.evaluate.cache import CACHE_DIR
    from workloads.train.evaluation_config import HELDOUT_TASK, task_names
    from workloads.evaluate.stage import check_before_training
    from workloads.evaluate.tasks import hub_reachable

    standard = any(task != HELDOUT_TASK for task in task_names(train["evaluate"]["tasks"]))
    for note in check_before_training(train, network=hub_reachable() if standard else True,
                                      base_made_later=base_made_later and not train["evaluate"]["base"]):
        say(f"[bold cyan]evaluate[/] {note}")
    if train["evaluate"]["cache"]:
        return train
    return {**train, "evaluate": {**train["evaluate"], "cache": str(runs_dir.resolve() / CACHE_DIR)}}


RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def resumed_train_config(record: dict, args: argparse.Namespace, run_dir: Path, *,
                         say: Callable[[str], None] = lambda line: None) -> dict:
    """The config of a run being resumed: the one it started with, the user's --set on top (more
    steps, say; `say` hears what changed), its local inputs checked again. ValueError when there is
    nothing left to train, or for a change that breaks the resume (without --force-resume)."""
    from workloads.train.config import TrainConfig, with_overrides

    saved = TrainConfig.from_dict(record["train"])
    train = with_overrides(saved, user_overrides(saved.to_dict(), args.set)).to_dict()
    changes = resume_changes(record["train"], train, run_name=record.get("name", run_dir.name),
                             force=args.force_resume)
    check_inputs(train, local=local_inputs(train, cwd=Path.cwd()), hub=True)
    done = latest_checkpoint_step(run_dir)
    if done is not None and done >= train["steps"]:
        raise ValueError(f"run {run_dir.name} has trained its {done} steps: --set steps=N (more than {done}) goes on "
                         "from its last checkpoint")
    for line in changes:
        say(line)
    return train


def run_local(args: argparse.Namespace, console: Console) -> int:
    spec = LocalClusterSpec(nodes=args.nodes, cpus_per_node=args.cpus_per_node)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if args.run_name is not None and not RUN_NAME.match(args.run_name):
        raise ValueError(f"--run-name {args.run_name!r}: use letters, digits, '.', '_' and '-' (a folder of "
                         f"{args.runs_dir} is named after it)")
    # One name for the run everywhere: its folder, its job and plot, its tracker run, chat and export.
    name = args.run_name or f"{args.preset}-{stamp}"
    run_dir = (find_run(args.runs_dir, name) or args.runs_dir / name).resolve()
    record = read_run(run_dir)
    if record is None and run_dir.is_dir() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} holds no run to resume (no {RUN_FILE}): choose another --run-name")
    hub_said = lambda line: console.print(f"[bold cyan]hub[/] {line}")  # noqa: E731
    if record is not None:
        said: list[str] = []
        train = resumed_train_config(record, args, run_dir, say=said.append)
        inputs, run_name = demo.DemoInputs(), record["name"]
        console.print(f"[bold cyan]local[/] resuming run {run_name} from its latest checkpoint (step "
                      f"{latest_checkpoint_step(run_dir) or 0} of {train['steps']})")
        for line in said:
            console.print(f"[bold cyan]local[/] {escape(line)}", highlight=False)
    else:
        train, inputs = local_train_config(args, run_dir, say=hub_said)
        train = evaluated_locally(train, runs_dir=args.runs_dir, say=lambda line: console.print(line, highlight=False),
                                  base_made_later="model.name_or_path" in inputs.fields)
        run_name = name
    train, tracking_uri = local_tracking(train, args, run_name=run_name, console=console)
    # Credentials in the URI reach the job as MLflow's variables in its processes' environment, not
    # in its config (entrypoint, report.json, logs).
    tracking_uri, uri_credentials = tracking.split_credentials(tracking_uri)
    if inputs.model is not None and inputs.chats is None:
        console.print(f"[bold cyan]local[/] your data trains a toy model made in {inputs.model} (random weights; its "
                      "tokenizer reads any text); --set model.name_or_path=FOLDER starts from another, such as "
                      "a demo run's runs/<name>/model")
    demo.write_demo_inputs(inputs)
    write_run(run_dir, {**(record or {}), "name": run_name, "preset": (record or {}).get("preset", args.preset),
                        "train": train, "status": "running", "started": (record or {}).get("started", now()),
                        "resumed": (record or {}).get("resumed", -1) + 1})
    try:
        code = _train_on_local_cluster(args, console, spec=spec, run_dir=run_dir, run_name=run_name, train=train,
                                       inputs=inputs, tracking_uri=tracking_uri, uri_credentials=uri_credentials)
    except INTERRUPTIONS:
        update_run(run_dir, status="interrupted", ended=now())
        raise
    except BaseException:
        update_run(run_dir, status="failed", ended=now())
        raise
    status = "succeeded" if code == submit.EXIT_OK else "gate failed" if code == EXIT_GATE_FAILED else "failed"
    update_run(run_dir, status=status, ended=now())
    return code


def resume_command(run_name: str) -> str:
    """The command that resumes a local run from its latest checkpoint."""
    return f"python -m workloads run --run-name {run_name}"


def run_title(run_name: str, train: dict, *, nodes: int, final: Optional[dict] = None) -> str:
    """The loss plot's title: the run, what it trained and on what (not the preset's name alone), and
    how: the method, and for LoRA the parameters it trained as the loop's summary (`final`) counts them."""
    model = train["model"]["name_or_path"]
    model = "toy model" if Path(model).name == "base-model" else Path(model).name if "/" in model else model
    data = train["data"]
    source = "synthetic tokens" if data["kind"] == "synthetic" else Path(data["path"]).name if data[
        "kind"] == "jsonl" else data["path"]
    method = method_label(train)
    share = trained_share(final or {})
    if share is not None and train.get("method") == "lora":
        method += (f": {int(final['trained_params']):,} of {int(final['params']):,} parameters trained "
                   f"({100 * share:.2f}%)")
    return f"{run_name}: {model} on {source}, {method}, {nodes} local worker node(s)"


def _train_on_local_cluster(args: argparse.Namespace, console: Console, *, spec: LocalClusterSpec, run_dir: Path,
                            run_name: str, train: dict, inputs: demo.DemoInputs, tracking_uri: str,
                            uri_credentials: dict[str, str]) -> int:
    console.print(f"[bold cyan]local[/] starting a Ray cluster on 127.0.0.1: a head and {spec.nodes} worker "
                  f"nodes x {spec.cpus_per_node} CPU (logs in {run_dir})")
    say = lambda message: console.print(f"[bold cyan]local[/] {message}")  # noqa: E731
    try:
        with environment_with(uri_credentials), local_ray_cluster(spec, log_dir=run_dir / "ray", say=say) as cluster:
            console.print(f"[bold cyan]local[/] Jobs API at {cluster.address}")
            with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
                request = submit.SubmitRequest(train=train, run_name=run_name,
                                               storage_path=str(run_dir / "checkpoints"), max_failures=0,
                                               expect="any", quiet=not args.verbose)
                submitted: list[str] = []
                with log_kept_on_interrupt(conn, submitted, path=run_dir / "job.log", console=console):
                    outcome = submit.submit_and_follow(conn, request, console=console,
                                                       on_submitted=submitted.append)
    except INTERRUPTIONS:
        # The cluster is down, the run's rank 0 with it: its tracker run would stay RUNNING, or FAILED
        # where a rank or the driver saw the others go first.
        if tracking_uri and (run_dir / "job.log").is_file():
            with environment_with(uri_credentials):
                tracking.end_stopped_run((run_dir / "job.log").read_text(), uri=tracking_uri,
                                         say=lambda line: console.print(line, highlight=False, markup=False))
        console.print(f"[bold cyan]local[/] {resume_command(run_dir.name)} resumes it from its latest checkpoint",
                      highlight=False)
        raise
    (run_dir / "job.log").write_text(clean_log(outcome.logs))
    submit.report_outcome(outcome, console)
    if not outcome.records:
        console.print(f"no training steps were reported; the job's log is {run_dir / 'job.log'}")
        return outcome.exit_code or submit.EXIT_FAILED
    final = loop_summary(outcome.logs.splitlines())
    summary = summarize(outcome.records, final=final)
    evaluation = show_evaluation(outcome.logs, run_dir=run_dir, console=console)
    json_path, png_path = write_report(run_dir, records=outcome.records, summary=summary, meta={
        "title": run_title(run_name, train, nodes=spec.nodes, final=final), "job_id": outcome.job_id,
        "status": outcome.status, "preset": args.preset, "config": train, "run_name": run_name,
        "cluster": {"worker_nodes": spec.nodes, "cpus_per_node": spec.cpus_per_node},
        "trained_on_nodes": (final or {}).get("nodes"), "checks": [asdict(check) for check in outcome.checks],
        "loop_summary": final, "resizes": resize_events(outcome.logs.splitlines()), "evaluation": evaluation,
    }, final=final)
    console.print(f"[bold]summary[/] {format_summary(summary)}")
    for warning in eval_warnings(outcome.records, data=(final or {}).get("data")):
        console.print(f"[bold yellow]warning[/] {warning}", highlight=False)
    console.print(f"[bold]report[/]  {json_path}  {png_path}")
    if outcome.exit_code == EXIT_GATE_FAILED:
        console.print(f"[bold red]model[/]   not made the run's model ({run_dir / 'model'}): it missed its evaluation "
                      f"gate; its checkpoint is kept in {run_dir / 'checkpoints'} (python -m workloads export "
                      f"{run_dir} --out FOLDER takes it anyway)", highlight=False)
    if outcome.exit_code == submit.EXIT_OK:
        from workloads.model_io.toy import DEMO_PROMPT

        demo.show_model(run_dir, console, question=DEMO_PROMPT if inputs.chats else demo.closing_question(train),
                        checkpoint="best" if train["checkpoint"]["keep_best"] else None)
        console.print(f"[bold]chat[/]    python -m workloads chat {run_dir.name}   (python -m workloads runs lists "
                      "the local runs)", highlight=False)
    show_tracked(outcome.logs, train=train, uri=tracking_uri, files=(json_path, png_path), model=run_dir / "model",
                 console=console)
    return outcome.exit_code


def show_evaluation(logs: str, *, run_dir: Path, console: Console) -> Optional[dict]:
    """The job's evaluation (workloads/evaluate; the job's lines showed its table): its plot in the run's
    folder, its record for report.json."""
    from workloads.evaluate.report import EVALUATION_PLOT, evaluation_from_logs, plot_evaluation

    record = evaluation_from_logs(logs)
    if record is not None and record.get("rows"):
        plot_evaluation(record, run_dir / EVALUATION_PLOT)
        console.print(f"[bold]evaluate[/] {run_dir / EVALUATION_PLOT}", highlight=False)
    return record


@contextmanager
def environment_with(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` (unless set already), while the block runs: the
    local cluster's processes, started inside it, inherit them."""
    added = {k: v for k, v in values.items() if not os.environ.get(k)}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def local_tracking(train: dict, args: argparse.Namespace, *, run_name: str, console: Console) -> tuple[dict, str]:
    """The run's config with its tracker (the local store by default) and the URI; ("", ...) untracked."""
    if args.no_tracking:  # also when the environment names a tracker the workers would see
        return {**train, "tracking": {**train["tracking"], "uri": "off"}}, ""
    uri = tracking.resolve_uri(train)
    if not uri:
        if not tracking.mlflow_installed():
            console.print("[bold cyan]local[/] not tracked: MLflow is not installed (pip install -e '.[tracking]')")
            return train, ""
        uri = tracking.local_store_uri(args.runs_dir)
    return tracking.with_tracking(train, uri=uri, run_name=run_name, tags=tracking.client_tags()), uri


def show_tracked(logs: str, *, train: dict, uri: str, files: tuple[Path, ...], model: Path, console: Console) -> None:
    """Add the report, loss plot and exported model to the run's tracker run, and say how to open it."""
    run = tracking.tracked_run(logs) if uri else None
    if run is None:
        if uri:
            console.print(f"[bold]tracking[/] the job's log names no tracker run at {uri}")
        return
    tracking.add_local_results(run, train=train, files=files, model=model if model.is_dir() else None,
                               say=lambda line: console.print(line, highlight=False))
    console.print(f"[bold]tracking[/] {tracking.where_to_look(run, uri=uri)}", highlight=False)


def main(command: str, argv: list[str]) -> int:
    console = Console(highlight=False, soft_wrap=True)
    try:
        args = _arg_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        with sigterm_raises():
            return run_local(args, console)
    except ValueError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return submit.EXIT_USAGE
    except RuntimeError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return submit.EXIT_FAILED
    except INTERRUPTIONS as stop:
        console.print("interrupted: the local Ray cluster was stopped")
        return interruption_exit_code(stop)
