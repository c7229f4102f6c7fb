"""`pulumi up` waits until every Ray worker pod is Ready, or fails with the reason the scheduler or
the kubelet gives for the ones that are not.

Applying a RayCluster succeeds as soon as the API server stores it; KubeRay then creates the pods,
and a pod the scheduler cannot place stays Pending with nothing on the RayCluster to say so. So a
dynamic resource, `RayWorkersReady`, is created after the RayCluster: it lists the worker pods
with kubectl (the deployer's own credentials, through the stack's kubeconfig) until every one is
Ready (every worker the GPU node group can run now: none before a Capacity Block starts). It
fails early when a pod keeps a reason that waiting cannot fix (the node lacks the CPU,
memory or huge pages it asks for; the image cannot be pulled; the container keeps crashing), and
otherwise at the timeout, naming each pod that is not Ready and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import pulumi
import pulumi.dynamic

from infra.nodes import GPU_NODE_LABELS

POLL_SECONDS = 10
STUCK_AFTER_SECONDS = 300
"""How long a reason that waiting cannot fix must persist before the wait gives up. Not zero: while
the second GPU node is still joining, the scheduler says `Insufficient memory` about the node the
first worker already holds."""

# Scheduler reasons about a node's fixed resources: no autoscaler adds nodes to this stack.
_STUCK_SCHEDULING_RE = re.compile(r"Insufficient (cpu|memory|hugepages-\w+)")
_STUCK_CONTAINER_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                                      "CrashLoopBackOff", "CreateContainerConfigError"})


def worker_selector(cluster_name: str) -> str:
    """The labels KubeRay puts on a RayCluster's worker pods."""
    return f"ray.io/cluster={cluster_name},ray.io/node-type=worker"


def manifest_fingerprint(manifest: Mapping[str, Any]) -> str:
    """A short hash of a manifest: a changed RayCluster is waited for again."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class PodProblem:
    pod: str
    reason: str
    """A short, stable reason, e.g. `Unschedulable` or `ImagePullBackOff`."""
    message: str
    """What Kubernetes says about it, e.g. the scheduler's `0/3 nodes are available: ...`."""
    stuck: bool
    """Waiting will not fix it."""

    def __str__(self) -> str:
        return f"{self.pod}: {self.reason}: {self.message}" if self.message else \
            f"{self.pod}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    ready: int
    expected: int
    problems: tuple[PodProblem, ...]

    def summary(self) -> str:
        head = f"{self.ready}/{self.expected} Ray worker pods Ready"
        if self.ready + len(self.problems) < self.expected:
            head += f" ({self.expected - self.ready - len(self.problems)} not created yet)"
        return "; ".join([head, *map(str, self.problems)])


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return {}


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why one pod is not Ready (None when it is)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status", {})
    if status.get("phase") == "Running" and _condition(pod, "Ready").get("status") == "True":
        return None
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        message = scheduled.get("message", "")
        return PodProblem(pod=name, reason=scheduled.get("reason") or "Unschedulable",
                          message=message, stuck=bool(_STUCK_SCHEDULING_RE.search(message)))
    for container in [*(status.get("initContainerStatuses") or []),
                      *(status.get("containerStatuses") or [])]:
        state = container.get("state", {})
        waiting = state.get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] != "PodInitializing":
            return PodProblem(pod=name, reason=waiting["reason"],
                              message=waiting.get("message", ""),
                              stuck=waiting["reason"] in _STUCK_CONTAINER_REASONS)
        terminated = state.get("terminated") or {}
        if terminated.get("reason") and terminated["reason"] != "Completed":
            return PodProblem(pod=name, reason=terminated["reason"],
                              message=terminated.get("message", ""), stuck=False)
    return PodProblem(pod=name, reason=status.get("phase") or "Pending",
                      message=_condition(pod, "Ready").get("message", "not Ready yet"),
                      stuck=False)


def worker_report(pods: Sequence[Mapping[str, Any]], *, expected: int) -> WorkerReport:
    """How many of the worker pods are Ready, and what is wrong with the others. Pods being
    deleted (an old generation) are left out."""
    live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    problems = tuple(p for p in map(pod_problem, live) if p is not None)
    return WorkerReport(ready=len(live) - len(problems), expected=expected, problems=problems)


HUGE_PAGES_KEY = "ray-eks:gpuHugePagesMib"
"""The stack setting of the workers' `hugepages-2Mi` request (StackConfig.gpu_huge_pages_mib)."""
_HUGE_PAGES_SHORT_RE = re.compile(r"Insufficient hugepages-2Mi")


def node_huge_pages_command() -> str:
    """The kubectl command that prints each GPU node's allocatable 2 MiB huge pages."""
    selector = ",".join(f"{k}={v}" for k, v in GPU_NODE_LABELS.items())
    return (f"kubectl get nodes -l {selector} -o custom-columns="
            "NAME:.metadata.name,HUGEPAGES:.status.allocatable.hugepages-2Mi")


def fix_hint(problems: Sequence[PodProblem], *, huge_pages_mib: int | None) -> str:
    """What to change when the scheduler's reason is one a stack setting decides ("" if none)."""
    if not any(_HUGE_PAGES_SHORT_RE.search(p.message) for p in problems):
        return ""
    asked = f" ({HUGE_PAGES_KEY} = {huge_pages_mib})" if huge_pages_mib is not None else ""
    return (f"The GPU nodes offer fewer 2 MiB huge pages than each worker requests{asked}. Read "
            f"what a node offers with `{node_huge_pages_command()}`, then set the request to it "
            f"(or to 0: the workers then use regular pages) with `pulumi config set "
            f"{HUGE_PAGES_KEY} <MiB>` and run `pulumi up` again")


class WorkersNotReady(Exception):
    """The Ray workers did not all become Ready; the message says why."""


class KubectlError(RuntimeError):
    """kubectl failed to list the pods."""


def wait_for_workers(*, list_pods: Callable[[], Sequence[Mapping[str, Any]]], expected: int,
                     timeout_s: float, stuck_after_s: float = STUCK_AFTER_SECONDS,
                     poll_s: float = POLL_SECONDS, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep,
                     huge_pages_mib: int | None = None) -> WorkerReport:
    """Poll until `expected` worker pods are Ready; WorkersNotReady when a stuck reason persists
    for `stuck_after_s` or when `timeout_s` passes. A failed listing (an API server hiccup) is
    retried until the timeout. With `expected` 0 (a Capacity Block not started yet: no GPU node can
    run them) there is nothing to wait for, and nothing is listed. When the scheduler lacks huge
    pages the error says how to change the request (`huge_pages_mib`, what the workers ask)."""
    if expected <= 0:
        return WorkerReport(ready=0, expected=0, problems=())
    start = clock()
    stuck_since: dict[tuple[str, str], float] = {}
    report = WorkerReport(ready=0, expected=expected, problems=())
    listing_error = ""
    while True:
        try:
            report = worker_report(list_pods(), expected=expected)
            listing_error = ""
        except KubectlError as exc:
            listing_error = str(exc)
        now = clock()
        if not listing_error and report.ready >= expected:
            return report
        long_stuck: list[PodProblem] = []
        if not listing_error:
            stuck = {(p.pod, p.reason): p for p in report.problems if p.stuck}
            stuck_since = {key: stuck_since.get(key, now) for key in stuck}
            long_stuck = [stuck[key] for key, since in stuck_since.items()
                          if now - since >= stuck_after_s]
        if long_stuck:
            hint = fix_hint(long_stuck, huge_pages_mib=huge_pages_mib)
            raise WorkersNotReady(
                f"Ray workers cannot become Ready without a change ({report.ready}/{expected} "
                f"Ready): {'; '.join(map(str, long_stuck))}" + (f". {hint}" if hint else ""))
        if now - start >= timeout_s:
            detail = listing_error or report.summary()
            hint = "" if listing_error else fix_hint(report.problems,
                                                     huge_pages_mib=huge_pages_mib)
            raise WorkersNotReady(f"Ray workers not Ready after {timeout_s / 60:g} min: {detail}"
                                  + (f". {hint}" if hint else ""))
        sleep(poll_s)


def kubectl_list_pods(*, kubeconfig: str, namespace: str, selector: str,
                      run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                      ) -> list[dict[str, Any]]:
    """The pods matching `selector`, as `kubectl get pods -o json` returns them."""
    if shutil.which("kubectl") is None:
        raise WorkersNotReady("kubectl is not on PATH: `pulumi up` needs it (and the AWS CLI the "
                              "kubeconfig calls) to wait for the Ray workers; install it, or set "
                              "ray-eks:workersReadyTimeoutMinutes 0 to skip the wait")
    fd, path = tempfile.mkstemp(prefix="kubeconfig-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
            f.write(kubeconfig)
        done = run(["kubectl", "--kubeconfig", path, "--namespace", namespace, "get", "pods",
                    "--selector", selector, "--output", "json"],
                   capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise KubectlError("kubectl get pods timed out") from None
    finally:
        os.unlink(path)
    if done.returncode != 0:
        raise KubectlError(f"kubectl get pods failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout).get("items") or []


_WATCHED = ("namespace", "clusterName", "expectedWorkers", "manifestFingerprint")


class _WorkersReadyProvider(pulumi.dynamic.ResourceProvider):
    """Creating (or updating) the resource is the wait; it holds no cloud state."""

    def _wait(self, props: Mapping[str, Any]) -> int:
        def list_pods() -> list[dict[str, Any]]:
            return kubectl_list_pods(kubeconfig=props["kubeconfig"], namespace=props["namespace"],
                                     selector=worker_selector(props["clusterName"]))

        huge_pages = props.get("hugePagesMib")
        report = wait_for_workers(list_pods=list_pods, expected=int(props["expectedWorkers"]),
                                  timeout_s=float(props["timeoutSeconds"]),
                                  huge_pages_mib=None if huge_pages is None else int(huge_pages))
        return report.ready

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        ready = self._wait(props)
        return pulumi.dynamic.CreateResult(id_=f"{props['namespace']}/{props['clusterName']}",
                                           outs={**props, "readyWorkers": ready})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]
             ) -> pulumi.dynamic.DiffResult:
        changed = [key for key in _WATCHED if olds.get(key) != news.get(key)]
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=[],
                                         delete_before_replace=False)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]
               ) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs={**news, "readyWorkers": self._wait(news)})


class RayWorkersReady(pulumi.dynamic.Resource, module="ray-eks", name="RayWorkersReady"):
    """Exists once every worker pod of the RayCluster is Ready."""

    ready_workers: pulumi.Output[int]

    def __init__(self, name: str, *, kubeconfig: pulumi.Input[str], namespace: str,
                 cluster_name: str, expected_workers: int, timeout_minutes: int,
                 manifest_fingerprint: str, huge_pages_mib: int | None = None,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(_WorkersReadyProvider(), name, {
            "kubeconfig": pulumi.Output.secret(kubeconfig),
            "namespace": namespace,
            "clusterName": cluster_name,
            "expectedWorkers": expected_workers,
            "timeoutSeconds": timeout_minutes * 60,
            "manifestFingerprint": manifest_fingerprint,
            "hugePagesMib": huge_pages_mib,
            "readyWorkers": None,
        }, opts)
