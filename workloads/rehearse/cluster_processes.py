"""The processes of a local Ray cluster (workloads/local/run.py), as a fault test or a soak sees
them: its live Ray Train workers (Ray's State API), each process's role, resident memory and the
shared memory it maps (from Linux's /proc).

Roles, from a process's command line and node: `driver` (the job's entrypoint,
workloads.launch.driver), `controller` (Ray Train's TrainController actor), `train worker` (a
RayTrainWorker actor: a rank), `head` (every other process of the head: GCS, raylet, dashboard and
its modules, idle workers) and `worker node` (every other process of a worker node: its raylet,
agents, idle workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workloads.local.run import LocalNodes

ROLES = ("driver", "controller", "train worker", "head", "worker node")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Process:
    pid: int
    role: str
    node: int
    rss_mib: float
    started: int
    """Its start time (clock ticks after boot, /proc/PID/stat): with the pid, which process it is."""
    shared_memory: tuple[str, ...] = ()
    """The POSIX shared-memory objects (/dev/shm/...) it maps."""


def train_worker_pids(*, address: str, token: str) -> list[int]:
    """The processes of the cluster's live Ray Train workers, as the State API lists them."""
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    client = StateApiClient(address=address, headers={"Authorization": f"Bearer {token}"})
    filters = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    actors = client.list(StateResource.ACTORS, options=ListApiOptions(filters=filters), raise_on_missing_output=True)
    return sorted(int(actor.pid) for actor in actors if actor.pid)


SHELLS = ("/bin/sh", "sh", "/bin/bash", "bash")
"""A job's entrypoint runs under a shell (Ray's JobSupervisor), whose command line names the driver too."""


def role_of(cmdline: str, *, node: int) -> str:
    """The role of a process from its command line (arguments joined by spaces) and node."""
    if "workloads.launch.driver" in cmdline and cmdline.split(" ", 1)[0] not in SHELLS:
        return "driver"
    if "TrainController" in cmdline:
        return "controller"
    if "RayTrainWorker" in cmdline:
        return "train worker"
    return "head" if node == 0 else "worker node"


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:  # the process is gone
        return None


def describe(pid: int, *, node: int) -> Optional[Process]:
    """The process `pid` of node `node` now; None when it is gone (or a zombie)."""
    cmdline, statm, stat = (_read(f"/proc/{pid}/{name}") for name in ("cmdline", "statm", "stat"))
    if cmdline is None or statm is None or stat is None:
        return None
    after_name = stat.rsplit(")", 1)[1].split()
    if after_name[0] == "Z":  # exited, not yet reaped
        return None
    rss_pages, started = int(statm.split()[1]), int(after_name[19])
    maps = _read(f"/proc/{pid}/maps") or ""
    shared = sorted({line.split(None, 5)[5].removesuffix(" (deleted)") for line in maps.splitlines()
                     if "/dev/shm/" in line and len(line.split(None, 5)) == 6})
    return Process(pid=pid, role=role_of(cmdline.replace("\0", " "), node=node), node=node,
                   rss_mib=round(rss_pages * PAGE_BYTES / 2**20, 1), started=started, shared_memory=tuple(shared))


def cluster_processes(nodes: "LocalNodes") -> list[Process]:
    """Every live process of every node of the cluster now."""
    return [process for index, pids in nodes.processes().items() for pid in pids
            if (process := describe(pid, node=index)) is not None]


def alive(process: Process) -> bool:
    """Whether this very process (same pid, same start time) still runs."""
    now = describe(process.pid, node=process.node)
    return now is not None and now.started == process.started


def shared_memory_left(processes: list[Process]) -> list[str]:
    """The shared-memory segments these processes made or mapped that still exist: POSIX objects
    in /dev/shm that one of them mapped, and System V segments one of them created (by pid)."""
    posix = {name for process in processes for name in process.shared_memory if Path(name).exists()}
    creators = {process.pid for process in processes}
    sysv = set()
    for line in (_read("/proc/sysvipc/shm") or "").splitlines()[1:]:
        fields = line.split()  # key shmid perms size cpid lpid ...
        if len(fields) > 4 and int(fields[4]) in creators:
            sysv.add(f"System V segment key {fields[0]} id {fields[1]} (created by pid {fields[4]})")
    return sorted(posix | sysv)
