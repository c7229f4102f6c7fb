"""A local Ray cluster that scales its workers to zero, driven by Ray's own autoscaler: the Ray side
of `gpuIdleMinutes`, rehearsed on one machine.

As on EKS, where KubeRay's in-tree autoscaler (v2) adds and removes worker pods, here the head runs
Ray's autoscaler v2 (`ray start --head --autoscaling-config`), and `LocalNodeProvider` is its cloud:
each worker "instance" is one `ray start --block` of the project's local cluster
(workloads/local/run.py) on its own loopback address, in its own process group, that the
autoscaler starts when a job's demand does not fit and stops once the node has been idle for the
idle timeout. The cluster starts with no worker at all, like a stack whose GPU nodes are at zero.

Ray ships a fake multi-node provider for its own tests (`ray.autoscaler._private.fake_multi_node`);
it starts every node on the machine's one address, where Ray Train sees a single node, and its test
cluster stops Ray machine-wide (`ray stop --force`). This provider gives each node its address and
records every node's process group in a state file, so that the cluster is stopped by its own
processes alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (NODE_KIND_HEAD, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME,
                                 TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE)

from workloads.files import replace_whole
from workloads.local.run import LocalClusterSpec, LocalNodes, _node_argv, _wait_started, node_ip

HEAD_NODE_ID = "local-head"
HEAD_NODE_TYPE = "ray.head.default"
WORKER_NODE_TYPE = "worker"
STATE_FILE = "nodes.json"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:  # a zombie has exited
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_is_ours(pgid: int, marker: str) -> bool:
    """Whether a process of group `pgid` names `marker` (this cluster's GCS address) on its command
    line: a node's group is only signalled while it still holds one of this cluster's processes."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def stop_process_group(pid: int, *, grace_s: float, marker: str) -> None:
    """SIGTERM a node's process group (its `ray start --block` stops its raylet and workers), then
    SIGKILL what is left after `grace_s`; nothing when no process of the group is this cluster's."""
    if not group_is_ours(pid, marker):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if not group_is_ours(pid, marker):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalNodeProvider(NodeProvider):
    """Ray's node provider interface over local `ray start --block` processes.

    `provider_config` keys: `state_dir` (the state file and the nodes' logs), `gcs_port`,
    `dashboard_port` and `temp_dir` (the head's), `max_nodes` (addresses 127.0.0.2 onward). The
    state file maps each node ID to its address, process group and tags, and is rewritten on every
    change: the cluster's owner stops the nodes it lists, whatever becomes of the autoscaler."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.state_dir = Path(provider_config["state_dir"])
        self.gcs_port = int(provider_config["gcs_port"])
        self.dashboard_port = int(provider_config["dashboard_port"])
        self.temp_dir = Path(provider_config["temp_dir"])
        self.max_nodes = int(provider_config.get("max_nodes", 8))
        self.stop_grace_s = float(provider_config.get("stop_grace_s", 5.0))
        self.lock = threading.RLock()
        self.starting = threading.Lock()
        """Held while one node starts: see _start_node."""
        self.start_timeout_s = float(provider_config.get("start_timeout_s", 120.0))
        self.procs: dict[str, subprocess.Popen] = {}
        self.nodes: dict[str, dict[str, Any]] = read_state(self.state_dir)
        self._next = 1 + max((int(n.rsplit("-", 1)[1]) for n in self.nodes), default=0)

    def _write(self) -> None:
        replace_whole(self.state_dir / STATE_FILE, json.dumps(self.nodes, indent=1, sort_keys=True))

    def _live(self, node_id: str) -> bool:
        proc = self.procs.get(node_id)
        if proc is not None:
            return proc.poll() is None
        return _alive(int(self.nodes[node_id]["pid"]))

    @property
    def marker(self) -> str:
        return gcs_marker(self.gcs_port)

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        with self.lock:
            gone = [n for n in self.nodes if not self._live(n)]
            for node_id in gone:  # exited by itself (a failed start, a drained node): forget it
                self._forget(node_id)
            ids = [HEAD_NODE_ID, *self.nodes]
            return [n for n in ids if all(self.node_tags(n).get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id: str) -> bool:
        with self.lock:
            return node_id == HEAD_NODE_ID or (node_id in self.nodes and self._live(node_id))

    def is_terminated(self, node_id: str) -> bool:
        return not self.is_running(node_id)

    def node_tags(self, node_id: str) -> dict[str, str]:
        with self.lock:
            if node_id == HEAD_NODE_ID:
                return {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: HEAD_NODE_TYPE,
                        TAG_RAY_NODE_NAME: HEAD_NODE_ID, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}
            return dict(self.nodes[node_id]["tags"])

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self.lock:
            if node_id in self.nodes:
                self.nodes[node_id]["tags"].update(tags)
                self._write()

    def internal_ip(self, node_id: str) -> str:
        return node_ip(0) if node_id == HEAD_NODE_ID else self.nodes[node_id]["ip"]

    def external_ip(self, node_id: str) -> str:
        return self.internal_ip(node_id)

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        self.create_node_with_resources_and_labels(node_config, tags, count, {}, {})

    def create_node_with_resources_and_labels(self, node_config: dict[str, Any], tags: dict[str, str],
                                              count: int, resources: dict[str, float],
                                              labels: dict[str, str]) -> None:
        for _ in range(count):
            self._start_node(tags, resources)

    def _start_node(self, tags: dict[str, str], resources: dict[str, float]) -> str:
        # One node at a time, each once the one before has joined: two nodes of one machine started
        # together can pick the same raylet socket (Ray names it after the session's sockets that
        # exist when the node starts; the raylet creates its file later), and one of them then never
        # registers: its `ray start` exits after 30 s and the autoscaler starts another.
        with self.starting:
            node_id, proc, log = self._launch_node(tags, resources)
            try:
                _wait_started(proc, log, timeout_s=self.start_timeout_s, what=f"local node {node_id}")
            except RuntimeError:
                pass  # it exited or hangs: the autoscaler sees it gone or not joined, as a failed instance
            return node_id

    def _launch_node(self, tags: dict[str, str], resources: dict[str, float]) -> tuple[str, subprocess.Popen, Path]:
        with self.lock:
            taken = {n["ip"] for node_id, n in self.nodes.items() if self._live(node_id)}
            index = next((i for i in range(1, self.max_nodes + 1) if node_ip(i) not in taken), None)
            if index is None:
                raise RuntimeError(f"no free local address for another node ({self.max_nodes} in use)")
            node_id = f"local-worker-{self._next}"
            self._next += 1
            argv = _node_argv(index=index, gcs_port=self.gcs_port, dashboard_port=self.dashboard_port,
                              temp_dir=self.temp_dir, cpus=int(resources.get("CPU", 0)),
                              gpus=int(resources.get("GPU", 0)))
            custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")}
            if custom:
                argv.append(f"--resources={json.dumps(custom)}")
            node_type = tags.get(TAG_RAY_USER_NODE_TYPE, WORKER_NODE_TYPE)
            # The autoscaler knows a Ray node by the instance ID its raylet reports.
            env = {"RAY_CLOUD_INSTANCE_ID": node_id, "RAY_NODE_TYPE_NAME": node_type}
            log = self.state_dir / f"{node_id}.log"
            with log.open("a") as out:
                proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[node_id] = proc
            self.nodes[node_id] = {"ip": node_ip(index), "pid": proc.pid, "started": time.time(),
                                   "tags": {**tags, TAG_RAY_NODE_NAME: node_id, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}}
            self._write()
            return node_id, proc, log

    def _forget(self, node_id: str) -> Optional[dict[str, Any]]:
        node = self.nodes.pop(node_id, None)
        proc = self.procs.pop(node_id, None)
        if proc is not None and proc.poll() is not None:
            proc.wait()
        self._write()
        return node

    def terminate_node(self, node_id: str) -> None:
        with self.lock:
            proc = self.procs.get(node_id)
            node = self.nodes.get(node_id)
        if node is None:
            return
        stop_process_group(int(node["pid"]), grace_s=self.stop_grace_s, marker=self.marker)
        if proc is not None:
            proc.wait()
        with self.lock:
            self._forget(node_id)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config


def gcs_marker(gcs_port: int) -> str:
    """What every process of a node of this cluster names on its command line: the head's GCS."""
    return f"127.0.0.1:{gcs_port}"


def read_state(state_dir: Path) -> dict[str, dict[str, Any]]:
    path = state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def live_workers(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The worker nodes the provider has started that still run, by node ID."""
    return {node_id: node for node_id, node in read_state(state_dir).items() if _alive(int(node["pid"]))}


@dataclass(frozen=True, kw_only=True)
class AutoscalingSpec:
    max_nodes: int = 2
    """Most worker nodes the autoscaler may start (the GPU node group's max)."""
    cpus_per_node: int = 1
    idle_timeout_s: float = 20.0
    """How long a worker node may run nothing before the autoscaler removes it (gpuIdleMinutes)."""
    update_interval_s: float = 1.0
    """How often the autoscaler looks (5 s by default; KubeRay keeps Ray's default)."""
    start_timeout_s: float = 120.0


def autoscaling_config(spec: AutoscalingSpec, *, nodes: LocalNodes, state_dir: Path) -> dict[str, Any]:
    """The autoscaler's cluster config: a head that offers nothing to tasks and up to
    `spec.max_nodes` workers of `spec.cpus_per_node` CPUs, none to begin with."""
    return {
        "cluster_name": "local-idle-to-zero",
        "max_workers": spec.max_nodes,
        "upscaling_speed": 1000,  # KubeRay's default: no rate limit
        "idle_timeout_minutes": spec.idle_timeout_s / 60,
        "provider": {
            "type": "external", "module": f"{__name__}.LocalNodeProvider",
            "disable_node_updaters": True, "disable_launch_config_check": True,
            "state_dir": str(state_dir), "gcs_port": nodes.gcs_port, "dashboard_port": nodes.dashboard_port,
            "temp_dir": str(nodes.temp_dir), "max_nodes": spec.max_nodes, "start_timeout_s": spec.start_timeout_s,
        },
        "head_node_type": HEAD_NODE_TYPE,
        "available_node_types": {
            HEAD_NODE_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_NODE_TYPE: {"resources": {"CPU": spec.cpus_per_node}, "node_config": {}, "min_workers": 0,
                               "max_workers": spec.max_nodes},
        },
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


@dataclass(frozen=True, kw_only=True)
class AutoscalingCluster:
    address: str
    """The Jobs API URL."""
    token: str
    state_dir: Path
    """The provider's state and the worker nodes' logs."""
    log_dir: Path
    nodes: LocalNodes = field(compare=False, repr=False)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The worker nodes that run now, by node ID (the "instances" of this cluster)."""
        return live_workers(self.state_dir)


@contextmanager
def local_autoscaling_cluster(spec: AutoscalingSpec, *, log_dir: Path,
                              say: Callable[[str], None] = lambda message: None) -> Iterator[AutoscalingCluster]:
    """A head with Ray's autoscaler v2 and no worker node, on 127.0.0.1; stopped on exit with every
    worker node the autoscaler started (each by its own process group), and nothing else."""
    log_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-idle-", dir="/tmp"))  # Unix sockets: keep it short
    state_dir = log_dir / "autoscaler"
    state_dir.mkdir(exist_ok=True)
    nodes = LocalNodes(LocalClusterSpec(nodes=1, cpus_per_node=spec.cpus_per_node,
                                        start_timeout_s=spec.start_timeout_s),
                       token=secrets.token_hex(32), log_dir=log_dir, temp_dir=temp_dir)
    config = state_dir / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(spec, nodes=nodes, state_dir=state_dir), indent=1))
    nodes.head_args = [f"--autoscaling-config={config}"]
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    nodes.head_env = {
        "RAY_enable_autoscaler_v2": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": f"{spec.update_interval_s:g}",
        # The autoscaler v2 knows the head by the instance ID its raylet reports.
        "RAY_CLOUD_INSTANCE_ID": HEAD_NODE_ID, "RAY_NODE_TYPE_NAME": HEAD_NODE_TYPE,
        "PYTHONPATH": pythonpath,  # the autoscaler imports LocalNodeProvider from here
    }
    try:
        started = time.monotonic()
        nodes.start(0)
        say(f"the head is up with Ray's autoscaler and no worker node ({time.monotonic() - started:.0f} s)")
        yield AutoscalingCluster(address=f"http://127.0.0.1:{nodes.dashboard_port}", token=nodes.token,
                                 state_dir=state_dir, log_dir=log_dir, nodes=nodes)
    finally:
        marker = gcs_marker(nodes.gcs_port)
        _stop_workers(state_dir, marker=marker)
        nodes.stop_all()
        _stop_workers(state_dir, marker=marker)  # one the autoscaler started while the head stopped
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_workers(state_dir: Path, *, marker: str) -> None:
    for node in read_state(state_dir).values():
        stop_process_group(int(node["pid"]), grace_s=5.0, marker=marker)

