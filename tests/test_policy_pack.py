"""The policy pack as the Pulumi engine drives it.

Requests go through pulumi-policy's own analyzer servicer (the object the pack's gRPC server
serves), so property deserialisation, the unknown-value proxies, enforcement levels and
stack-resource linking are the real ones. One test starts the pack the way the Pulumi CLI does
(`python -m pulumi.policy <engine> policy`) and talks to it over gRPC. Another declares the real
storage, add-on and RayCluster components under Pulumi mocks and runs every policy on exactly the
inputs they register.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pulumi
import pytest
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime import proto
from pulumi.runtime.proto import analyzer_pb2_grpc
from pulumi_policy import EnforcementLevel
from pulumi_policy.policy import _PolicyAnalyzerServicer
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

REPO_ROOT = Path(__file__).resolve().parent.parent
POLICY_DIR = REPO_ROOT / "policy"
sys.path.insert(0, str(POLICY_DIR))

import policies  # noqa: E402
import rules  # noqa: E402
from test_policy_rules import (LT_URN, NG_URN, PG_URN, bucket_stack, efa_launch_template,  # noqa: E402
                               gpu_node_group, gpu_stack, helm_releases, raycluster)

POLICY_NAMES = {p.name for p in policies.POLICIES}


def _unknowns_to_wire(value: Any) -> Any:
    """Plain test data in the engine's wire form: UNKNOWN becomes the engine's sentinel."""
    if value is rules.UNKNOWN:
        return UNKNOWN_STRING_VALUE
    if isinstance(value, dict):
        return {k: _unknowns_to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_unknowns_to_wire(v) for v in value]
    return value


def _struct(props: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(_unknowns_to_wire(props))
    return s


@pytest.fixture(scope="module")
def servicer() -> _PolicyAnalyzerServicer:
    return _PolicyAnalyzerServicer("ray-eks-invariants", "0.1.0", policies.POLICIES,
                                   EnforcementLevel.MANDATORY)


ADVISORY_POLICIES = {"images-pinned-by-digest"}
"""Policies that warn rather than stop a preview (docs/POLICY.md says why)."""


def analyze(servicer, resource_type: str, props: dict[str, Any], *,
            advisory: bool = False) -> list[proto.AnalyzeDiagnostic]:
    """The diagnostics of one resource that fail a preview (mandatory ones); with `advisory`, its
    warnings too."""
    urn = f"urn:pulumi:us-west-2::ray-eks::{resource_type}::r"
    request = proto.AnalyzeRequest(type=resource_type, properties=_struct(props), urn=urn, name="r")
    return [d for d in servicer.Analyze(request, None).diagnostics
            if advisory or d.enforcementLevel == proto.MANDATORY]


def analyze_stack(servicer, resources: list[rules.StackResource]) -> list[proto.AnalyzeDiagnostic]:
    request = proto.AnalyzeStackRequest(resources=[
        proto.AnalyzerResource(
            type=r.type, urn=r.urn, name=r.urn.rsplit("::", 1)[-1], properties=_struct(dict(r.props)),
            dependencies=list(r.dependencies),
            propertyDependencies={k: proto.AnalyzerPropertyDependencies(urns=list(v))
                                  for k, v in r.property_dependencies.items()})
        for r in resources])
    return list(servicer.AnalyzeStack(request, None).diagnostics)


def test_every_policy_is_mandatory_but_the_digest_advice():
    levels = {p.name: p.enforcement_level for p in policies.POLICIES}
    assert {n for n, level in levels.items() if level != EnforcementLevel.MANDATORY} == ADVISORY_POLICIES
    assert levels["images-pinned-by-digest"] == EnforcementLevel.ADVISORY
    assert len(POLICY_NAMES) == len(policies.POLICIES) == 19


def test_an_image_pinned_by_tag_only_is_a_warning_that_does_not_stop_the_preview(servicer):
    rc = raycluster()  # the committed stack's, its image by version tag
    diagnostics = analyze(servicer, rules.RAY_CLUSTER, rc, advisory=True)
    assert [(d.policyName, d.enforcementLevel) for d in diagnostics] == [
        ("images-pinned-by-digest", proto.ADVISORY)] * 2
    assert "python -m infra lock-images" in diagnostics[0].message
    locked = f"{rc['spec']['headGroupSpec']['template']['spec']['containers'][0]['image']}@sha256:{'0' * 64}"
    for template in (rc["spec"]["headGroupSpec"]["template"], rc["spec"]["workerGroupSpecs"][0]["template"]):
        template["spec"]["containers"][0]["image"] = locked
    assert analyze(servicer, rules.RAY_CLUSTER, rc, advisory=True) == []


def test_an_api_endpoint_open_to_all_fails_the_preview_unless_the_cluster_says_it_is_meant(servicer):
    from test_policy_rules import eks_cluster
    diagnostics = analyze(servicer, rules.EKS_CLUSTER, eks_cluster(["0.0.0.0/0"]))
    assert [(d.policyName, d.enforcementLevel) for d in diagnostics] == [
        ("eks-api-not-open-to-all", proto.MANDATORY)]
    assert analyze(servicer, rules.EKS_CLUSTER, eks_cluster(["198.51.100.0/24"])) == []
    meant = eks_cluster(["0.0.0.0/0"], tags={rules.OPEN_TO_INTERNET_TAG: "true"})
    assert analyze(servicer, rules.EKS_CLUSTER, meant) == []


def _raycluster_with(change) -> dict[str, Any]:
    rc = raycluster()
    change(rc["spec"]["headGroupSpec"], rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
           ["containers"][0])
    return rc


def _drop_efa(container: dict[str, Any]) -> None:
    for side in ("requests", "limits"):
        container["resources"][side].pop(rules.EFA_RESOURCE)


@pytest.mark.parametrize("resource_type, make_props, policy", [
    (rules.NODE_GROUP, lambda: {**gpu_node_group(), "labels": {"role": "gpu"}},
     "gpu-node-group-label-taint-launch-template"),
    (rules.RAY_CLUSTER, lambda: _raycluster_with(lambda head, worker: _drop_efa(worker)),
     "ray-worker-guaranteed-efa"),
    (rules.RAY_CLUSTER,
     lambda: _raycluster_with(lambda head, worker: head.update(serviceType="LoadBalancer")),
     "ray-not-exposed"),
    (rules.SERVICE,
     lambda: {"spec": {"type": "LoadBalancer", "selector": {"ray.io/node-type": "head"}}},
     "ray-not-exposed"),
    (rules.RAY_CLUSTER,
     lambda: _raycluster_with(lambda head, worker: worker.update(image="rayproject/ray:latest")),
     "pinned-images"),
    ("kubernetes:apps/v1:DaemonSet",
     lambda: {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}}}},
     "pinned-images"),
    (rules.HELM_RELEASE, lambda: {"chart": "kuberay-operator", "version": "^1.7.0"},
     "pinned-chart-versions"),
    (rules.PUBLIC_ACCESS_BLOCK, lambda: {"bucket": "b", "blockPublicAcls": True},
     "s3-public-access-blocked"),
    (rules.ENCRYPTION_CONFIGS[0], lambda: {"bucket": "b", "rules": []},
     "s3-encryption-algorithm"),
    (rules.LAUNCH_TEMPLATE, lambda: {**efa_launch_template(), "metadataOptions": {
        "httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 2}},
     "launch-template-imdsv2-one-hop"),
])
def test_violation_is_reported_as_mandatory(servicer, resource_type, make_props, policy):
    diagnostics = analyze(servicer, resource_type, make_props())
    assert [d.policyName for d in diagnostics] == [policy]
    assert diagnostics[0].enforcementLevel == proto.MANDATORY


@pytest.mark.parametrize("resource_type, props", [
    (rules.NODE_GROUP, gpu_node_group()),
    (rules.RAY_CLUSTER, raycluster()),
    *[(rules.HELM_RELEASE, release) for release in helm_releases().values()],
    *[(r.type, dict(r.props)) for r in bucket_stack()],
    (rules.LAUNCH_TEMPLATE, efa_launch_template()),
])
def test_program_resources_pass(servicer, resource_type, props):
    assert analyze(servicer, resource_type, props) == []


def test_unknown_values_give_neither_violation_nor_preview_warning(servicer):
    rc = raycluster()
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = rules.UNKNOWN
    rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] += "@sha256:" + "0" * 64
    rc["metadata"]["namespace"] = rules.UNKNOWN
    assert analyze(servicer, rules.RAY_CLUSTER, rc, advisory=True) == []
    assert analyze(servicer, rules.HELM_RELEASE, {"chart": "c", "version": rules.UNKNOWN}) == []


def test_unknown_value_elsewhere_does_not_silence_a_rule(servicer):
    rc = raycluster()
    rc["metadata"]["namespace"] = rules.UNKNOWN
    rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = "ray:latest"
    assert [d.policyName for d in analyze(servicer, rules.RAY_CLUSTER, rc)] == ["pinned-images"]


def test_stack_policies_on_the_program_stack(servicer):
    assert analyze_stack(servicer, gpu_stack() + bucket_stack()) == []


def test_stack_policies_report_against_the_offending_resource(servicer):
    no_efa = {**efa_launch_template(), "networkInterfaces": []}
    resources = gpu_stack(template=no_efa) + bucket_stack(with_block=False)
    diagnostics = analyze_stack(servicer, resources)
    assert sorted((d.policyName, d.urn) for d in diagnostics) == sorted([
        ("gpu-node-group-efa", LT_URN),
        ("s3-bucket-private-and-encrypted", bucket_stack()[0].urn),
    ])
    assert {d.enforcementLevel for d in diagnostics} == {proto.MANDATORY}


def test_launch_template_linked_through_property_dependencies_only(servicer):
    # During preview the node group's launchTemplate.id is unknown: only the engine's property
    # dependencies tie it to its template.
    ng, lt, pg = gpu_stack(placement={"strategy": "partition", "name": "pg"})
    assert ng.props["launchTemplate"]["id"] is rules.UNKNOWN
    (diagnostic,) = analyze_stack(servicer, [ng, lt, pg])
    assert diagnostic.urn == LT_URN and "'partition'" in diagnostic.message
    assert {NG_URN, PG_URN}.isdisjoint({diagnostic.urn})


# --- The pack as the Pulumi CLI starts it ----------------------------------------------------

def test_pack_process_serves_mandatory_policies():
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "pulumi.policy", "127.0.0.1:1", str(POLICY_DIR)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline().strip())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = analyzer_pb2_grpc.AnalyzerStub(channel)
            info = stub.GetAnalyzerInfo(empty_pb2.Empty(), timeout=20)
            assert info.name == "ray-eks-invariants"
            assert {p.name for p in info.policies} == POLICY_NAMES
            assert {p.name for p in info.policies if p.enforcementLevel != proto.MANDATORY} == ADVISORY_POLICIES
            rc = raycluster()
            rc["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
            response = stub.Analyze(proto.AnalyzeRequest(
                type=rules.RAY_CLUSTER, properties=_struct(rc), urn="urn:x", name="x"), timeout=20)
            assert [(d.policyName, d.enforcementLevel) for d in response.diagnostics] == [
                ("ray-not-exposed", proto.MANDATORY), *[("images-pinned-by-digest", proto.ADVISORY)] * 2]
    finally:
        process.kill()
        _, stderr = process.communicate(timeout=10)
    assert "Traceback" not in stderr, stderr


# --- The real components' inputs under Pulumi mocks ------------------------------------------

class _Recorder(pulumi.runtime.Mocks):
    """Records what each resource registers (type, name, inputs, outputs); a bucket's id is its
    name, and its ARN is named after it, as in S3."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
        state = dict(args.inputs)
        resource_id = f"{args.name}-id"
        if args.typ in rules.BUCKETS:
            resource_id = state["bucket"] = f"{args.inputs['bucketPrefix']}1a2b3c"
            state["arn"] = f"arn:aws:s3:::{resource_id}"
        self.registered.append((args.typ, args.name, dict(args.inputs), state))
        return resource_id, state

    def call(self, args: pulumi.runtime.MockCallArgs) -> dict:
        return {"partition": "aws", "dnsSuffix": "amazonaws.com"}


@pytest.fixture(scope="module")
def registered() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    import pulumi_kubernetes as k8s

    from infra.addons import Addons, AddonsArgs
    from infra.config import load_stack_config
    from infra.helm_values import chart_values, chart_versions
    from infra.raycluster import (SERVICE_ACCOUNT, RayClusterDeployment, RayClusterDeploymentArgs,
                                  build_raycluster)
    from infra.storage import CheckpointStorage, CheckpointStorageArgs

    recorder = _Recorder()
    # Pulumi's mocks make their futures on the thread's current event loop. Give them one: the
    # tests that ran before in this process may have left none (asyncio.run does), and which tests
    # those are depends on how xdist shares the modules out.
    asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_mocks(recorder, project="ray-eks", stack="us-west-2", preview=False)
    cfg = load_stack_config("us-west-2", REPO_ROOT)

    @pulumi.runtime.test
    def declare():
        provider = k8s.Provider("k8s", kubeconfig="{}")
        storage = CheckpointStorage("checkpoints", CheckpointStorageArgs(
            bucket_prefix=cfg.checkpoint_bucket_prefix,
            retain_on_destroy=cfg.retain_checkpoints_on_destroy,
            noncurrent_version_days=cfg.checkpoint_noncurrent_version_days,
            incomplete_upload_days=cfg.checkpoint_incomplete_upload_days, key_prefix="runs",
            cluster_name="ray-eks", namespace=cfg.ray_namespace, service_account=SERVICE_ACCOUNT,
            cluster=provider))
        addons = Addons("addons", AddonsArgs(provider=provider,
                                             values=chart_values(cfg, cluster_name="ray-eks-us-west-2"),
                                             versions=chart_versions(cfg), system_nodes=provider,
                                             gpu_nodes=provider))
        ray = RayClusterDeployment("ray", RayClusterDeploymentArgs(
            manifest=build_raycluster(cfg), provider=provider,
            operator_release=addons.kuberay_operator, pod_identity=storage.pod_identity,
            kubeconfig="{}", workers_ready_timeout_minutes=cfg.workers_ready_timeout_minutes,
            kubernetes_version=cfg.kubernetes_version))
        return pulumi.Output.all(storage.uri, ray.cluster_name)

    declare()
    return recorder.registered


def test_registered_inputs_pass_every_resource_policy(servicer, registered):
    types = {t for t, _, _, _ in registered}
    assert {rules.RAY_CLUSTER, rules.HELM_RELEASE, rules.BUCKETS[0], rules.PUBLIC_ACCESS_BLOCK,
            rules.ENCRYPTION_CONFIGS[0]} <= types
    for resource_type, name, inputs, _ in registered:
        assert analyze(servicer, resource_type, inputs) == [], name


def _registered_stack(registered) -> list[rules.StackResource]:
    return [rules.StackResource(urn=f"urn:{t}::{n}", type=t, props=outputs) for t, n, _, outputs in registered]


def test_the_ray_namespace_as_registered_passes_and_a_service_by_any_selector_in_front_of_it_fails(
        servicer, registered):
    resources = _registered_stack(registered)
    assert {rules.RAY_CLUSTER, rules.NAMESPACE, rules.NETWORK_POLICY} <= {r.type for r in resources}
    assert analyze_stack(servicer, resources) == []
    # A LoadBalancer named like nothing of Ray's, selecting the pods by the label the program gives them.
    from infra.raycluster import RAY_POD_LABELS
    namespace = next(r for r in resources if r.type == rules.NAMESPACE).props["metadata"]["name"]
    lb = rules.StackResource(urn="urn:kubernetes:core/v1:Service::grafana", type=rules.SERVICE, props={
        "metadata": {"name": "grafana", "namespace": namespace},
        "spec": {"type": "LoadBalancer", "selector": dict(RAY_POD_LABELS)}})
    assert analyze(servicer, rules.SERVICE, dict(lb.props)) == []  # no ray.io/* label: the resource rule cannot tell
    (diagnostic,) = analyze_stack(servicer, [*resources, lb])
    assert (diagnostic.policyName, diagnostic.urn, diagnostic.enforcementLevel) == (
        "ray-pods-not-exposed", lb.urn, proto.MANDATORY)
    # Without its NetworkPolicy or its Pod Security labels, the namespace fails the preview too.
    unguarded = [r for r in resources if r.type != rules.NETWORK_POLICY]
    assert {d.policyName for d in analyze_stack(servicer, unguarded)} == {"ray-namespace-network-policy"}
    bare = [rules.StackResource(urn=r.urn, type=r.type, props={"metadata": {"name": namespace}})
            if r.type == rules.NAMESPACE else r for r in resources]
    assert {d.policyName for d in analyze_stack(servicer, bare)} == {"ray-namespace-pod-security"}


def test_registered_bucket_passes_stack_policy(servicer, registered):
    # Stack policies see outputs; the mocks give no property dependencies, so the bucket is
    # matched by its name, as it is at `pulumi up`.
    resources = _registered_stack(registered)
    assert analyze_stack(servicer, resources) == []
    without_block = [r for r in resources if r.type != rules.PUBLIC_ACCESS_BLOCK]
    (diagnostic,) = analyze_stack(servicer, without_block)
    assert "no BucketPublicAccessBlock" in diagnostic.message
