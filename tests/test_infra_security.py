"""The security controls of the stack as declared (docs/SECURITY.md): who reaches the EKS API, what
pods can reach on the node and on the network, what the Ray pods may do, and how the bucket is
reached; under Pulumi mocks and through the policy pack, as the engine would feed it."""

from __future__ import annotations

import dataclasses
import json

import kubernetes_validate
import pytest

from infra.config import parse_stack_config, read_stack_values
from infra.network_policy import ray_network_policy
from infra.raycluster import RAY_POD_LABELS, build_raycluster
from test_infra_helm_values import _chart_file
from test_infra_program import REPO_ROOT, ProgramRun, run_program, transformed_child
from test_infra_reservation import odcr_values, run_stack
from test_policy_pack import analyze, servicer  # noqa: F401  (a fixture)

import rules  # noqa: E402  (the policy pack's, on the path test_policy_pack puts it on)

STACK_FILE = REPO_ROOT / "Pulumi.us-west-2.yaml"


# --- the EKS API endpoint -------------------------------------------------------------------------

def test_an_api_open_to_every_address_is_declared_only_as_the_stack_says_and_then_passes_the_pack(
        monkeypatch, servicer):  # noqa: F811
    config = {**read_stack_values(STACK_FILE),
              "ray-eks:apiAccessCidrs": ["0.0.0.0/0"], "ray-eks:apiOpenToInternet": True}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    cluster = run.one("eks:index:Cluster").inputs
    assert (cluster["endpointPublicAccess"], cluster["publicAccessCidrs"]) == (True, ["0.0.0.0/0"])
    assert cluster["clusterTags"] == {rules.OPEN_TO_INTERNET_TAG: "true"}
    # What pulumi-eks makes of it: the aws:eks/cluster:Cluster with the cluster tags among its tags.
    created = {"vpcConfig": {"endpointPublicAccess": True, "publicAccessCidrs": cluster["publicAccessCidrs"]},
               "tags": {"Name": "cluster-eks", **cluster["clusterTags"]}}
    assert analyze(servicer, rules.EKS_CLUSTER, created) == []
    assert [d.policyName for d in analyze(servicer, rules.EKS_CLUSTER, {**created, "tags": {}})] == [
        "eks-api-not-open-to-all"]
    # The committed stack: no public endpoint, and no such tag.
    committed = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=read_stack_values(STACK_FILE),
                            monkeypatch=monkeypatch)
    assert "clusterTags" not in committed.one("eks:index:Cluster").inputs
    assert any("the EKS API endpoint is private" in w for w in committed.warnings)


# --- the node role, out of the pods' reach --------------------------------------------------------

@pytest.fixture(scope="module")
def committed_run() -> ProgramRun:
    with pytest.MonkeyPatch.context() as mp:
        return run_program(repo_root=REPO_ROOT, stack="us-west-2", config=read_stack_values(STACK_FILE),
                           monkeypatch=mp)


LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"


def test_every_node_requires_imdsv2_with_one_hop_so_pods_cannot_reach_the_node_role(committed_run, tmp_path):
    groups = committed_run.of_type("eks:index:ManagedNodeGroup")
    assert len(groups) == 2
    for group in groups:
        # pulumi-eks builds the launch template (enableImdSv2 makes it build one for the system nodes
        # too, with a hop limit of 2); the group's transform sets what it offers no option for.
        assert group.inputs["enableIMDSv2"] is True
        options = transformed_child(group, LAUNCH_TEMPLATE, {"metadataOptions": {
            "httpTokens": "required", "httpPutResponseHopLimit": 2, "httpEndpoint": "enabled"}})["metadataOptions"]
        assert options == {"httpTokens": "required", "httpPutResponseHopLimit": 1, "httpEndpoint": "enabled"}
    # The reserved GPU group's own launch template says so directly.
    reserved = run_stack(tmp_path, "us-west-2", odcr_values())
    assert reserved.one(LAUNCH_TEMPLATE).inputs["metadataOptions"] == {
        "httpTokens": "required", "httpPutResponseHopLimit": 1, "httpEndpoint": "enabled"}


def test_the_vpc_cnis_permissions_are_its_own_service_accounts_not_the_node_roles(committed_run):
    run = committed_run
    attached = {a.name: a.inputs["policyArn"].rsplit("/", 1)[-1]
                for a in run.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")}
    # The node roles (one per group, named after it): join the cluster and pull images, no more.
    for group in ("system", "gpu"):
        assert {p for n, p in attached.items() if n.startswith(f"{group}-")} == {
            "AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly"}
    assert attached["cluster-vpc-cni-policy"] == "AmazonEKS_CNI_Policy"
    cluster = run.one("eks:index:Cluster").inputs
    assert cluster["useDefaultVpcCni"] is True  # pulumi-eks's own add-on takes no Pod Identity association
    (cni,) = [a for a in run.of_type("aws:eks/addon:Addon") if a.inputs["addonName"] == "vpc-cni"]
    assert cni.inputs["addonVersion"] == parse_stack_config(read_stack_values(STACK_FILE)).vpc_cni_version
    assert cni.inputs["podIdentityAssociations"] == [
        {"roleArn": "arn:aws:iam::123456789012:role/cluster-vpc-cni-role", "serviceAccount": "aws-node"}]
    role = next(r for r in run.of_type("aws:iam/role:Role") if r.name == "cluster-vpc-cni-role")
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {
        "Service": "pods.eks.amazonaws.com"}
    # The CNI's pods get their credentials only if admitted after the association: both node
    # groups wait for the add-on (pulumi-eks made them wait for its own).
    for group in ("system-nodes", "gpu-nodes"):
        assert cni.name in run.waits_for("eks:index:ManagedNodeGroup", group)


# --- the Ray pods on the network ------------------------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(policy: dict, *, namespace: str, labels: dict[str, str]) -> bool:
    """Kubernetes' reading of an ingress rule's `from` peers: a podSelector alone picks pods of the
    policy's namespace; with a namespaceSelector, pods of the namespaces it picks (matched here by
    the `kubernetes.io/metadata.name` label every namespace carries)."""
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            where = peer.get("namespaceSelector")
            in_namespace = (namespace == policy["metadata"]["namespace"] if where is None
                            else _selects(where, {"kubernetes.io/metadata.name": namespace}))
            if in_namespace and _selects(peer.get("podSelector", {}), labels):
                return True
    return False


def test_ray_pods_take_connections_from_ray_pods_and_the_kuberay_operator_only(shared_dir):
    cfg = parse_stack_config(read_stack_values(STACK_FILE))
    policy = ray_network_policy(namespace=cfg.ray_namespace, ray_pod_labels=RAY_POD_LABELS)
    kubernetes_validate.validate(policy, desired_version="1.34", strict=True)
    manifest = build_raycluster(cfg)
    pods = [manifest["spec"]["headGroupSpec"]["template"], manifest["spec"]["workerGroupSpecs"][0]["template"]]
    for pod in pods:  # every Ray pod is guarded, and Ray pods reach each other
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert _selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
        assert _admits(policy, namespace=cfg.ray_namespace, labels=pod["metadata"]["labels"])
    # The operator's pod, labelled by its chart with the chart's name (values.yaml's nameOverride).
    operator_name = _chart_file(shared_dir, "kuberay-operator", "values")["nameOverride"]
    assert _admits(policy, namespace="kuberay-system", labels={"app.kubernetes.io/name": operator_name,
                                                                "app.kubernetes.io/instance": "kuberay-operator"})
    # Nothing else: another pod in the Ray namespace, a pod elsewhere that copies the Ray label,
    # the Cluster Autoscaler, any pod of the operator's namespace that is not the operator.
    assert not _admits(policy, namespace=cfg.ray_namespace, labels={"run": "debug"})
    assert not _admits(policy, namespace="default", labels=pods[0]["metadata"]["labels"])
    assert not _admits(policy, namespace="kube-system", labels={"app.kubernetes.io/name": "cluster-autoscaler"})
    assert not _admits(policy, namespace="kuberay-system", labels={"app.kubernetes.io/name": "other"})


def test_the_policy_is_enforced_and_in_place_before_the_ray_cluster(committed_run):
    run = committed_run
    (cni,) = [a for a in run.of_type("aws:eks/addon:Addon") if a.inputs["addonName"] == "vpc-cni"]
    assert json.loads(cni.inputs["configurationValues"]) == {"enableNetworkPolicy": "true"}
    policy = run.one("kubernetes:networking.k8s.io/v1:NetworkPolicy")
    cfg = parse_stack_config(read_stack_values(STACK_FILE))
    expected = ray_network_policy(namespace=cfg.ray_namespace, ray_pod_labels=RAY_POD_LABELS)
    assert (policy.inputs["metadata"], policy.inputs["spec"]) == (expected["metadata"], expected["spec"])
    assert policy.name in run.waits_for("kubernetes:ray.io/v1:RayCluster", "ray-raycluster")


# --- the bucket, over TLS only --------------------------------------------------------------------

def test_the_bucket_denies_every_request_without_tls_in_a_policy_kept_with_it(committed_run):
    run = committed_run
    bucket = run.one("aws:s3/bucket:Bucket")
    policy = run.one("aws:s3/bucketPolicy:BucketPolicy")
    assert policy.inputs["bucket"] == f"{bucket.name}-id"
    (statement,) = json.loads(policy.inputs["policy"])["Statement"]
    arn = f"arn:aws:s3:::{bucket.inputs['bucketPrefix']}abc123"
    assert statement == {"Sid": "DenyWithoutTls", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
                         "Resource": [arn, f"{arn}/*"], "Condition": {"Bool": {"aws:SecureTransport": "false"}}}
    assert rules.denies_insecure_transport(policy.inputs["policy"])
    # Kept with the bucket (its configuration goes with it otherwise), and set after its public
    # access block, against which S3 checks a new policy.
    assert bucket.retain_on_delete and policy.retain_on_delete
    assert "checkpoints-public-access-block" in run.waits_for("aws:s3/bucketPolicy:BucketPolicy", policy.name)


# --- the Ray pods' privileges ---------------------------------------------------------------------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
"""What the Pod Security Standards' baseline level lets a container add."""


def _pod_security_failures(pod: dict, containers: list[dict]) -> dict[str, list[str]]:
    """The Pod Security Standards' checks (kubernetes.io/docs/concepts/security/pod-security-standards)
    that apply to these pods, by level: what fails baseline, and what more fails restricted."""
    baseline, restricted = [], []
    if any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
        baseline.append("host namespaces")
    if any("hostPath" in v for v in pod.get("volumes", [])):
        baseline.append("hostPath volumes")
    pod_seccomp = pod.get("securityContext", {}).get("seccompProfile", {}).get("type")
    for c in containers:
        ctx = c.get("securityContext", {})
        if ctx.get("privileged"):
            baseline.append(f"{c.get('name')}: privileged")
        if set(ctx.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            baseline.append(f"{c.get('name')}: capabilities added")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            baseline.append(f"{c.get('name')}: host ports")
        seccomp = ctx.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp == "Unconfined":
            baseline.append(f"{c.get('name')}: seccomp unconfined")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            restricted.append(f"{c.get('name')}: no seccomp profile")
        if ctx.get("allowPrivilegeEscalation") is not False:
            restricted.append(f"{c.get('name')}: privilege escalation")
        if ctx.get("capabilities", {}).get("drop") != ["ALL"]:
            restricted.append(f"{c.get('name')}: capabilities not dropped")
        if not (ctx.get("runAsNonRoot") or pod.get("securityContext", {}).get("runAsNonRoot")):
            restricted.append(f"{c.get('name')}: may run as root")
    return {"baseline": baseline, "restricted": restricted}


@pytest.mark.parametrize("changes", [{}, {"gpu_capacity_type": "spot"}, {"gpu_idle_minutes": 30}],
                         ids=["on-demand", "spot", "idle-to-zero"])
def test_ray_pods_drop_every_capability_escalate_nothing_and_meet_the_baseline_standard(changes):
    cfg = dataclasses.replace(parse_stack_config(read_stack_values(STACK_FILE)), **changes)
    spec = build_raycluster(cfg)["spec"]
    for template in (spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]):
        pod = template["spec"]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod},
                                     desired_version="1.34", strict=True)
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        for container in pod["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}
        failures = _pod_security_failures(pod, pod["containers"])
        assert failures["baseline"] == []
        # restricted asks one thing more: runAsNonRoot, which the image's own user decides.
        assert failures["restricted"] == [f"{c['name']}: may run as root" for c in pod["containers"]]
    if cfg.gpu_idle_minutes:  # the autoscaler sidecar KubeRay adds to the head
        assert spec["autoscalerOptions"]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                                "capabilities": {"drop": ["ALL"]}}


def test_the_ray_namespace_enforces_the_baseline_standard_and_warns_on_restricted(committed_run):
    namespace = committed_run.one("kubernetes:core/v1:Namespace").inputs["metadata"]
    assert namespace["labels"] == {
        "pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "v1.34",
        "pod-security.kubernetes.io/warn": "restricted", "pod-security.kubernetes.io/warn-version": "v1.34",
        "pod-security.kubernetes.io/audit": "restricted", "pod-security.kubernetes.io/audit-version": "v1.34"}


# --- the control plane's logs ---------------------------------------------------------------------

def test_eks_audit_and_authenticator_logs_go_to_a_log_group_with_a_retention(committed_run):
    run = committed_run
    cluster = run.one("eks:index:Cluster")
    assert set(cluster.inputs["enabledClusterLogTypes"]) >= {"audit", "authenticator"}
    group = run.one("aws:cloudwatch/logGroup:LogGroup")
    # EKS writes to /aws/eks/<cluster>/cluster, and creates it without a retention unless it exists.
    assert group.inputs["name"] == f"/aws/eks/{cluster.inputs['name']}/cluster"
    assert group.inputs["retentionInDays"] == 90
    assert group.name in run.waits_for("eks:index:Cluster", cluster.name)
