"""The policy pack's rules (policy/rules/) on compliant resources and on each violation.

Compliant shapes are what the program declares: the RayCluster from infra.raycluster's builder for
the committed stack, the Helm releases from infra.helm_values, node labels and taints from
infra.nodes, and the node group, launch template and placement group pulumi-eks's
ManagedNodeGroup creates with `enableEfaSupport` (nodejs/eks/nodes/nodegroup.ts).
"""

from __future__ import annotations

import copy
import json
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "policy"))

import rules  # noqa: E402  (policy/ is the pack's own import root, as under `pulumi preview`)
from rules import UNKNOWN, StackResource  # noqa: E402

from infra.config import load_stack_config  # noqa: E402
from infra.helm_values import chart_values, chart_versions  # noqa: E402
from infra.imds import METADATA_OPTIONS  # noqa: E402
from infra.nodes import (EKS_TAINT_EFFECTS, GPU_AMI_TYPE, GPU_NODE_LABELS, GPU_TAINT_EFFECT,  # noqa: E402
                         GPU_TAINT_KEY, GPU_TAINT_VALUE, SYSTEM_AMI_TYPE, SYSTEM_NODE_LABELS)
from infra.raycluster import build_raycluster  # noqa: E402

DLC_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
NG_URN = "urn:pulumi:us-west-2::ray-eks::eks:index:ManagedNodeGroup$aws:eks/nodeGroup:NodeGroup::gpu-nodes"
LT_URN = ("urn:pulumi:us-west-2::ray-eks::eks:index:ManagedNodeGroup"
          "$aws:ec2/launchTemplate:LaunchTemplate::gpu-nodes-launchTemplate")
PG_URN = "urn:pulumi:us-west-2::ray-eks::eks:index:ManagedNodeGroup$aws:ec2/placementGroup:PlacementGroup::gpu-nodes"
BUCKET_URN = "urn:pulumi:us-west-2::ray-eks::ray-eks:infra:CheckpointStorage$aws:s3/bucket:Bucket::ckpt-bucket"
PAB_URN = ("urn:pulumi:us-west-2::ray-eks::ray-eks:infra:CheckpointStorage"
           "$aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock::ckpt-public-access-block")
SSE_URN = ("urn:pulumi:us-west-2::ray-eks::ray-eks:infra:CheckpointStorage$aws:s3/"
           "bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration::ckpt-sse")


def raycluster() -> dict[str, Any]:
    """The RayCluster the committed us-west-2 stack applies."""
    return build_raycluster(load_stack_config("us-west-2", REPO_ROOT))


def helm_releases() -> dict[str, dict[str, Any]]:
    """Each add-on's Helm Release inputs as the program declares them."""
    cfg = load_stack_config("us-west-2", REPO_ROOT)
    versions, values = chart_versions(cfg), chart_values(cfg, cluster_name="ray-eks-us-west-2")
    return {chart: {"chart": chart, "version": versions[chart], "values": values[chart]}
            for chart in versions}


def gpu_node_group() -> dict[str, Any]:
    """The aws:eks/nodeGroup:NodeGroup inputs ManagedNodeGroup declares during preview."""
    return {
        "amiType": GPU_AMI_TYPE,
        "capacityType": "ON_DEMAND",
        "instanceTypes": ["g6.12xlarge"],
        "labels": dict(GPU_NODE_LABELS),
        "taints": [{"key": GPU_TAINT_KEY, "value": GPU_TAINT_VALUE,
                    "effect": EKS_TAINT_EFFECTS[GPU_TAINT_EFFECT]}],
        "scalingConfig": {"desiredSize": 2, "minSize": 2, "maxSize": 2},
        "subnetIds": [UNKNOWN],
        "nodeRoleArn": UNKNOWN,
        "launchTemplate": {"id": UNKNOWN, "version": UNKNOWN},
    }


def system_node_group() -> dict[str, Any]:
    return {"amiType": SYSTEM_AMI_TYPE, "instanceTypes": ["m7i.xlarge"],
            "labels": dict(SYSTEM_NODE_LABELS), "scalingConfig": {"desiredSize": 1}}


def efa_launch_template() -> dict[str, Any]:
    """The launch template pulumi-eks builds for one g6.12xlarge EFA interface, with the metadata
    options the program's transform gives it (infra/imds.py)."""
    return {
        "metadataOptions": dict(METADATA_OPTIONS),
        "networkInterfaces": [{"deviceIndex": 0, "networkCardIndex": 0, "interfaceType": "efa",
                               "associatePublicIpAddress": "false",
                               "deleteOnTermination": "true", "securityGroups": [UNKNOWN]}],
        "placement": {"groupName": UNKNOWN},
        "blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"volumeSize": 200}}],
    }


def gpu_stack(*, node_group: dict | None = None, template: dict | None = None,
              placement: dict | None = None) -> list[StackResource]:
    """The three resources behind the GPU ManagedNodeGroup, linked as the engine links them."""
    return [
        StackResource(urn=NG_URN, type=rules.NODE_GROUP, props=node_group or gpu_node_group(),
                      dependencies=(LT_URN,), property_dependencies={"launchTemplate": (LT_URN,)}),
        StackResource(urn=LT_URN, type=rules.LAUNCH_TEMPLATE,
                      props=template or efa_launch_template(), dependencies=(PG_URN,),
                      property_dependencies={"placement": (PG_URN,)}),
        StackResource(urn=PG_URN, type=rules.PLACEMENT_GROUP,
                      props=placement or {"strategy": "cluster", "name": "gpu-nodes-4f2a"}),
    ]


TLS_URN = ("urn:pulumi:us-west-2::ray-eks::ray-eks:infra:CheckpointStorage$aws:s3/"
           "bucketPolicy:BucketPolicy::ckpt-tls-only")


def bucket_stack(*, with_block: bool = True, with_sse: bool = True, with_tls: bool = True) -> list[StackResource]:
    """The checkpoint bucket and its companions as infra/storage.py declares them."""
    from infra.storage import secure_transport_policy

    linked = {"bucket": (BUCKET_URN,)}
    out = [StackResource(urn=BUCKET_URN, type=rules.BUCKETS[0],
                         props={"bucketPrefix": "ray-checkpoints-", "forceDestroy": False})]
    if with_block:
        out.append(StackResource(urn=PAB_URN, type=rules.PUBLIC_ACCESS_BLOCK,
                                 props={"bucket": UNKNOWN, **{f: True for f in
                                                               rules.PUBLIC_ACCESS_FLAGS}},
                                 property_dependencies=linked))
    if with_sse:
        out.append(StackResource(urn=SSE_URN, type=rules.ENCRYPTION_CONFIGS[0],
                                 props={"bucket": UNKNOWN, "rules": [{
                                     "applyServerSideEncryptionByDefault":
                                         {"sseAlgorithm": "aws:kms"},
                                     "bucketKeyEnabled": True}]},
                                 property_dependencies=linked))
    if with_tls:
        policy = json.dumps(secure_transport_policy(bucket_arn="arn:aws:s3:::ray-checkpoints-1a2b"))
        out.append(StackResource(urn=TLS_URN, type=rules.BUCKET_POLICY, props={"bucket": UNKNOWN, "policy": policy},
                                 property_dependencies=linked))
    return out


def _worker(rc: dict[str, Any]) -> dict[str, Any]:
    return rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


# --- GPU node groups -------------------------------------------------------------------------

def test_gpu_node_group_compliant_and_system_group_ignored():
    assert rules.gpu_node_group_violations(gpu_node_group()) == []
    assert not rules.is_gpu_node_group(system_node_group())
    assert rules.gpu_node_group_violations(system_node_group()) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda ng: ng["labels"].pop("nvidia.com/gpu.present"), "nvidia.com/gpu.present=true"),
    (lambda ng: ng["labels"].update({"nvidia.com/gpu.present": "false"}), "has 'false'"),
    (lambda ng: ng.update(taints=[]), "no nvidia.com/gpu taint"),
    (lambda ng: ng.pop("launchTemplate"), "no launch template"),
])
def test_gpu_node_group_violations(mutate, expected):
    ng = gpu_node_group()
    mutate(ng)
    (message,) = rules.gpu_node_group_violations(ng)
    assert expected in message


def test_gpu_group_recognised_by_instance_type_alone():
    ng = {**gpu_node_group(), "amiType": UNKNOWN, "labels": {}}
    assert rules.is_gpu_node_group(ng)
    assert any("nvidia.com/gpu.present" in m for m in rules.gpu_node_group_violations(ng))


def test_gpu_node_group_efa_compliant():
    assert rules.gpu_node_group_efa_violations(gpu_stack()) == []


def multi_card_launch_template() -> dict[str, Any]:
    """AWS's layout for an instance with several network cards (a p5.48xlarge has 32): an ENA
    primary interface, an efa-only interface beside it on card 0, efa-only on every other card."""
    interfaces = [{"deviceIndex": 0, "networkCardIndex": 0, "interfaceType": "interface"},
                  {"deviceIndex": 1, "networkCardIndex": 0, "interfaceType": "efa-only"}]
    interfaces += [{"deviceIndex": 0, "networkCardIndex": card, "interfaceType": "efa-only"}
                   for card in range(1, 32)]
    return {**efa_launch_template(), "networkInterfaces": interfaces}


def test_an_ena_primary_beside_efa_only_interfaces_is_compliant():
    assert rules.gpu_node_group_efa_violations(gpu_stack(template=multi_card_launch_template())) \
        == []


@pytest.mark.parametrize("template, placement, urn, expected", [
    ({**efa_launch_template(), "networkInterfaces": None}, None, LT_URN, "no EFA network interface"),
    ({**efa_launch_template(), "networkInterfaces": [
        {"deviceIndex": 0, "networkCardIndex": 0, "interfaceType": "interface"}]},
     None, LT_URN, "no EFA network interface"),
    ({**efa_launch_template(), "networkInterfaces": [
        {"deviceIndex": 0, "networkCardIndex": 0, "interfaceType": "efa-only"}]},
     None, LT_URN, "primary network interface"),
    ({**efa_launch_template(), "networkInterfaces": [
        {"deviceIndex": 0, "networkCardIndex": 0, "interfaceType": "efa-only"},
        {"deviceIndex": 1, "networkCardIndex": 0, "interfaceType": "interface"}]},
     None, LT_URN, "not 'efa-only'"),
    ({**efa_launch_template(), "placement": None}, None, LT_URN, "no placement group"),
    (None, {"strategy": "spread", "name": "pg"}, LT_URN, "not 'cluster'"),
])
def test_gpu_node_group_efa_violations(template, placement, urn, expected):
    (violation,) = rules.gpu_node_group_efa_violations(
        gpu_stack(template=template, placement=placement))
    assert violation.urn == urn and expected in violation.message


def test_gpu_node_group_with_template_outside_the_stack():
    stack = [r for r in gpu_stack() if r.type != rules.LAUNCH_TEMPLATE]
    (violation,) = rules.gpu_node_group_efa_violations(stack)
    assert violation.urn == NG_URN and "not part of this stack" in violation.message


def test_launch_template_found_by_known_id_without_property_dependencies():
    ng, lt, pg = gpu_stack()
    ng = StackResource(urn=ng.urn, type=ng.type,
                       props={**ng.props, "launchTemplate": {"id": "lt-0abc", "version": "1"}})
    bad = StackResource(urn=lt.urn, type=lt.type,
                        props={**lt.props, "id": "lt-0abc", "networkInterfaces": []})
    (violation,) = rules.gpu_node_group_efa_violations([ng, bad, pg])
    assert violation.urn == LT_URN


def test_launch_template_found_through_dependencies_alone():
    ng, lt, pg = gpu_stack(placement={"strategy": "spread", "name": "pg"})
    ng = StackResource(urn=ng.urn, type=ng.type, props=ng.props, dependencies=(LT_URN,))
    lt = StackResource(urn=lt.urn, type=lt.type, props=lt.props, dependencies=(PG_URN,))
    (violation,) = rules.gpu_node_group_efa_violations([ng, lt, pg])
    assert "'spread'" in violation.message


# --- Instance metadata out of the pods' reach --------------------------------------------------

def test_the_programs_launch_templates_keep_the_node_role_from_the_pods():
    assert rules.instance_metadata_violations(efa_launch_template()) == []
    assert rules.instance_metadata_violations({"metadataOptions": {"httpEndpoint": "disabled"}}) == []
    assert rules.instance_metadata_violations({"metadataOptions": UNKNOWN}) == []


@pytest.mark.parametrize(("options", "expected"), [
    (None, ["sets no instance metadata options"]),
    ({**METADATA_OPTIONS, "httpTokens": "optional"}, ["does not require IMDSv2 tokens (httpTokens 'optional')"]),
    ({**METADATA_OPTIONS, "httpPutResponseHopLimit": 2}, ["tokens travel 2 network hops"]),
    # What pulumi-eks's own enableIMDSv2 sets, before the program's transform: pods one hop away get in.
    ({"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 2.0},
     ["tokens travel 2 network hops"]),
    ({"httpEndpoint": "enabled"}, ["httpTokens None", "travel as far as the AMI's default"]),
    ({**METADATA_OPTIONS, "httpPutResponseHopLimit": UNKNOWN}, []),
])
def test_a_launch_template_that_lets_pods_reach_the_instance_metadata_is_refused(options, expected):
    template = {**efa_launch_template(), "metadataOptions": options}
    if options is None:
        del template["metadataOptions"]
    messages = rules.instance_metadata_violations(template)
    assert len(messages) == len(expected)
    for message, part in zip(messages, expected):
        assert part in message and "httpPutResponseHopLimit: 1" in message


def test_every_node_group_launches_from_a_template_of_this_stack():
    assert rules.node_group_launch_template_violations(gpu_stack()) == []
    system = StackResource(urn=NG_URN.replace("gpu-nodes", "system-nodes"), type=rules.NODE_GROUP,
                           props=system_node_group())
    (violation,) = rules.node_group_launch_template_violations([*gpu_stack(), system])
    assert violation.urn == system.urn and "has no launch template" in violation.message
    outside = [r for r in gpu_stack() if r.type != rules.LAUNCH_TEMPLATE]
    (violation,) = rules.node_group_launch_template_violations(outside)
    assert violation.urn == NG_URN and "not part of this stack" in violation.message


# --- Ray workers and exposure ----------------------------------------------------------------

def test_program_raycluster_is_compliant():
    rc = raycluster()
    assert rules.ray_worker_violations(rc) == []
    assert rules.ray_head_exposure_violations(rc) == []
    assert rules.workload_image_violations(rules.RAY_CLUSTER, rc) == []
    assert Decimal(_worker(rc)["resources"]["requests"][rules.EFA_RESOURCE]) >= 1


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c["resources"]["limits"].update(memory="1Ti"), "request"),
    (lambda c: c["resources"]["limits"].pop("cpu"), "cpu is missing from limits"),
    (lambda c: c.pop("resources"), "sets no resource requests and limits"),
    (lambda c: [c["resources"][side].pop(rules.EFA_RESOURCE) for side in ("requests", "limits")],
     "requests no vpc.amazonaws.com/efa"),
    (lambda c: c["resources"]["requests"].update(cpu="lots"), "not a Kubernetes quantity"),
])
def test_ray_worker_violations(mutate, expected):
    rc = raycluster()
    mutate(_worker(rc))
    messages = rules.ray_worker_violations(rc)
    assert any(expected in m for m in messages), messages
    assert all(m.startswith("worker group gpu") for m in messages)


def test_ray_worker_sidecar_must_be_guaranteed_too():
    rc = raycluster()
    pod = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    pod["containers"].append({"name": "log-shipper", "image": "fluent/fluent-bit:3.2.4",
                              "resources": {"requests": {"cpu": "100m"}}})
    (message,) = rules.ray_worker_violations(rc)
    assert "container log-shipper" in message


def test_equal_quantities_in_other_spellings_are_equal():
    rc = raycluster()
    res = _worker(rc)["resources"]
    res["limits"]["memory"] = f"{int(res['requests']['memory'][:-2]) * 1024}Mi"
    res["limits"]["cpu"] = f"{int(res['requests']['cpu']) * 1000}m"
    assert rules.ray_worker_violations(rc) == []


def test_raycluster_without_workers():
    rc = raycluster()
    rc["spec"]["workerGroupSpecs"] = []
    assert rules.ray_worker_violations(rc) == ["RayCluster has no worker group"]


@pytest.mark.parametrize("mutate", [
    lambda head: head.update(serviceType="LoadBalancer"),
    lambda head: head.update(serviceType="NodePort"),
    lambda head: head.update(headService={"spec": {"type": "LoadBalancer"}}),
    lambda head: head.update(enableIngress=True),
])
def test_ray_head_exposure_violations(mutate):
    rc = raycluster()
    mutate(rc["spec"]["headGroupSpec"])
    assert len(rules.ray_head_exposure_violations(rc)) == 1


def test_service_in_front_of_ray():
    service = {"spec": {"type": "LoadBalancer", "selector": {"ray.io/cluster": "ray-train",
                                                             "ray.io/node-type": "head"}}}
    (message,) = rules.service_exposure_violations(service)
    assert "'LoadBalancer'" in message
    service["spec"]["type"] = "ClusterIP"
    assert rules.service_exposure_violations(service) == []
    other = {"spec": {"type": "LoadBalancer", "selector": {"app": "grafana"}}}
    assert rules.service_exposure_violations(other) == []


# --- Pinned images and charts ----------------------------------------------------------------

@pytest.mark.parametrize("image", [
    DLC_IMAGE, "rayproject/ray:2.58.0-py311-cu128", "nvcr.io/nvidia/k8s-device-plugin:v0.17.1",
    "registry.local:5000/ray:v1.1", "ray@sha256:" + "a" * 64,
])
def test_pinned_images(image):
    assert rules.image_pin_violation(image) is None


@pytest.mark.parametrize("image, expected", [
    ("rayproject/ray:latest", "names no release"),
    ("rayproject/ray", "has no tag"),
    ("registry.local:5000/ray", "has no tag"),
    ("rayproject/ray:nightly-gpu", "names no release"),
    ("", "not an image reference"),
])
def test_unpinned_images(image, expected):
    assert expected in rules.image_pin_violation(image)


def test_unpinned_image_in_raycluster_and_deployment():
    rc = raycluster()
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = "rayproject/ray"
    (message,) = rules.workload_image_violations(rules.RAY_CLUSTER, rc)
    assert message.startswith("head, container ray-head")
    deployment = {"spec": {"template": {"spec": {
        "initContainers": [{"name": "init", "image": "busybox:1.36"}],
        "containers": [{"name": "app", "image": "nginx:latest"}]}}}}
    (message,) = rules.workload_image_violations("kubernetes:apps/v1:Deployment", deployment)
    assert "container app" in message


def test_images_pinned_by_tag_only_are_flagged_for_their_digest():
    rc = raycluster()  # the committed stack: the DLC image by its version tag
    messages = rules.digest_pin_violations(rules.RAY_CLUSTER, rc)
    assert [m.split(":")[0] for m in messages] == ["head, container ray-head", "worker group gpu, container ray-worker"]
    assert all(f"image {DLC_IMAGE} is pinned by tag only" in m and "python -m infra lock-images" in m
               for m in messages)
    for template in (rc["spec"]["headGroupSpec"]["template"], rc["spec"]["workerGroupSpecs"][0]["template"]):
        template["spec"]["containers"][0]["image"] = f"{DLC_IMAGE}@sha256:{'a' * 64}"
    assert rules.digest_pin_violations(rules.RAY_CLUSTER, rc) == []
    _worker(rc)["image"] = UNKNOWN
    assert rules.digest_pin_violations(rules.RAY_CLUSTER, rc) == []
    job = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]}}}}
    (message,) = rules.digest_pin_violations("kubernetes:batch/v1:Job", job)
    assert message.startswith("pod, container c: image busybox:1.36 is pinned by tag only")


def test_program_helm_releases_are_compliant():
    for release in helm_releases().values():
        assert rules.helm_violations(release) == []


@pytest.mark.parametrize("version", [None, "", "1.7", "^1.7.0", "~1.7.0", ">=1.7.0", "1.x", "*"])
def test_helm_release_without_exact_version(version):
    release = helm_releases()["kuberay-operator"]
    release["version"] = version
    (message,) = rules.helm_violations(release)
    assert "not an exact version" in message


def test_helm_values_with_floating_image_tag():
    release = helm_releases()["aws-efa-k8s-device-plugin"]
    release["values"]["image"]["tag"] = "latest"
    (message,) = rules.helm_violations(release)
    assert message.startswith("values.image.tag:")
    release["values"]["image"]["tag"] = "v0.5.20"
    assert rules.helm_violations(release) == []


# --- Checkpoint bucket -----------------------------------------------------------------------

def test_bucket_with_block_and_encryption_is_compliant():
    assert rules.bucket_violations(bucket_stack()) == []
    _, block, sse, _ = bucket_stack()
    assert rules.public_access_block_violations(block.props) == []
    assert rules.encryption_config_violations(sse.props) == []


@pytest.mark.parametrize("with_block, with_sse, with_tls, expected", [
    (False, True, True, "no BucketPublicAccessBlock"),
    (True, False, True, "no BucketServerSideEncryptionConfiguration"),
    (True, True, False, "no BucketPolicy that denies requests without TLS"),
])
def test_bucket_missing_companion(with_block, with_sse, with_tls, expected):
    (violation,) = rules.bucket_violations(bucket_stack(with_block=with_block, with_sse=with_sse, with_tls=with_tls))
    assert violation.urn == BUCKET_URN and expected in violation.message


def test_block_of_another_bucket_does_not_count():
    bucket, block, sse, tls = bucket_stack()
    other = StackResource(urn=block.urn, type=block.type, props=block.props,
                          property_dependencies={"bucket": ("urn:other-bucket",)})
    (violation,) = rules.bucket_violations([bucket, other, sse, tls])
    assert "no BucketPublicAccessBlock" in violation.message


def test_block_matched_by_known_bucket_name():
    bucket, block, sse, tls = bucket_stack()
    named = StackResource(urn=bucket.urn, type=bucket.type,
                          props={**bucket.props, "bucket": "ray-checkpoints-1a2b"})
    by_name = StackResource(urn=block.urn, type=block.type,
                            props={**block.props, "bucket": "ray-checkpoints-1a2b"})
    assert rules.bucket_violations([named, by_name, sse, tls]) == []


@pytest.mark.parametrize("change", [
    lambda s: s.update(Effect="Allow"),
    lambda s: s.update(Resource=s["Resource"][:1]),  # the bucket only, not its objects
    lambda s: s["Condition"]["Bool"].update({"aws:SecureTransport": "true"}),
    lambda s: s.update(Action="s3:GetObject"),
])
def test_a_bucket_policy_that_leaves_plain_http_open_does_not_count(change):
    bucket, block, sse, tls = bucket_stack()
    document = json.loads(tls.props["policy"])
    change(document["Statement"][0])
    weakened = StackResource(urn=tls.urn, type=tls.type, props={**tls.props, "policy": json.dumps(document)},
                             property_dependencies=tls.property_dependencies)
    (violation,) = rules.bucket_violations([bucket, block, sse, weakened])
    assert "without TLS" in violation.message


@pytest.mark.parametrize("flag", rules.PUBLIC_ACCESS_FLAGS)
def test_public_access_block_flag_off(flag):
    props = {**bucket_stack()[1].props, flag: False}
    (message,) = rules.public_access_block_violations(props)
    assert flag in message


@pytest.mark.parametrize("rules_value, expected", [
    ([], "has no rule"),
    ([{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "none"}}], "'none'"),
])
def test_encryption_config_violations(rules_value, expected):
    (message,) = rules.encryption_config_violations({"bucket": "b", "rules": rules_value})
    assert expected in message


# --- Values not known during preview ---------------------------------------------------------

def test_unknown_values_are_not_judged():
    rc = raycluster()
    _worker(rc)["image"] = UNKNOWN
    _worker(rc)["resources"]["limits"]["memory"] = UNKNOWN
    assert rules.workload_image_violations(rules.RAY_CLUSTER, rc) == []
    assert rules.ray_worker_violations(rc) == []
    assert rules.helm_violations({"chart": "x", "version": UNKNOWN}) == []
    assert rules.public_access_block_violations(
        {f: UNKNOWN for f in rules.PUBLIC_ACCESS_FLAGS}) == []
    unknown_pg = copy.deepcopy(gpu_stack(placement={"strategy": UNKNOWN}))
    assert rules.gpu_node_group_efa_violations(unknown_pg) == []


@pytest.mark.parametrize("text, value", [
    ("4", 4), (4, 4), ("500m", Decimal("0.5")), ("180Gi", 180 * 2**30), ("1e3", 1000),
    ("2k", 2000), (2.0, 2),
])
def test_parse_quantity(text, value):
    assert rules.parse_quantity(text) == value


# --- EKS API endpoint ------------------------------------------------------------------------

def eks_cluster(cidrs: Any, public: Any = True, tags: Any = None) -> dict[str, Any]:
    """The aws:eks/cluster:Cluster pulumi-eks's Cluster creates (its vpcConfig and tags)."""
    cluster = {"name": "ray-eks-us-west-2", "version": "1.34",
               "vpcConfig": {"endpointPublicAccess": public, "endpointPrivateAccess": True,
                             "publicAccessCidrs": cidrs, "subnetIds": [UNKNOWN]}}
    if tags is not None:
        cluster["tags"] = tags
    return cluster


@pytest.mark.parametrize(("cidrs", "public", "tags", "refused"), [
    (["0.0.0.0/0"], True, None, "0.0.0.0/0"),
    (["203.0.113.7/32", "0.0.0.0/0"], True, {"team": "ml"}, "0.0.0.0/0"),
    (None, True, None, "0.0.0.0/0 (the default)"),
    (["0.0.0.0/0"], True, {rules.OPEN_TO_INTERNET_TAG: "false"}, "0.0.0.0/0"),
    (["0.0.0.0/0"], True, {rules.OPEN_TO_INTERNET_TAG: "true"}, None),  # the stack said so
    (["203.0.113.0/24"], True, None, None),
    (["0.0.0.0/0"], False, None, None),
    (UNKNOWN, True, None, None),
    # The internet in pieces: what counts is how many addresses the list opens, not how it is spelt.
    (["0.0.0.0/1", "128.0.0.0/1"], True, None,
     "0.0.0.0/1, 128.0.0.0/1 (4,294,967,296 IPv4 addresses, more than a /8's worth)"),
    (["0.0.0.0/1", "128.0.0.0/1"], True, {rules.OPEN_TO_INTERNET_TAG: "true"}, None),
    (["0.0.0.0/7"], True, None, "0.0.0.0/7 (33,554,432 IPv4 addresses"),
    (["11.0.0.0/8", "12.0.0.0/8"], True, None, "11.0.0.0/8, 12.0.0.0/8 (33,554,432 IPv4 addresses"),
    ([f"{i}.0.0.0/9" for i in range(1, 5)], True, None,
     "1.0.0.0/9, 2.0.0.0/9, 3.0.0.0/9, 4.0.0.0/9 (33,554,432 IPv4 addresses"),
    (["::/1", "8000::/1"], True, None, "::/1, 8000::/1 (2^128 IPv6 addresses, more than a /32's worth)"),
    (["2001:db8::/31"], True, None, "2001:db8::/31 (2^97 IPv6 addresses"),
    (["::/0"], True, None, "::/0 (2^128 IPv6 addresses"),
    (["203.0.113.7/32", "2000::/3"], True, None, "2000::/3 (2^125 IPv6 addresses"),
    # At most a /8's worth (IPv4) and a /32's worth (IPv6): one organisation's range.
    (["17.0.0.0/8"], True, None, None),
    (["10.0.0.0/8", "10.0.0.0/9", "10.128.0.0/9"], True, None, None),  # overlaps counted once
    (["2001:db8::/32", "2001:db8:1::/48"], True, None, None),
    (["17.0.0.0/8", "2001:db8::/32"], True, None, None),  # each family within its own limit
    (["203.0.113.7/32", UNKNOWN], True, None, None),
])
def test_an_api_endpoint_open_to_everyone_is_refused_unless_the_stack_says_so(cidrs, public, tags, refused):
    violations = rules.public_api_access_violations(eks_cluster(cidrs, public, tags))
    if refused is None:
        assert violations == []
    else:
        (violation,) = violations
        assert f"accepts connections from {refused}" in violation
        assert "anyone on the internet" in violation
        assert "ray-eks:apiAccessCidrs" in violation and "ray-eks:apiOpenToInternet: true" in violation


@pytest.mark.parametrize("cidrs", [
    ["0.0.0.0/1", "128.0.0.0/1"], ["17.0.0.0/8"], ["17.0.0.0/8", "18.0.0.0/24"], ["10.0.0.0/8", "10.0.0.0/9"],
    ["203.0.113.7/32"], [f"{i}.0.0.0/10" for i in range(1, 6)], ["::/1", "8000::/1"], ["2001:db8::/32"],
    ["2001:db8::/32", "2001:db9::/48"], ["203.0.113.7/32", "2001:db8::/31"],
])
def test_the_config_and_the_pack_count_the_addresses_a_list_opens_alike(cidrs):
    """Config validation and the pack (a program of its own, which cannot import infra) each count
    what a list of CIDRs opens; both must draw the line in the same place."""
    from infra.config.open_addresses import OPEN_ADDRESS_LIMITS, addresses_opened

    assert OPEN_ADDRESS_LIMITS == rules.OPEN_ADDRESS_LIMITS == {4: 2**24, 6: 2**96}
    assert addresses_opened(cidrs) == rules.addresses_opened(cidrs)

