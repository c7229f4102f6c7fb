"""`python -m workloads submit` on a stack whose GPU nodes scaled to zero: what it says while the job
waits for them (nodes requested, launched, joined; worker pods waiting for a node, pulling the
image, ready), bounded by the job's own wait, and the reason when EC2 does not launch them. The Auto
Scaling group is read through a real boto3 client answered by botocore's Stubber, the cluster
through a fake of kubectl's JSON."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber

from workloads.client import revisions, submit
from workloads.client.cluster import Connection, WakeTarget, stack_outputs_from_json
from workloads.client.outcome import JobOutcome
from workloads.client.wakeup import (DISCOVERY_TAG_KEY, WAKE_WAIT_S, ClusterReader, GroupReader, GroupState,
                                     PodState, WakeReader, WakeSnapshot, WakeWatch, WakeWatching, classify_failure,
                                     pod_state, summary, watch_for)

T0 = datetime(2026, 12, 3, 9, 0, tzinfo=timezone.utc)
CLUSTER = "ray-eks-us-west-2"
ASG = "eks-gpu-nodes-4d5e6f7-0ec9b1f2-aaaa-bbbb-cccc-0123456789ab"

# EC2 Auto Scaling's status messages of failed launches (as its activity history shows them).
CAPACITY = ("Launching a new EC2 instance. Status Reason: We currently do not have sufficient g6.12xlarge "
            "capacity in the Availability Zone you requested (us-west-2a). Our system will be working on "
            "provisioning additional capacity. You can currently get g6.12xlarge capacity by not specifying an "
            "Availability Zone in your request or choosing us-west-2b, us-west-2c. Launching EC2 instance failed.")
QUOTA = ("Launching a new EC2 instance. Status Reason: You have requested more vCPU capacity than your current "
         "vCPU limit of 0 allows for the instance bucket that the specified instance type belongs to. Please "
         "visit http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit. Launching "
         "EC2 instance failed.")
SPOT = ("Launching a new EC2 instance. Status Reason: Could not launch Spot Instances. "
        "InsufficientInstanceCapacity - There is no Spot capacity available that matches your request. "
        "Launching EC2 instance failed.")


@pytest.mark.parametrize("message, kind, waits_help, says", [
    (CAPACITY, "insufficient capacity", True, "We currently do not have sufficient g6.12xlarge capacity"),
    (QUOTA, "quota", False, "You have requested more vCPU capacity than your current vCPU limit of 0"),
    (SPOT, "Spot shortage", True, "There is no Spot capacity available that matches your request"),
    ("Launching a new EC2 instance. Status Reason: Insufficient capacity in the capacity reservation "
     "cr-0123456789abcdef0. Launching EC2 instance failed.", "reservation", True, "cr-0123456789abcdef0"),
    ("Launching a new EC2 instance. Status Reason: Something else. Launching EC2 instance failed.",
     "launch failed", True, "Something else"),
])
def test_a_failed_launch_is_named_by_kind_with_ec2s_reason_and_a_fix(message, kind, waits_help, says):
    failure = classify_failure(message)
    assert (failure.kind, failure.waits_help) == (kind, waits_help)
    assert says in failure.message and "Status Reason" not in failure.message
    assert not failure.message.endswith(("failed", "."))
    assert failure.fix


# --- the Auto Scaling group, through a stubbed boto3 client ----------------------------------------

def _group(desired: int, instances: list[str]) -> dict[str, Any]:
    return {"AutoScalingGroupName": ASG, "MinSize": 0, "MaxSize": 2, "DesiredCapacity": desired,
            "DefaultCooldown": 300, "AvailabilityZones": ["us-west-2a"], "HealthCheckType": "EC2",
            "CreatedTime": T0 - timedelta(days=3),
            "Instances": [{"InstanceId": f"i-0{n}", "AvailabilityZone": "us-west-2a", "LifecycleState": state,
                           "HealthStatus": "Healthy", "ProtectedFromScaleIn": False}
                          for n, state in enumerate(instances)],
            "Tags": [{"Key": DISCOVERY_TAG_KEY, "Value": CLUSTER, "ResourceId": ASG,
                      "ResourceType": "auto-scaling-group", "PropagateAtLaunch": False}]}


def _activity(status: str, message: str, at: datetime) -> dict[str, Any]:
    activity = {"ActivityId": f"a-{at.timestamp():.0f}", "AutoScalingGroupName": ASG, "Cause": "capacity from 0 to 2",
                "StartTime": at, "StatusCode": status, "Description": "Launching a new EC2 instance"}
    return {**activity, "StatusMessage": message} if message else activity


@pytest.fixture
def autoscaling(fake_aws_session):
    client = fake_aws_session.client("autoscaling")
    with Stubber(client) as stubber:
        yield client, stubber


def _expect_group(stubber: Stubber, group: dict[str, Any], activities: list[dict[str, Any]], *, find: bool) -> None:
    if find:
        stubber.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": [group]},
                             {"Filters": [{"Name": f"tag:{DISCOVERY_TAG_KEY}", "Values": [CLUSTER]}]})
    stubber.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": [group]},
                         {"AutoScalingGroupNames": [ASG]})
    stubber.add_response("describe_scaling_activities", {"Activities": activities},
                         {"AutoScalingGroupName": ASG, "MaxRecords": 20})


def test_the_group_is_found_by_the_stacks_tag_and_reports_requested_and_launched(autoscaling):
    client, stubber = autoscaling
    reader = GroupReader(autoscaling=client, cluster_name=CLUSTER, since=T0)
    _expect_group(stubber, _group(2, ["Pending", "Terminating"]), [], find=True)
    _expect_group(stubber, _group(2, ["InService", "InService"]), [], find=False)  # found once
    assert reader.read() == GroupState(name=ASG, desired=2, max_size=2, launched=1)
    assert reader.read().launched == 2
    stubber.assert_no_pending_responses()


def test_a_failed_launch_since_the_watch_began_is_named_and_an_older_one_is_not(autoscaling):
    client, stubber = autoscaling
    reader = GroupReader(autoscaling=client, cluster_name=CLUSTER, since=T0)
    older = _activity("Failed", QUOTA, T0 - timedelta(hours=5))  # an earlier job's
    _expect_group(stubber, _group(2, []), [_activity("Successful", "", T0 - timedelta(hours=6)), older], find=True)
    assert reader.read().failure is None
    _expect_group(stubber, _group(2, []), [_activity("Failed", CAPACITY, T0 + timedelta(minutes=1)), older],
                  find=False)
    failure = reader.read().failure
    assert failure.kind == "insufficient capacity" and "us-west-2a" in failure.message


def test_a_stack_without_the_tagged_group_reads_as_no_group(autoscaling):
    client, stubber = autoscaling
    stubber.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": []})
    assert GroupReader(autoscaling=client, cluster_name=CLUSTER, since=T0).read() is None


# --- the cluster, through kubectl's JSON -----------------------------------------------------------

def _pod(name: str, *, scheduled: bool = True, ready: bool = False, waiting: str = "") -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
                   "reason": "" if scheduled else "Unschedulable",
                   "message": "" if scheduled else "0/2 nodes are available: 2 node(s) didn't match Pod's node "
                                                   "affinity/selector."}]
    if ready:
        conditions.append({"type": "Ready", "status": "True"})
    status: dict[str, Any] = {"phase": "Running" if ready else "Pending", "conditions": conditions}
    if waiting:
        status["containerStatuses"] = [{"name": "ray-worker", "state": {"waiting": {"reason": waiting}}}]
    return {"metadata": {"name": name}, "status": status}


def _node(ready: bool) -> dict[str, Any]:
    return {"metadata": {"name": "ip-10-0-1-2"}, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def _event(pod: str, reason: str, at: str, message: str = "") -> dict[str, Any]:
    return {"involvedObject": {"kind": "Pod", "name": pod}, "reason": reason, "lastTimestamp": at,
            "message": message}


class FakeKubectl:
    """Answers `kubectl get ... -o json` for the RayCluster, the GPU nodes, the worker pods and their
    events; records the commands."""

    def __init__(self, *, nodes=(), pods=(), events=(), max_replicas: int = 2) -> None:
        self.nodes, self.pods, self.events, self.max_replicas = list(nodes), list(pods), list(events), max_replicas
        self.calls: list[list[str]] = []

    def __call__(self, args):
        self.calls.append(list(args))
        if "raycluster" in args:
            return {"spec": {"workerGroupSpecs": [{"groupName": "gpu", "minReplicas": 0,
                                                   "maxReplicas": self.max_replicas}]}}
        if "nodes" in args:
            return {"items": self.nodes}
        if "pods" in args:
            return {"items": self.pods}
        if "events" in args:
            return {"items": self.events}
        raise AssertionError(args)


def test_each_worker_pod_says_what_it_waits_for():
    assert pod_state(_pod("w0", scheduled=False), pulling=set()).waiting_for == "a node"
    assert pod_state(_pod("w1", waiting="ContainerCreating"), pulling={"w1"}).waiting_for == "the image"
    assert pod_state(_pod("w2", waiting="ContainerCreating"), pulling=set()).waiting_for == "its containers"
    assert pod_state(_pod("w3", waiting="ImagePullBackOff"), pulling={"w3"}).waiting_for == "ImagePullBackOff"
    assert pod_state(_pod("w4", ready=True), pulling=set()) == PodState(name="w4", ready=True, waiting_for="")


def test_the_cluster_reader_reads_nodes_pods_image_pulls_and_the_autoscalers_refusal():
    kubectl = FakeKubectl(
        nodes=[_node(True), _node(False)],
        pods=[_pod("gpu-a", waiting="ContainerCreating"), _pod("gpu-b", waiting="ContainerCreating"),
              {**_pod("old"), "metadata": {"name": "old", "deletionTimestamp": "2026-12-03T09:00:00Z"}}],
        events=[_event("gpu-a", "Pulling", "2026-12-03T09:04:00Z"), _event("gpu-b", "Pulling", "2026-12-03T09:04:01Z"),
                _event("gpu-b", "Pulled", "2026-12-03T09:09:00Z"),
                _event("gpu-a", "NotTriggerScaleUp", "2026-12-03T09:01:00Z",
                       "pod didn't trigger scale-up: 1 max node group size reached"),
                _event("elsewhere", "Pulling", "2026-12-03T09:04:00Z")])
    ready, expected, pods, not_scaled = ClusterReader(kubectl=kubectl, namespace="ray", ray_cluster="ray-train").read()
    assert (ready, expected) == (1, 2)
    assert [(p.name, p.waiting_for) for p in pods] == [("gpu-a", "the image"), ("gpu-b", "its containers")]
    assert not_scaled == "pod didn't trigger scale-up: 1 max node group size reached"
    assert ["--namespace", "ray", "get", "pods", "--selector", "ray.io/cluster=ray-train,ray.io/node-type=worker"] \
        in kubectl.calls
    assert ["get", "nodes", "--selector", "role=gpu"] in kubectl.calls


def test_the_summary_line_counts_nodes_and_pods():
    snapshot = WakeSnapshot(group=GroupState(name=ASG, desired=2, max_size=2, launched=2), nodes_ready=1,
                            pods=(PodState(name="a", ready=False, waiting_for="the image"),
                                  PodState(name="b", ready=False, waiting_for="a node")), expected_pods=2)
    assert summary(snapshot) == ("GPU nodes: 2 requested, 2 launched, 1 joined; worker pods: 0/2 ready "
                                 "(1 waiting for a node, 1 waiting for the image)")
    assert summary(WakeSnapshot(group=None, nodes_ready=0, pods=(), expected_pods=2)) == \
        "GPU nodes: 0 joined; worker pods: 0/2 ready"


# --- the watch -----------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _snap(desired: int, launched: int, joined: int, pods: list[tuple[bool, str]], failure: str = "") -> WakeSnapshot:
    group = GroupState(name=ASG, desired=desired, max_size=2, launched=launched,
                       failure=classify_failure(failure) if failure else None)
    return WakeSnapshot(group=group, nodes_ready=joined, expected_pods=2,
                        pods=tuple(PodState(name=f"w{i}", ready=r, waiting_for=w) for i, (r, w) in enumerate(pods)))


def _watch(snapshots: list[WakeSnapshot], *, limit_s: float = 1800.0):
    clock, said, warned = Clock(), [], []
    feed = iter(snapshots)
    last = [snapshots[-1]]

    def read() -> WakeSnapshot:
        last[0] = next(feed, last[0])
        return last[0]

    watch = WakeWatch(read=read, limit_s=limit_s, say=said.append, warn=warned.append, poll_s=30, every_s=300,
                      clock=clock, sleep=clock.sleep)
    return watch.run(), said, warned


def test_a_cluster_at_zero_is_shown_coming_back_step_by_step_until_the_workers_are_ready():
    waiting = [(False, "a node")] * 2
    result, said, warned = _watch([
        _snap(0, 0, 0, []), _snap(2, 0, 0, waiting), _snap(2, 2, 0, waiting), _snap(2, 2, 0, waiting),
        _snap(2, 2, 2, [(False, "the image")] * 2), *[_snap(2, 2, 2, [(False, "the image")] * 2)] * 12,
        _snap(2, 2, 2, [(True, ""), (False, "its containers")]), _snap(2, 2, 2, [(True, "")] * 2)])
    assert result.ready and result.failure is None and result.waited_s == 18 * 30
    assert said[:4] == [
        "GPU nodes: 0 requested, 0 launched, 0 joined; worker pods: 0/2 ready (0 s)",
        "GPU nodes: 2 requested, 0 launched, 0 joined; worker pods: 0/2 ready (2 waiting for a node) (30 s)",
        "GPU nodes: 2 requested, 2 launched, 0 joined; worker pods: 0/2 ready (2 waiting for a node) (1 min 0 s)",
        "GPU nodes: 2 requested, 2 launched, 2 joined; worker pods: 0/2 ready (2 waiting for the image) (2 min 0 s)"]
    # Unchanged for a while: said again every 5 minutes, so a long pull does not look like a hang.
    assert said[4] == ("GPU nodes: 2 requested, 2 launched, 2 joined; worker pods: 0/2 ready (2 waiting for the "
                       "image) (7 min 0 s)")
    assert said[-1] == "GPU nodes: 2 requested, 2 launched, 2 joined; worker pods: 2/2 ready, after 9 min 0 s"
    assert warned == []


def test_a_warm_cluster_is_not_talked_about():
    result, said, warned = _watch([_snap(2, 2, 2, [(True, "")] * 2)])
    assert result.ready and said == [] and warned == []


def test_nodes_that_do_not_come_are_named_once_and_the_watch_ends_with_the_jobs_wait():
    waiting = [(False, "a node")] * 2
    result, said, warned = _watch([_snap(2, 0, 0, waiting, failure=CAPACITY)], limit_s=600)
    assert not result.ready and result.waited_s == 600
    assert result.failure.kind == "insufficient capacity"
    (warning,) = warned
    assert warning.startswith("the GPU nodes are not coming: insufficient capacity: We currently do not have "
                              "sufficient g6.12xlarge capacity in the Availability Zone you requested (us-west-2a)")
    assert "python -m capacity probe" in warning


def test_a_read_that_fails_is_said_once_and_the_watch_goes_on():
    calls = iter([RuntimeError("kubectl get nodes failed: Unauthorized")] * 2 + [_snap(2, 2, 2, [(True, "")] * 2)])
    clock, said, warned = Clock(), [], []

    def read():
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    result = WakeWatch(read=read, limit_s=600, say=said.append, warn=warned.append, poll_s=30, clock=clock,
                       sleep=clock.sleep).run()
    assert result.ready
    assert warned == ["cannot read the GPU nodes' progress: kubectl get nodes failed: Unauthorized"]


def test_without_aws_access_the_nodes_show_as_they_join(autoscaling):
    client, stubber = autoscaling
    stubber.add_client_error("describe_auto_scaling_groups", service_error_code="AccessDenied",
                             service_message="User is not authorized to perform: autoscaling:Describe...")
    reader = WakeReader(cluster=ClusterReader(kubectl=FakeKubectl(pods=[_pod("w0", scheduled=False)]),
                                              namespace="ray", ray_cluster="ray-train"),
                        group=GroupReader(autoscaling=client, cluster_name=CLUSTER, since=T0))
    first, second = reader.read(), reader.read()  # the group is not asked again
    assert first.group is None and "AccessDenied" in first.group_error
    assert summary(second) == "GPU nodes: 0 joined; worker pods: 0/2 ready (1 waiting for a node)"


# --- submit ----------------------------------------------------------------------------------------

def test_the_stack_output_says_whether_the_gpu_nodes_scale_to_zero():
    base = {"kubeconfig": "{}", "clusterName": CLUSTER, "region": "us-west-2", "rayNamespace": "ray",
            "rayClusterName": "ray-train", "rayHeadService": "ray-train-head-svc", "rayDashboardPort": 8265,
            "rayAuthSecretName": "ray-train", "rayAuthSecretKey": "auth_token", "checkpointBucketUri": "s3://b/p"}
    assert stack_outputs_from_json(base, stack="s").gpu_idle_minutes == 0  # deployed before it existed
    assert stack_outputs_from_json({**base, "gpuIdleMinutes": 30}, stack="s").gpu_idle_minutes == 30


def test_submit_on_a_stack_at_zero_waits_longer_shows_the_nodes_and_names_why_they_did_not_come(
        monkeypatch, tmp_path, capsys, autoscaling):
    client, stubber = autoscaling
    target = WakeTarget(kubeconfig=tmp_path / "kubeconfig", namespace="ray", ray_cluster="ray-train",
                        cluster_name=CLUSTER, region="us-west-2", idle_minutes=30)
    conn = Connection(address="http://127.0.0.1:1", token="t", storage_path="s3://b/p", target_args=("--stack", "s"),
                      gpu_memory_gib=24, ray_worker_gpus=8, wake=target)
    monkeypatch.setattr(submit, "connect", _fixed(conn))
    # The watch's first read, at once (the next would come after its 15 s poll).
    _expect_group(stubber, _group(2, []), [_activity("Failed", QUOTA, datetime.now(timezone.utc))], find=True)
    kubectl = FakeKubectl(pods=[_pod("w0", scheduled=False), _pod("w1", scheduled=False)])
    monkeypatch.setattr(submit, "watch_for", lambda target, **kw: watch_for(target, autoscaling=client,
                                                                             kubectl=kubectl, **kw))
    requests = []

    def follow_until_the_driver_gives_up(conn, request, *, console, on_submitted):
        requests.append(request)
        on_submitted("run-job1")
        import time

        time.sleep(0.5)  # the watch reads the cluster meanwhile
        return JobOutcome(job_id="run-job1", status="FAILED",
                          reason="error: 0 of 8 GPU(s) registered with the Ray cluster within 1800 s")

    monkeypatch.setattr(submit, "submit_and_follow", follow_until_the_driver_gives_up)
    monkeypatch.setattr(revisions, "ask_the_hub", lambda repo, **kw: "e5" * 20)  # the preset's hub model and data
    code = submit.main("submit", ["--stack", "us-west-2", "--preset", "qwen2.5-1.5b-24gb", "--run-name", "run"])
    out = capsys.readouterr().out
    assert code == 1
    (request,) = requests
    assert request.wait_gpus_s == WAKE_WAIT_S  # the nodes and the image pull take minutes
    assert "nodes GPU nodes: 2 requested, 0 launched, 0 joined; worker pods: 0/2 ready (2 waiting for a node)" in out
    assert "nodes the GPU nodes are not coming: quota: You have requested more vCPU capacity" in out
    assert out.rstrip().endswith("(the GPU nodes did not come: quota: You have requested more vCPU capacity than "
                                 "your current vCPU limit of 0 allows for the instance bucket that the specified "
                                 "instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request "
                                 "to request an adjustment to this limit. Raise the Running On-Demand vCPU quota of "
                                 "the instance family in Service Quotas (`python -m capacity probe` shows it); "
                                 "waiting will not)")


def test_submit_to_an_address_or_a_stack_that_keeps_its_nodes_watches_nothing(monkeypatch, capsys):
    conn = Connection(address="http://127.0.0.1:1", token="t", storage_path="/tmp/x", target_args=("--address", "x"))
    monkeypatch.setattr(submit, "connect", _fixed(conn))
    monkeypatch.setattr(submit, "watch_for", lambda *a, **k: pytest.fail("watched a cluster that keeps its nodes"))
    seen = []

    def follow(conn, request, *, console, on_submitted):
        seen.append(request)
        return JobOutcome(job_id="j", status="SUCCEEDED")

    monkeypatch.setattr(submit, "submit_and_follow", follow)
    submit.main("submit", ["--address", "http://127.0.0.1:1", "--preset", "demo-cpu", "--run-name", "r"])
    assert seen[0].wait_gpus_s is None


def _fixed(conn: Connection):
    from contextlib import contextmanager

    @contextmanager
    def connect(**_: Any):
        yield conn

    return connect


def test_the_wait_for_gpus_reaches_the_driver():
    from workloads.client.submission import build_submission
    from workloads.launch.driver import parse_args

    sub = build_submission(train={"steps": 1}, run_name="r", storage_path="s3://b/p", max_failures=1,
                           working_dir=str(Path.cwd()), expect="efa", gpus=8, wait_gpus_s=1800)
    import shlex

    argv = shlex.split(sub.entrypoint)[3:]
    assert parse_args(argv).wait_gpus_s == 1800


def test_a_bad_wait_for_gpus_is_refused(capsys):
    assert submit.main("submit", ["--address", "http://127.0.0.1:1", "--wait-gpus-s", "0"]) == 2
    assert "--wait-gpus-s must be > 0, got 0" in capsys.readouterr().err


def test_a_watch_that_fails_outside_its_reads_says_so_and_the_job_goes_on():
    """Its reads' failures are warned about and the watch goes on; anything else that ends it is said
    too, rather than leaving a thread that stopped without a word."""
    warned = []

    def say(line: str) -> None:
        raise BrokenPipeError("the console went away")

    watch = WakeWatch(read=lambda: _snap(2, 0, 0, [(False, "a node")] * 2), limit_s=600, say=say, warn=warned.append,
                      poll_s=30, every_s=300, clock=Clock(), sleep=lambda seconds: None)
    with WakeWatching(watch) as watching:
        pass
    assert watching.result is not None and not watching.result.ready
    assert warned == ["the watch of the GPU nodes stopped: the console went away; the job goes on without it"]
