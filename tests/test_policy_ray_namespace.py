"""The policy pack's rules on the Ray namespace: who reaches the Ray pods (Services and Ingresses by any
selector, the NetworkPolicy) and what the namespace admits (its Pod Security labels).

The compliant stack is what RayClusterDeployment registers for the committed stack: the RayCluster from
infra.raycluster's builder, the Namespace with its Pod Security labels, the NetworkPolicy from
infra.network_policy. The Ray pods' labels are KubeRay v1.7.0's (`labelPod` in
ray-operator/controllers/ray/common/pod.go): the template's own, then seven of its own of which
`ray.io/node-type`, `ray.io/group` and `ray.io/cluster` cannot be overridden.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "policy"))

import rules  # noqa: E402  (policy/ is the pack's own import root, as under `pulumi preview`)
from rules import UNKNOWN, StackResource  # noqa: E402

from infra.config import load_stack_config  # noqa: E402
from infra.network_policy import ray_network_policy  # noqa: E402
from infra.raycluster import RAY_POD_LABELS, build_raycluster, head_service_name, pod_security_labels  # noqa: E402

CFG = load_stack_config("us-west-2", REPO_ROOT)
NAMESPACE = CFG.ray_namespace
RC_URN = ("urn:pulumi:us-west-2::ray-eks::ray-eks:infra:RayClusterDeployment"
          "$kubernetes:ray.io/v1:RayCluster::ray-raycluster")
NS_URN = "urn:pulumi:us-west-2::ray-eks::ray-eks:infra:RayClusterDeployment$kubernetes:core/v1:Namespace::ray-namespace"
NP_URN = ("urn:pulumi:us-west-2::ray-eks::ray-eks:infra:RayClusterDeployment"
          "$kubernetes:networking.k8s.io/v1:NetworkPolicy::ray-network-policy")
SVC_URN = "urn:pulumi:us-west-2::ray-eks::kubernetes:core/v1:Service::dashboard"
ING_URN = "urn:pulumi:us-west-2::ray-eks::kubernetes:networking.k8s.io/v1:Ingress::dashboard"


def ray_stack(*, namespace_labels: dict | None = None, policy: dict | None = None,
              with_namespace: bool = True, with_policy: bool = True) -> list[StackResource]:
    """The RayCluster, its Namespace and its NetworkPolicy as RayClusterDeployment registers them."""
    manifest = build_raycluster(CFG)
    out = [StackResource(urn=RC_URN, type=rules.RAY_CLUSTER, props=manifest)]
    if with_namespace:
        labels = pod_security_labels(CFG.kubernetes_version) if namespace_labels is None else namespace_labels
        out.append(StackResource(urn=NS_URN, type=rules.NAMESPACE,
                                 props={"metadata": {"name": NAMESPACE, "labels": labels}}))
    if with_policy:
        policy = policy or ray_network_policy(namespace=NAMESPACE, ray_pod_labels=RAY_POD_LABELS)
        out.append(StackResource(urn=NP_URN, type=rules.NETWORK_POLICY,
                                 props={"metadata": policy["metadata"], "spec": policy["spec"]}))
    return out


def service(selector: Any, *, type_: str = "LoadBalancer", namespace: Any = NAMESPACE, **spec: Any) -> StackResource:
    metadata = {"name": "dashboard"} if namespace is None else {"name": "dashboard", "namespace": namespace}
    return StackResource(urn=SVC_URN, type=rules.SERVICE, props={
        "metadata": metadata, "spec": {"type": type_, "selector": selector, **spec}})


def ingress(*backends: str, namespace: str = NAMESPACE, default: str | None = None) -> StackResource:
    spec: dict[str, Any] = {"rules": [{"host": "ray.example.com", "http": {"paths": [
        {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": b, "port": {"number": 8265}}}}
        for b in backends]}}]}
    if default:
        spec["defaultBackend"] = {"service": {"name": default, "port": {"number": 8265}}}
    return StackResource(urn=ING_URN, type=rules.INGRESS,
                         props={"metadata": {"name": "dashboard", "namespace": namespace}, "spec": spec})


def test_the_programs_ray_namespace_passes_every_rule():
    stack = ray_stack()
    assert rules.ray_exposure_violations(stack) == []
    assert rules.ray_network_policy_violations(stack) == []
    assert rules.ray_pod_security_violations(stack) == []


def test_the_ray_pods_labels_are_the_templates_and_kuberays():
    pods = rules.ray_pods_of(ray_stack())
    assert [(p.namespace, p.role) for p in pods] == [(NAMESPACE, "head"), (NAMESPACE, "worker group gpu")]
    head, worker = (p.labels for p in pods)
    assert head == {**RAY_POD_LABELS, "ray.io/is-ray-node": "yes", "ray.io/cluster": "ray-train",
                    "ray.io/node-type": "head", "ray.io/group": "headgroup", "ray.io/identifier": "ray-train-head",
                    "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
    assert worker["ray.io/node-type"] == "worker" and worker["ray.io/group"] == "gpu"
    # A template cannot move a pod out of its cluster, group or role: KubeRay keeps those three.
    manifest = build_raycluster(CFG)
    manifest["spec"]["headGroupSpec"]["template"]["metadata"]["labels"].update(
        {"ray.io/cluster": "other", "app.kubernetes.io/name": "ray-head"})
    (head, _) = rules.ray_pods_of([StackResource(urn=RC_URN, type=rules.RAY_CLUSTER, props=manifest)])
    assert head.labels["ray.io/cluster"] == "ray-train" and head.labels["app.kubernetes.io/name"] == "ray-head"


# --- Services and Ingresses in front of the Ray pods ----------------------------------------------

@pytest.mark.parametrize(("svc", "expected"), [
    # By the label the program gives every Ray pod, whatever the Service is called.
    (service(dict(RAY_POD_LABELS)), "type 'LoadBalancer'"),
    (service(dict(RAY_POD_LABELS), type_="NodePort"), "type 'NodePort'"),
    (service(dict(RAY_POD_LABELS), type_="ClusterIP", externalIPs=["203.0.113.10"]), "externalIPs"),
    # The engine omits the namespace of a Service the provider puts in its default: never the Ray one.
    (service(dict(RAY_POD_LABELS), namespace=None), None),
    (service(dict(RAY_POD_LABELS), namespace="monitoring"), None),
    (service(dict(RAY_POD_LABELS), type_="ClusterIP"), None),
    (service({**RAY_POD_LABELS, "tier": "web"}), None),  # a label no Ray pod carries
    (service({}), None),  # no selector: endpoints by hand, no pod selected
    (service(dict(RAY_POD_LABELS), namespace=UNKNOWN), None),  # judged once known
    (service(UNKNOWN), None),
])
def test_a_service_that_selects_ray_pods_by_any_label_stays_inside_the_cluster(svc, expected):
    violations = rules.ray_exposure_violations([*ray_stack(), svc])
    if expected is None:
        assert violations == []
        return
    (violation,) = violations
    assert violation.urn == SVC_URN
    assert expected in violation.message and "selects the Ray pods" in violation.message


def test_a_service_the_resource_rule_already_refuses_is_not_reported_twice():
    for svc in (service({"ray.io/node-type": "head", "ray.io/cluster": "ray-train"}),
                service({"app.kubernetes.io/name": "kuberay"})):
        assert len(rules.service_exposure_violations(svc.props)) == 1
        assert rules.ray_exposure_violations([*ray_stack(), svc]) == []
    external = service({"ray.io/node-type": "head"}, type_="ClusterIP", externalIPs=["203.0.113.10"])
    (message,) = rules.service_exposure_violations(external.props)
    assert "externalIPs" in message


@pytest.mark.parametrize(("extra", "expected"), [
    ([ingress(head_service_name())], "KubeRay's head service ray-train-head-svc"),
    ([ingress("web", default=head_service_name())], "KubeRay's head service ray-train-head-svc"),
    ([service(dict(RAY_POD_LABELS), type_="ClusterIP"), ingress("dashboard")], "Service dashboard, which selects"),
    ([ingress("web")], None),
    ([ingress(head_service_name(), namespace="default")], None),
    ([service({"app": "web"}, type_="ClusterIP"), ingress("dashboard")], None),
])
def test_an_ingress_that_routes_to_the_ray_pods_is_refused(extra, expected):
    violations = rules.ray_exposure_violations([*ray_stack(), *extra])
    if expected is None:
        assert violations == []
        return
    (violation,) = violations
    assert violation.urn == ING_URN and expected in violation.message


def test_a_head_service_renamed_in_the_raycluster_is_followed():
    stack = ray_stack()
    manifest = copy.deepcopy(dict(stack[0].props))
    manifest["spec"]["headGroupSpec"]["headService"] = {"metadata": {"name": "ray-api"}}
    renamed = [StackResource(urn=RC_URN, type=rules.RAY_CLUSTER, props=manifest), *stack[1:]]
    (violation,) = rules.ray_exposure_violations([*renamed, ingress("ray-api")])
    assert "KubeRay's head service ray-api" in violation.message
    assert rules.ray_exposure_violations([*renamed, ingress(head_service_name())]) == []


# --- The NetworkPolicy of the Ray namespace -------------------------------------------------------

def _policy(**spec: Any) -> dict[str, Any]:
    policy = ray_network_policy(namespace=NAMESPACE, ray_pod_labels=RAY_POD_LABELS)
    policy["spec"].update(spec)
    return policy


def test_without_a_network_policy_every_pod_of_the_cluster_reaches_the_ray_pods():
    violations = rules.ray_network_policy_violations(ray_stack(with_policy=False))
    assert [(v.urn, v.message.split(":")[0]) for v in violations] == [
        (RC_URN, "the Ray head pods are selected by no NetworkPolicy with Ingress rules"),
        (RC_URN, "the Ray worker group gpu pods are selected by no NetworkPolicy with Ingress rules")]


@pytest.mark.parametrize(("policy", "expected"), [
    (_policy(podSelector={"matchLabels": {"ray.io/node-type": "head"}}),
     [(RC_URN, "the Ray worker group gpu pods are selected by no NetworkPolicy")]),
    (_policy(policyTypes=["Egress"]), [(RC_URN, "the Ray head pods"), (RC_URN, "the Ray worker group gpu pods")]),
    (_policy(podSelector={"matchExpressions": [{"key": "ray.io/node-type", "operator": "NotIn",
                                                "values": ["worker"]}]}),
     [(RC_URN, "the Ray worker group gpu pods are selected by no NetworkPolicy")]),
    (_policy(ingress=[{}]), [(NP_URN, "ingress rule 0 admits every source")]),
    (_policy(ingress=[{"from": []}]), [(NP_URN, "ingress rule 0 admits every source")]),
    (_policy(ingress=[{"from": [{"podSelector": {"matchLabels": RAY_POD_LABELS}}]},
                      {"from": [{"namespaceSelector": {}}]}]),
     [(NP_URN, "ingress rule 1 admits every pod of every namespace")]),
    (_policy(ingress=[{"from": [{"namespaceSelector": {}, "podSelector": {}}]}]),
     [(NP_URN, "ingress rule 0 admits every pod of every namespace")]),
    (_policy(ingress=[{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]),
     [(NP_URN, "ingress rule 0 admits 0.0.0.0/0")]),
    (_policy(ingress=[{"from": [{"ipBlock": {"cidr": "0.0.0.0/1"}}, {"ipBlock": {"cidr": "128.0.0.0/1"}}]}]),
     [(NP_URN, "ingress rule 0 admits 0.0.0.0/1, 128.0.0.0/1")]),
])
def test_a_network_policy_that_leaves_the_ray_pods_open_is_refused(policy, expected):
    violations = rules.ray_network_policy_violations(ray_stack(policy=policy))
    assert [(v.urn, v.message[:len(prefix)]) for v, (_, prefix) in zip(violations, expected)] == expected
    assert len(violations) == len(expected)


@pytest.mark.parametrize("policy", [
    _policy(podSelector={}),  # every pod of the namespace, the Ray pods among them
    _policy(policyTypes=None),  # Kubernetes takes Ingress when policyTypes is unset
    _policy(podSelector={"matchExpressions": [{"key": "ray.io/is-ray-node", "operator": "Exists"}]}),
    _policy(ingress=[{"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]}]),
    _policy(ingress=[{"from": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["0.0.0.0/1", "128.0.0.0/1"]}}]}]),
    _policy(ingress=[]),  # deny all
    _policy(ingress=UNKNOWN),
])
def test_network_policies_that_keep_the_ray_pods_guarded_pass(policy):
    if policy["spec"].get("policyTypes", ()) is None:
        del policy["spec"]["policyTypes"]
    assert rules.ray_network_policy_violations(ray_stack(policy=policy)) == []


def test_a_second_policy_that_opens_the_ray_pods_is_refused_beside_a_guarding_one():
    """NetworkPolicies add up: one that admits everyone opens the pods whatever the others say."""
    opened = _policy(ingress=[{}])
    opened["metadata"] = {"name": "allow-all", "namespace": NAMESPACE}
    extra = StackResource(urn=NP_URN + "-allow-all", type=rules.NETWORK_POLICY,
                          props={"metadata": opened["metadata"], "spec": opened["spec"]})
    (violation,) = rules.ray_network_policy_violations([*ray_stack(), extra])
    assert violation.urn == NP_URN + "-allow-all"
    elsewhere = copy.deepcopy(dict(extra.props))
    elsewhere["metadata"]["namespace"] = "default"
    assert rules.ray_network_policy_violations(
        [*ray_stack(), StackResource(urn=extra.urn, type=extra.type, props=elsewhere)]) == []


@pytest.mark.parametrize(("selector", "labels", "selected"), [
    ({}, {"a": "1"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": "1"}, False),
    ({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"}, False),
])
def test_label_selectors_read_as_kubernetes_reads_them(selector, labels, selected):
    assert rules.label_selector_matches(selector, labels) is selected


# --- Pod Security labels of the Ray namespace ------------------------------------------------------

@pytest.mark.parametrize(("labels", "expected"), [
    ({}, "enforces no Pod Security Standard"),
    ({"pod-security.kubernetes.io/enforce": "privileged"}, "enforces 'privileged'"),
    ({"pod-security.kubernetes.io/warn": "restricted"}, "enforces no Pod Security Standard"),
    ({"pod-security.kubernetes.io/enforce": "restricted"}, None),
    ({"pod-security.kubernetes.io/enforce": "baseline"}, None),  # unset version: the cluster's own (latest)
    ({"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "latest"}, None),
    (UNKNOWN, None),
])
def test_the_ray_namespace_enforces_the_baseline_standard_at_least(labels, expected):
    violations = rules.ray_pod_security_violations(ray_stack(namespace_labels=labels))
    if expected is None:
        assert violations == []
        return
    (violation,) = violations
    assert violation.urn == NS_URN and expected in violation.message


def test_a_ray_namespace_the_stack_does_not_declare_cannot_be_checked():
    (violation,) = rules.ray_pod_security_violations(ray_stack(with_namespace=False))
    assert violation.urn == RC_URN
    assert f"namespace {NAMESPACE} is not declared by this stack" in violation.message
