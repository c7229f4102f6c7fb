"""`pulumi up` waiting for the Ray workers (infra/readiness.py): pod states as the API server
reports them, the wait with a fake clock, and kubectl through a stand-in on PATH."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from infra.config import config_key
from infra.readiness import (HUGE_PAGES_KEY, KubectlError, PodProblem, WorkersNotReady,
                             _WorkersReadyProvider, fix_hint, kubectl_list_pods, wait_for_workers,
                             worker_report, worker_selector)

SCHEDULER_SAYS = ("0/3 nodes are available: 2 Insufficient memory, 1 node(s) didn't match Pod's "
                  "node affinity/selector. preemption: 0/3 nodes are available: 2 No preemption "
                  "victims found for incoming pod, 1 Preemption is not helpful for scheduling.")
JOINING = ("0/2 nodes are available: 1 node(s) had untolerated taint "
           "{node.kubernetes.io/not-ready: }, 1 node(s) didn't match Pod's node affinity/selector.")


def pod(name: str, *, phase: str = "Running", ready: bool = True, scheduled: str | None = None,
        waiting: str | None = None, deleting: bool = False) -> dict:
    """A worker pod shaped as `kubectl get pods -o json` returns it."""
    conditions = []
    if scheduled is not None:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": scheduled})
    else:
        conditions.append({"type": "PodScheduled", "status": "True"})
        conditions.append({"type": "Ready", "status": "True" if ready else "False",
                           **({} if ready else {"reason": "ContainersNotReady",
                                                "message": "containers with unready status: "
                                                           "[ray-worker]"})})
    status = {"phase": phase, "conditions": conditions}
    if waiting:
        status["containerStatuses"] = [{"name": "ray-worker", "ready": False, "state": {
            "waiting": {"reason": waiting, "message": f"{waiting} for the image"}}}]
    metadata = {"name": name, "labels": {"ray.io/cluster": "ray-train",
                                         "ray.io/node-type": "worker"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def test_report_counts_ready_pods_and_says_why_the_others_are_not():
    report = worker_report([
        pod("w-1"),
        pod("w-2", phase="Pending", ready=False, scheduled=SCHEDULER_SAYS),
        pod("w-3", phase="Pending", ready=False, waiting="ContainerCreating"),
        pod("w-old", deleting=True),
    ], expected=4)
    assert report.ready == 1
    assert [(p.pod, p.reason, p.stuck) for p in report.problems] == [
        ("w-2", "Unschedulable", True), ("w-3", "ContainerCreating", False)]
    assert report.problems[0].message == SCHEDULER_SAYS
    assert report.summary().startswith("1/4 Ray worker pods Ready (1 not created yet); w-2: ")


def test_a_running_pod_that_is_not_ready_is_reported():
    (problem,) = worker_report([pod("w-1", ready=False)], expected=1).problems
    assert (problem.reason, problem.stuck) == ("Running", False)
    assert "ray-worker" in problem.message


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _wait(states, *, timeout_s=1800.0, clock=None):
    clock = clock or FakeClock()
    listing = iter(states)

    def list_pods():
        state = next(listing)
        if isinstance(state, Exception):
            raise state
        return state

    return wait_for_workers(list_pods=list_pods, expected=2, timeout_s=timeout_s,
                            poll_s=10, clock=clock, sleep=clock.sleep), clock


def test_the_wait_ends_when_every_worker_is_ready():
    joining = [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=JOINING)]
    report, clock = _wait([[], joining, joining, [pod("w-1"), pod("w-2")]])
    assert report.ready == 2 and clock.now == 30


def test_a_pod_that_cannot_fit_fails_the_wait_with_the_schedulers_reason():
    stuck = [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=SCHEDULER_SAYS)]
    with pytest.raises(WorkersNotReady) as info:
        _wait([stuck] * 100)
    message = str(info.value)
    assert "cannot become Ready without a change (1/2 Ready)" in message
    assert f"w-2: Unschedulable: {SCHEDULER_SAYS}" in message


def test_insufficient_memory_while_a_node_joins_is_waited_out():
    # The first worker holds one node, the second node is not Ready yet: for a while the
    # scheduler says Insufficient memory about the only node it can see.
    transient = [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=SCHEDULER_SAYS)]
    report, clock = _wait([transient] * 20 + [[pod("w-1"), pod("w-2")]])
    assert report.ready == 2 and clock.now == 200


NO_HUGE_PAGES = ("0/3 nodes are available: 2 Insufficient hugepages-2Mi, 1 node(s) didn't match "
                 "Pod's node affinity/selector. preemption: 0/3 nodes are available: 2 No "
                 "preemption victims found for incoming pod, 1 Preemption is not helpful for "
                 "scheduling.")


def test_too_few_huge_pages_name_the_setting_and_how_to_read_the_nodes():
    stuck = [pod("w-1", phase="Pending", ready=False, scheduled=NO_HUGE_PAGES),
             pod("w-2", phase="Pending", ready=False, scheduled=NO_HUGE_PAGES)]
    clock = FakeClock()
    listing = iter([stuck] * 100)
    with pytest.raises(WorkersNotReady) as info:
        wait_for_workers(list_pods=lambda: next(listing), expected=2, timeout_s=1800,
                         clock=clock, sleep=clock.sleep, huge_pages_mib=10562)
    message = str(info.value)
    assert f"w-1: Unschedulable: {NO_HUGE_PAGES}" in message
    assert "offer fewer 2 MiB huge pages than each worker requests " \
           "(ray-eks:gpuHugePagesMib = 10562)" in message
    assert ("`kubectl get nodes -l role=gpu,nvidia.com/gpu.present=true -o custom-columns="
            "NAME:.metadata.name,HUGEPAGES:.status.allocatable.hugepages-2Mi`") in message
    assert "`pulumi config set ray-eks:gpuHugePagesMib <MiB>`" in message
    assert "\n" not in message


def test_other_reasons_get_no_huge_page_hint():
    stuck = [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=SCHEDULER_SAYS)]
    with pytest.raises(WorkersNotReady) as info:
        _wait([stuck] * 100)
    assert HUGE_PAGES_KEY not in str(info.value)


def test_the_hint_names_the_stack_setting():
    assert HUGE_PAGES_KEY == config_key("gpu_huge_pages_mib")
    problem = PodProblem(pod="w", reason="Unschedulable", message=NO_HUGE_PAGES, stuck=True)
    assert "= 0)" in fix_hint([problem], huge_pages_mib=0)
    assert fix_hint([problem], huge_pages_mib=None).startswith(
        "The GPU nodes offer fewer 2 MiB huge pages than each worker requests. Read")


def test_an_image_that_cannot_be_pulled_fails_the_wait():
    bad = [pod("w-1", phase="Pending", ready=False, waiting="ImagePullBackOff"), pod("w-2")]
    with pytest.raises(WorkersNotReady, match="w-1: ImagePullBackOff"):
        _wait([bad] * 100)


def test_the_timeout_names_each_pod_that_is_not_ready():
    slow = [pod("w-1"), pod("w-2", phase="Pending", ready=False, waiting="ContainerCreating")]
    with pytest.raises(WorkersNotReady) as info:
        _wait([slow] * 100, timeout_s=300)
    assert str(info.value) == ("Ray workers not Ready after 5 min: 1/2 Ray worker pods Ready; "
                               "w-2: ContainerCreating: ContainerCreating for the image")


def test_a_failed_listing_is_retried_until_the_timeout():
    report, _ = _wait([KubectlError("kubectl get pods failed: connection refused"),
                       [pod("w-1"), pod("w-2")]])
    assert report.ready == 2
    with pytest.raises(WorkersNotReady, match="after 1 min: kubectl get pods failed"):
        _wait([KubectlError("kubectl get pods failed: Unauthorized")] * 10, timeout_s=60)


def test_no_worker_to_wait_for_ends_the_wait_without_listing():
    # A Capacity Block that has not started: the node group has 0 nodes, so 0 workers can run.
    def list_pods():
        raise AssertionError("nothing to list")

    clock = FakeClock()
    report = wait_for_workers(list_pods=list_pods, expected=0, timeout_s=1800, clock=clock,
                              sleep=clock.sleep)
    assert (report.ready, report.expected, clock.now) == (0, 0, 0)


def test_the_provider_waits_for_no_worker_without_kubectl(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl: it is not needed
    result = _WorkersReadyProvider().create({**PROPS, "expectedWorkers": 0})
    assert result.outs["readyWorkers"] == 0


@pytest.fixture
def fake_kubectl(tmp_path, monkeypatch):
    """A `kubectl` on PATH that records its arguments and the kubeconfig it was given, and prints
    the pods in pods.json (or fails when fail.txt exists)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "kubectl"
    script.write_text(f"""#!{sys.executable} -S
import json, os, stat, sys
from pathlib import Path
here = Path({str(tmp_path)!r})
args = sys.argv[1:]
kubeconfig = args[args.index("--kubeconfig") + 1]
mode = stat.S_IMODE(os.stat(kubeconfig).st_mode)
seen = {{"args": args, "kubeconfig": Path(kubeconfig).read_text(), "mode": mode}}
(here / "calls.json").write_text(json.dumps(seen))
if (here / "fail.txt").exists():
    sys.stderr.write((here / "fail.txt").read_text())
    sys.exit(1)
print(json.dumps({{"apiVersion": "v1", "kind": "List",
                  "items": json.loads((here / "pods.json").read_text())}}))
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_kubectl_lists_the_worker_pods_with_a_private_kubeconfig(fake_kubectl):
    (fake_kubectl / "pods.json").write_text(json.dumps([pod("w-1")]))
    pods = kubectl_list_pods(kubeconfig='{"apiVersion": "v1"}', namespace="ray",
                             selector=worker_selector("ray-train"))
    assert [p["metadata"]["name"] for p in pods] == ["w-1"]
    call = json.loads((fake_kubectl / "calls.json").read_text())
    assert call["args"][2:] == ["--namespace", "ray", "get", "pods", "--selector",
                                "ray.io/cluster=ray-train,ray.io/node-type=worker",
                                "--output", "json"]
    assert call["kubeconfig"] == '{"apiVersion": "v1"}' and call["mode"] == 0o600
    assert not Path(call["args"][1]).exists()  # removed once kubectl is done


def test_a_kubectl_failure_carries_its_message(fake_kubectl):
    (fake_kubectl / "fail.txt").write_text("error: You must be logged in to the server\n")
    with pytest.raises(KubectlError, match="You must be logged in"):
        kubectl_list_pods(kubeconfig="{}", namespace="ray", selector="x=y")


def test_without_kubectl_the_error_says_how_to_skip_the_wait(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(WorkersNotReady, match="workersReadyTimeoutMinutes 0"):
        kubectl_list_pods(kubeconfig="{}", namespace="ray", selector="x=y")


PROPS = {"kubeconfig": "{}", "namespace": "ray", "clusterName": "ray-train",
         "expectedWorkers": 2, "timeoutSeconds": 60, "manifestFingerprint": "abc",
         "readyWorkers": None}


def test_the_provider_creates_the_resource_once_the_workers_are_ready(fake_kubectl):
    (fake_kubectl / "pods.json").write_text(json.dumps([pod("w-1"), pod("w-2")]))
    result = _WorkersReadyProvider().create(dict(PROPS))
    assert result.id == "ray/ray-train"
    assert result.outs["readyWorkers"] == 2


def test_the_provider_names_the_huge_page_setting_it_was_given(fake_kubectl):
    (fake_kubectl / "pods.json").write_text(json.dumps(
        [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=NO_HUGE_PAGES)]))
    props = {**PROPS, "timeoutSeconds": 0, "hugePagesMib": 2048}
    with pytest.raises(WorkersNotReady, match=r"\(ray-eks:gpuHugePagesMib = 2048\)"):
        _WorkersReadyProvider().create(props)


def test_the_provider_fails_the_update_with_the_schedulers_reason(fake_kubectl):
    (fake_kubectl / "pods.json").write_text(json.dumps(
        [pod("w-1"), pod("w-2", phase="Pending", ready=False, scheduled=SCHEDULER_SAYS)]))
    props = {**PROPS, "timeoutSeconds": 0}  # give up at the first look
    with pytest.raises(WorkersNotReady, match=r"1/2 Ray worker pods Ready; w-2: Unschedulable: "
                                              r"0/3 nodes are available: 2 Insufficient memory"):
        _WorkersReadyProvider().update("ray/ray-train", props, props)


@pytest.mark.parametrize(("change", "changes"), [
    ({}, False), ({"manifestFingerprint": "def"}, True), ({"expectedWorkers": 3}, True),
    ({"timeoutSeconds": 120}, False), ({"kubeconfig": "{...}"}, False),
])
def test_only_a_changed_raycluster_is_waited_for_again(change, changes):
    diff = _WorkersReadyProvider().diff("ray/ray-train", dict(PROPS), {**PROPS, **change})
    assert diff.changes is changes
