"""The GPU nodes coming back for a job, on a stack whose GPU nodes scale to zero (`gpuIdleMinutes`).

While the job's driver waits for its GPUs, `submit` reads what is on the way and says each change:
the nodes the Cluster Autoscaler requested (the GPU Auto Scaling group's desired capacity), the
instances EC2 launched, the nodes that joined the cluster, and the Ray worker pods, waiting for a
node, pulling the image, ready. When EC2 refuses the launches, the group's scaling activity says
why, and that reason is named (insufficient capacity in the AZ, a vCPU quota, no Spot capacity, a
full reservation) with what to do about it, instead of a job that waits in silence. The watch is
bounded by the job's own wait for its GPUs.

What it reads goes through two small readers, each given its client (a boto3 Auto Scaling client;
a function that runs kubectl), so that tests hand them fakes of what they read.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

DISCOVERY_TAG_KEY = "ray-eks.io/scale-to-zero"
"""The tag of the GPU Auto Scaling group, valued with the EKS cluster's name (the same key as
infra/scale_to_zero.py, which tags the group: the client does not import the Pulumi program)."""
WORKER_SELECTOR = "ray.io/node-type=worker"
GPU_NODE_SELECTOR = "role=gpu"


@dataclass(frozen=True, kw_only=True)
class LaunchFailure:
    """Why EC2 did not launch the GPU instances, from a failed scaling activity."""

    kind: str
    """`insufficient capacity`, `quota`, `Spot shortage`, `reservation`, `subnet addresses` or
    `launch failed`."""
    message: str
    """EC2's own words (the activity's status message)."""
    fix: str
    waits_help: bool
    """Whether waiting may bring the nodes (capacity comes back; a quota does not rise by itself)."""

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}. {self.fix}"


_FAILURES: tuple[tuple[re.Pattern[str], str, str, bool], ...] = (
    (re.compile(r"vCPU (capacity|limit)|VcpuLimitExceeded|InstanceLimitExceeded|instance limit", re.I), "quota",
     "Raise the Running On-Demand vCPU quota of the instance family in Service Quotas (`python -m capacity "
     "probe` shows it); waiting will not", False),
    (re.compile(r"Spot", re.I), "Spot shortage",
     "EC2 has no Spot capacity for the type in the AZ now; the Cluster Autoscaler retries, or use On-Demand "
     "capacity", True),
    (re.compile(r"capacity reservation|ReservationCapacityExceeded|Capacity Block", re.I), "reservation",
     "The targeted reservation has no free instance or is not active (`aws ec2 describe-capacity-reservations` "
     "shows it; `python -m capacity probe --hold` or `python -m capacity blocks` gets capacity)", True),
    (re.compile(r"InsufficientInstanceCapacity|sufficient .* capacity|InsufficientCapacity", re.I),
     "insufficient capacity",
     "EC2 has no free instance of the type in the GPU AZ now; the Cluster Autoscaler retries after its "
     "backoff. `python -m capacity probe` finds an AZ or region that has them, `probe --hold` reserves them",
     True),
    (re.compile(r"InsufficientFreeAddresses|free (IP )?addresses", re.I), "subnet addresses",
     "The GPU subnet has no free IP address left", False),
)


def classify_failure(message: str) -> LaunchFailure:
    """The kind of a failed launch, from the activity's status message."""
    for pattern, kind, fix, waits_help in _FAILURES:
        if pattern.search(message):
            return LaunchFailure(kind=kind, message=_reason_of(message), fix=fix, waits_help=waits_help)
    return LaunchFailure(kind="launch failed", message=_reason_of(message),
                         fix="See the Auto Scaling group's activity in the EC2 console", waits_help=True)


def _reason_of(message: str) -> str:
    """EC2's reason inside an Auto Scaling status message (`... Status Reason: <reason>. Launching
    EC2 instance failed.`), or the whole message."""
    found = re.search(r"Status Reason:\s*(.+?)(?:\.?\s*Launching EC2 instance failed\.?)?$", message.strip(), re.S)
    return (found.group(1) if found else message).strip().rstrip(".")


@dataclass(frozen=True, kw_only=True)
class GroupState:
    """The GPU Auto Scaling group as EC2 Auto Scaling reports it."""

    name: str
    desired: int
    """The Cluster Autoscaler's request."""
    max_size: int
    launched: int
    """Instances in the group, launched and not terminating."""
    failure: Optional[LaunchFailure] = None
    """The latest failed launch since the watch began, if any."""


@dataclass(frozen=True, kw_only=True)
class PodState:
    name: str
    ready: bool
    waiting_for: str
    """What the pod waits for: `a node`, `the image` (pulling), `its containers` (starting), or
    `` when ready; a stuck reason otherwise (ImagePullBackOff, CrashLoopBackOff)."""
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class WakeSnapshot:
    group: Optional[GroupState]
    """None when the group cannot be read (no AWS access): the nodes then show as joined only."""
    nodes_ready: int
    pods: tuple[PodState, ...]
    expected_pods: int
    """The most worker pods the RayCluster may have (`maxReplicas`): what a job of the stack's
    size waits for."""
    not_scaled: str = ""
    """The Cluster Autoscaler's last word on a worker pod it will not add a node for
    (NotTriggerScaleUp), if any."""
    group_error: str = ""
    """Why the Auto Scaling group could not be read, if it could not."""

    @property
    def pods_ready(self) -> int:
        return sum(pod.ready for pod in self.pods)

    @property
    def failure(self) -> Optional[LaunchFailure]:
        return self.group.failure if self.group else None


def summary(snapshot: WakeSnapshot) -> str:
    """One line: nodes requested, launched, joined; worker pods ready and what the others wait for."""
    group = snapshot.group
    nodes = (f"GPU nodes: {group.desired} requested, {group.launched} launched, {snapshot.nodes_ready} joined"
             if group else f"GPU nodes: {snapshot.nodes_ready} joined")
    waiting: dict[str, int] = {}
    for pod in snapshot.pods:
        if not pod.ready:
            waiting[pod.waiting_for] = waiting.get(pod.waiting_for, 0) + 1
    pods = f"worker pods: {snapshot.pods_ready}/{max(snapshot.expected_pods, len(snapshot.pods))} ready"
    if waiting:
        pods += " (" + ", ".join(f"{n} waiting for {what}" for what, n in sorted(waiting.items())) + ")"
    return f"{nodes}; {pods}"


def pod_state(pod: Mapping[str, Any], *, pulling: set[str]) -> PodState:
    """What one worker pod waits for, from `kubectl get pods -o json`; `pulling` names the pods whose
    latest image event is `Pulling`."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status", {})
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if status.get("phase") == "Running" and conditions.get("Ready", {}).get("status") == "True":
        return PodState(name=name, ready=True, waiting_for="")
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") == "False":
        return PodState(name=name, ready=False, waiting_for="a node", message=scheduled.get("message", ""))
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            return PodState(name=name, ready=False, waiting_for=reason, message=waiting.get("message", ""))
    if name in pulling:
        return PodState(name=name, ready=False, waiting_for="the image")
    return PodState(name=name, ready=False, waiting_for="its containers")


Kubectl = Callable[[Sequence[str]], Mapping[str, Any]]
"""Runs `kubectl <args> -o json` against the stack's cluster and returns the parsed answer."""


def kubectl_runner(*, kubeconfig: Path, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Kubectl:
    def kubectl(args: Sequence[str]) -> Mapping[str, Any]:
        done = run(["kubectl", "--kubeconfig", str(kubeconfig), *args, "--output", "json"],
                   capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:2])} failed: {done.stderr.strip()[-300:]}")
        return json.loads(done.stdout)
    return kubectl


@dataclass(frozen=True, kw_only=True)
class ClusterReader:
    """The GPU nodes and Ray worker pods, through kubectl."""

    kubectl: Kubectl
    namespace: str
    ray_cluster: str

    def read(self) -> tuple[int, int, tuple[PodState, ...], str]:
        """(GPU nodes Ready, the worker pods the RayCluster may have, each worker pod's state, the
        Cluster Autoscaler's latest NotTriggerScaleUp message about one of them)."""
        raycluster = self.kubectl(["--namespace", self.namespace, "get", "raycluster", self.ray_cluster])
        expected = sum(int(group.get("maxReplicas", 0))
                       for group in raycluster.get("spec", {}).get("workerGroupSpecs") or [])
        nodes = self.kubectl(["get", "nodes", "--selector", GPU_NODE_SELECTOR]).get("items") or []
        ready = sum(1 for node in nodes if any(c.get("type") == "Ready" and c.get("status") == "True"
                                               for c in node.get("status", {}).get("conditions") or []))
        selector = f"ray.io/cluster={self.ray_cluster},{WORKER_SELECTOR}"
        pods = [p for p in self.kubectl(["--namespace", self.namespace, "get", "pods", "--selector", selector])
                .get("items") or [] if not p.get("metadata", {}).get("deletionTimestamp")]
        names = {p.get("metadata", {}).get("name") for p in pods}
        events = self.kubectl(["--namespace", self.namespace, "get", "events", "--field-selector",
                               "involvedObject.kind=Pod"]).get("items") or []
        latest: dict[tuple[str, str], tuple[str, str]] = {}
        for event in sorted(events, key=_event_time):
            pod = event.get("involvedObject", {}).get("name")
            if pod in names and event.get("reason") in ("Pulling", "Pulled", "NotTriggerScaleUp", "TriggeredScaleUp"):
                kind = "image" if event["reason"] in ("Pulling", "Pulled") else "scale"
                latest[(pod, kind)] = (event["reason"], event.get("message", ""))
        pulling = {pod for (pod, kind), (reason, _) in latest.items() if kind == "image" and reason == "Pulling"}
        not_scaled = next((message for (pod, kind), (reason, message) in latest.items()
                           if kind == "scale" and reason == "NotTriggerScaleUp"), "")
        states = tuple(sorted((pod_state(p, pulling=pulling) for p in pods), key=lambda state: state.name))
        return ready, expected, states, not_scaled


def _event_time(event: Mapping[str, Any]) -> str:
    return event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp") or ""


@dataclass(kw_only=True)
class GroupReader:
    """The GPU Auto Scaling group, found by the stack's discovery tag, and its failed launches since
    `since` (an earlier failure is an earlier job's)."""

    autoscaling: Any
    """A boto3 `autoscaling` client."""
    cluster_name: str
    since: datetime
    _name: str = field(default="", init=False)

    def read(self) -> Optional[GroupState]:
        if not self._name:
            found = self.autoscaling.describe_auto_scaling_groups(
                Filters=[{"Name": f"tag:{DISCOVERY_TAG_KEY}", "Values": [self.cluster_name]}])["AutoScalingGroups"]
            if not found:
                return None
            self._name = found[0]["AutoScalingGroupName"]
        (group,) = self.autoscaling.describe_auto_scaling_groups(
            AutoScalingGroupNames=[self._name])["AutoScalingGroups"]
        launched = sum(1 for i in group.get("Instances") or []
                       if not str(i.get("LifecycleState", "")).startswith(("Terminat", "Detach")))
        activities = self.autoscaling.describe_scaling_activities(AutoScalingGroupName=self._name,
                                                                  MaxRecords=20)["Activities"]
        failed = [a for a in activities if a.get("StatusCode") in ("Failed", "Cancelled")
                  and a.get("StartTime") and a["StartTime"] >= self.since]
        latest = max(failed, key=lambda a: a["StartTime"], default=None)
        failure = classify_failure(latest.get("StatusMessage") or latest.get("Description", "")) if latest else None
        return GroupState(name=self._name, desired=int(group["DesiredCapacity"]), max_size=int(group["MaxSize"]),
                          launched=launched, failure=failure)


@dataclass(frozen=True, kw_only=True)
class WakeResult:
    ready: bool
    """Every expected worker pod became Ready within the watch."""
    waited_s: float
    failure: Optional[LaunchFailure] = None
    """The launch failure seen last, if the nodes did not all come."""
    last: str = ""
    """The last summary line."""


class WakeWatch:
    """Polls `read` every `poll_s` until every worker pod the RayCluster may have is Ready,
    `limit_s` passes or `stop` is set; says the summary when it changes (and every `every_s` while
    it does not), and each new reason the nodes do not come. Says nothing when the workers are up
    at its first look (a warm cluster)."""

    def __init__(self, *, read: Callable[[], WakeSnapshot], limit_s: float, say: Callable[[str], None],
                 warn: Callable[[str], None], poll_s: float = 15.0, every_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Optional[Callable[[float], None]] = None) -> None:
        self.read, self.limit_s, self.say, self.warn = read, limit_s, say, warn
        self.poll_s, self.every_s, self.clock = poll_s, every_s, clock
        self.stop = threading.Event()
        self._sleep = sleep or (lambda seconds: self.stop.wait(seconds))

    def run(self) -> WakeResult:
        start = self.clock()
        said, said_at = "", start
        warned: set[str] = set()
        failure: Optional[LaunchFailure] = None

        def warn_once(text: str) -> None:
            if text not in warned:
                warned.add(text)
                self.warn(text)

        while True:
            elapsed = self.clock() - start
            try:
                snapshot: Optional[WakeSnapshot] = self.read()
            except Exception as exc:  # the watch only reports: a failed read must not stop the job
                warn_once(f"cannot read the GPU nodes' progress: {_last_line(exc)}")
                snapshot = None
            if snapshot is not None:
                line = summary(snapshot)
                if snapshot.expected_pods and snapshot.pods_ready >= snapshot.expected_pods:
                    if said:  # it had to wait: say when the wait was over
                        self.say(f"{line}, after {_span(elapsed)}")
                    return WakeResult(ready=True, waited_s=elapsed, last=line)
                if snapshot.group_error:
                    warn_once(f"cannot read the GPU Auto Scaling group ({snapshot.group_error}): the nodes show "
                              "as they join, and a launch failure is not named")
                if line != said or self.clock() - said_at >= self.every_s:
                    self.say(f"{line} ({_span(elapsed)})")
                    said, said_at = line, self.clock()
                if snapshot.failure is not None:
                    failure = snapshot.failure
                    warn_once(f"the GPU nodes are not coming: {failure}")
                if snapshot.not_scaled:
                    warn_once(f"the Cluster Autoscaler adds no node for a worker pod: {snapshot.not_scaled}")
            if elapsed >= self.limit_s or self.stop.is_set():
                return WakeResult(ready=False, waited_s=elapsed, failure=failure, last=said)
            self._sleep(min(self.poll_s, max(0.0, self.limit_s - elapsed)))


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _span(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


@dataclass(kw_only=True)
class WakeReader:
    """One read of the cluster and, while it can be read, the Auto Scaling group (without AWS
    access the nodes show as they join, and the snapshot says why once)."""

    cluster: ClusterReader
    group: Optional[GroupReader]
    group_error: str = ""

    def read(self) -> WakeSnapshot:
        group_state = None
        if self.group is not None:
            try:
                group_state = self.group.read()
            except Exception as exc:  # AccessDenied, no credentials
                self.group, self.group_error = None, _last_line(exc)
        ready, expected, pods, not_scaled = self.cluster.read()
        return WakeSnapshot(group=group_state, nodes_ready=ready, pods=pods, expected_pods=expected,
                            not_scaled=not_scaled, group_error=self.group_error)


WAKE_WAIT_S = 1800.0
"""How long a job on a stack at zero waits for its GPUs when its instance type is not known: the
nodes' launch and the image pull take 8 to 17 minutes on g6.12xlarge (docs/INFRA.md), twice the
driver's usual 900 s would cut it close."""
IMAGE_PULL_ALLOWANCE_S = 900.0
"""The Ray image's pull and start on a node that has just joined, beside the launch itself."""


def wake_wait_s(instance_type: Optional[str]) -> float:
    """How long a job on a stack at zero waits for its GPUs: as long as the Cluster Autoscaler keeps
    trying to launch a node of the type's family, and the image pull after it (WAKE_WAIT_S, 30
    minutes, for the g families; 45 for the P ones)."""
    from infra.instance_types import INSTANCE_TYPES

    kind = INSTANCE_TYPES.get(instance_type or "")
    if kind is None or not kind.gpus:
        return WAKE_WAIT_S
    return kind.provision_limit.minutes * 60 + IMAGE_PULL_ALLOWANCE_S


class WakeWatching:
    """A WakeWatch on a thread of its own, for the span of a `with` block: started on entry,
    stopped on exit; `result` is its outcome once it has ended."""

    def __init__(self, watch: WakeWatch) -> None:
        self.watch = watch
        self.result: Optional[WakeResult] = None
        self._thread = threading.Thread(target=self._run, name="wake-watch", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.watch.run()
        except Exception as exc:  # the watch only reports: say that it stopped, and why, rather than go silent
            self.watch.warn(f"the watch of the GPU nodes stopped: {_last_line(exc)}; the job goes on without it")
            self.result = WakeResult(ready=False, waited_s=0.0, last=f"the watch stopped: {_last_line(exc)}")

    def __enter__(self) -> "WakeWatching":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.watch.stop.set()
        self._thread.join(timeout=30)

    def failure_note(self) -> str:
        """What to add to a failed job's reason: why the GPU nodes did not come ("" when they came
        or no reason was seen)."""
        result = self.result
        if result is None or result.ready or result.failure is None:
            return ""
        return f"the GPU nodes did not come: {result.failure}"


def watch_for(target, *, say: Callable[[str], None], warn: Callable[[str], None], limit_s: float,
              autoscaling: Any = None, kubectl: Optional[Kubectl] = None,
              now: Optional[datetime] = None) -> WakeWatching:
    """The watch of a stack's GPU nodes (a workloads.client.cluster.WakeTarget), reading the cluster
    with kubectl through the connection's kubeconfig and the Auto Scaling group with boto3 (the
    standard AWS environment); failed launches older than a minute before `now` are an earlier
    job's."""
    from datetime import timedelta, timezone

    if autoscaling is None:
        import boto3

        autoscaling = boto3.client("autoscaling", region_name=target.region)
    since = (now or datetime.now(timezone.utc)) - timedelta(minutes=1)
    reader = WakeReader(
        cluster=ClusterReader(kubectl=kubectl or kubectl_runner(kubeconfig=target.kubeconfig),
                              namespace=target.namespace, ray_cluster=target.ray_cluster),
        group=GroupReader(autoscaling=autoscaling, cluster_name=target.cluster_name, since=since))
    return WakeWatching(WakeWatch(read=reader.read, limit_s=limit_s, say=say, warn=warn))
