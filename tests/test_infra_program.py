"""The Pulumi program under mocks, for every committed stack file and for a second region's stack
file written by the capacity probe's writer. Remote components (eks.Cluster,
eks.ManagedNodeGroup) show only their inputs under mocks, so those are what is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi.runtime import rpc

from capacity.stackfile import PLACEMENT_KEYS, plan_update, write
from infra import outputs
from infra.config import ConfigError, parse_stack_config, read_stack_values
from infra.helm_values import chart_values, chart_versions
from infra.images import unpinned_images
from infra.raycluster import build_raycluster
from infra.sizing import EFA_RESOURCE, GPU_RESOURCE
from infra.program_mocks import (  # noqa: F401  (the other infra tests import them from here)
    MANAGED_NODE_GROUP,
    NODE_GROUP,
    Declared,
    Mocks,
    ProgramRun,
    autoscaling_group_of,
    same_order_zones,
    zone_id_prefix,
)
from infra.program_mocks import run_program as run_program_under_mocks

_Mocks = Mocks


STAND_IN_DIGEST = "sha256:" + "5eed" * 16
"""The digest `python -m infra lock-images` would write (no registry is reached here)."""


def locked(config: dict[str, Any]) -> dict[str, Any]:
    """A stack file's config as `python -m infra lock-images` leaves it: each image of the stack pinned by
    a digest (STAND_IN_DIGEST), its tag kept. A config that allows unpinned images is left as it is, and
    so is one with a bad value, for the program to refuse."""
    try:
        cfg = parse_stack_config(config)
    except ConfigError:
        return dict(config)
    if cfg.allow_unpinned_images:
        return dict(config)
    return {**config, **{key: f"{image}@{STAND_IN_DIGEST}" for key, image in unpinned_images(cfg).items()}}


def run_program(*, repo_root: Path, stack: str, config: dict[str, Any], monkeypatch=None,
                zones: list[tuple[str, str]] | None = None, mocks: type[Mocks] = Mocks) -> ProgramRun:
    """infra/program_mocks.py's run of __main__.py as `pulumi up` runs it, on the stack's config once its
    images are locked (`pulumi up` deploys no other: tests/test_infra_images.py); `monkeypatch`: kept for
    the callers' sake."""
    return run_program_under_mocks(project_dir=repo_root, stack=stack, config=locked(config), zones=zones,
                                   mocks=mocks)


REPO_ROOT = Path(__file__).resolve().parent.parent
COMMITTED_STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")]
                          for p in REPO_ROOT.glob("Pulumi.*.yaml"))


def _second_region_stack(tmp_path: Path) -> Path:
    path = tmp_path / "Pulumi.eu-west-1.yaml"
    write(plan_update(path, dict(zip(PLACEMENT_KEYS, (
        "eu-west-1", "eu-west-1b", "euw1-az2", "g6.12xlarge", 2)))))
    return path


@pytest.fixture(scope="module", params=[*COMMITTED_STACKS, "eu-west-1 (written by the probe)"])
def program(request, tmp_path_factory) -> tuple[dict, ProgramRun]:
    if request.param in COMMITTED_STACKS:
        stack, path = request.param, REPO_ROOT / f"Pulumi.{request.param}.yaml"
    else:
        stack, path = "eu-west-1", _second_region_stack(tmp_path_factory.mktemp("stacks"))
    config = locked(read_stack_values(path))
    with pytest.MonkeyPatch.context() as mp:
        run = run_program(repo_root=REPO_ROOT, stack=stack, config=config, monkeypatch=mp)
    return config, run


def test_at_least_one_stack_is_committed():
    assert "us-west-2" in COMMITTED_STACKS


def test_every_output_is_exported_and_the_kubeconfig_is_secret(program):
    config, run = program
    cfg = parse_stack_config(config)
    assert set(run.outputs) == set(outputs.ALL)
    assert run.secret_outputs == set(outputs.SECRET)
    assert run.outputs[outputs.REGION] == cfg.region
    assert run.outputs[outputs.GPU_AVAILABILITY_ZONE] == cfg.gpu_availability_zone
    assert run.outputs[outputs.RAY_NAMESPACE] == cfg.ray_namespace
    assert run.outputs[outputs.RAY_HEAD_SERVICE] == f"{run.outputs[outputs.RAY_CLUSTER_NAME]}-head-svc"
    assert run.outputs[outputs.RAY_DASHBOARD_PORT] == 8265
    assert run.outputs[outputs.RAY_AUTH_SECRET_KEY] == "auth_token"
    assert run.outputs[outputs.RAY_AUTH_SECRET_NAME] == run.outputs[outputs.RAY_CLUSTER_NAME]
    assert run.outputs[outputs.CHECKPOINT_BUCKET_URI].startswith("s3://ray-checkpoints-")
    assert run.outputs[outputs.ESTIMATED_COST_PER_HOUR_USD] > 2 * cfg.gpu_instance.usd_per_hour
    assert run.outputs[outputs.GPU_INSTANCE_TYPE] == cfg.gpu_instance_type
    assert run.outputs[outputs.GPU_MEMORY_GIB] == cfg.gpu_instance.gpu_memory_gib > 0
    assert run.outputs[outputs.RAY_WORKER_GPUS] == cfg.gpu_node_count * cfg.gpu_instance.gpus > 0


def test_every_component_has_its_own_type(program):
    _, run = program
    components = {r.typ for r in run.resources if r.typ.startswith("ray-eks:infra:")}
    assert components == {f"ray-eks:infra:{n}" for n in (
        "Network", "EksCluster", "SystemNodeGroup", "GpuNodeGroup", "Addons",
        "CheckpointStorage", "RayClusterDeployment", "NodeHealth")}


def test_network_spans_two_azs_including_the_gpu_az_with_eks_tags(program):
    config, run = program
    cfg = parse_stack_config(config)
    subnets = run.of_type("aws:ec2/subnet:Subnet")
    private = [s for s in subnets if "kubernetes.io/role/internal-elb" in s.inputs["tags"]]
    public = [s for s in subnets if "kubernetes.io/role/elb" in s.inputs["tags"]]
    assert len({s.inputs["availabilityZone"] for s in private}) >= 2
    assert cfg.gpu_availability_zone in {s.inputs["availabilityZone"] for s in private}
    assert {s.inputs["availabilityZone"] for s in public} == {
        s.inputs["availabilityZone"] for s in private}
    cluster_tag = f"kubernetes.io/cluster/ray-eks-{cfg.region}"
    assert all(s.inputs["tags"][cluster_tag] == "shared" for s in subnets)
    assert not any(s.inputs.get("mapPublicIpOnLaunch") for s in subnets)
    assert len(run.of_type("aws:ec2/natGateway:NatGateway")) == 1


def test_cluster_is_pinned_api_authenticated_and_limited(program):
    config, run = program
    cfg = parse_stack_config(config)
    cluster = run.one("eks:index:Cluster").inputs
    assert cluster["version"] == cfg.kubernetes_version
    assert cluster["authenticationMode"] == "API"
    assert cluster["skipDefaultNodeGroup"] is True
    assert cluster["upgradePolicy"] == {"supportType": "STANDARD"}
    assert cluster["endpointPrivateAccess"] is True
    # Public only for the CIDRs the stack names: the committed stack names none, so its endpoint is
    # private (EKS's own default would be public to every address).
    assert cluster["endpointPublicAccess"] is bool(cfg.api_access_cidrs)
    assert cluster.get("publicAccessCidrs", []) == list(cfg.api_access_cidrs)
    assert "0.0.0.0/0" not in cluster.get("publicAccessCidrs", [])
    assert cluster["nodeAssociatePublicIpAddress"] is False
    assert len(cluster["accessEntries"]) == len(cfg.admin_principal_arns)


def test_gpu_node_group_is_efa_enabled_in_the_gpu_az(program):
    config, run = program
    cfg = parse_stack_config(config)
    gpu = run.of_type("eks:index:ManagedNodeGroup")
    gpu = next(g.inputs for g in gpu if g.inputs.get("enableEfaSupport"))
    n = cfg.gpu_node_count
    assert gpu["amiType"] == "AL2023_x86_64_NVIDIA"
    assert gpu["placementGroupAvailabilityZone"] == cfg.gpu_availability_zone
    assert gpu["instanceTypes"] == [cfg.gpu_instance_type]
    assert gpu["scalingConfig"] == {"desiredSize": n, "minSize": n, "maxSize": n}
    assert gpu["labels"]["nvidia.com/gpu.present"] == "true"
    assert gpu["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]
    assert gpu["diskSize"] == cfg.gpu_root_volume_gib
    gpu_subnet = next(s for s in run.of_type("aws:ec2/subnet:Subnet")
                      if s.inputs["availabilityZone"] == cfg.gpu_availability_zone
                      and "kubernetes.io/role/internal-elb" in s.inputs["tags"])
    assert gpu["subnetIds"] == [f"{gpu_subnet.name}-id"]


def _tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' rule: same key (or an empty key with Exists), same effect (or none), and the value
    equal unless the operator is Exists."""
    effects = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}
    if toleration.get("effect") not in (None, "", effects[taint["effect"]]):
        return False
    if toleration.get("operator") == "Exists":
        return toleration.get("key") in (None, "", taint["key"])
    return toleration.get("key") == taint["key"] and toleration.get("value") == taint["value"]


def test_gpu_nodes_are_watched_by_the_monitoring_agent_and_repaired(program):
    config, run = program
    agent = next(a.inputs for a in run.of_type("aws:eks/addon:Addon")
                 if a.inputs["addonName"] == "eks-node-monitoring-agent")
    assert agent["addonVersion"] == parse_stack_config(config).node_monitoring_agent_version
    gpu = next(g for g in run.of_type("eks:index:ManagedNodeGroup") if g.inputs.get("enableEfaSupport"))
    # The agent's GPU health reader (dcgm-server) must land on the tainted GPU nodes.
    (taint,) = gpu.inputs["taints"]
    tolerations = json.loads(agent["configurationValues"])["dcgmAgent"]["tolerations"]
    assert any(_tolerates(t, taint) for t in tolerations)
    # pulumi-eks hides nodeRepairConfig: the GPU group's transforms set it on the node group it creates,
    # and nothing else there.
    assert transformed_child(gpu, "aws:eks/nodeGroup:NodeGroup", {"clusterName": "c", "amiType": "AL2023_x86_64_NVIDIA"}
                             ) == {"clusterName": "c", "amiType": "AL2023_x86_64_NVIDIA",
                                   "nodeRepairConfig": {"enabled": True}}


def transformed_child(component: Declared, typ: str, props: dict[str, Any]) -> dict[str, Any]:
    """What a component's transforms, in their order, make of a child of type `typ` it creates with
    `props` (the mocks never see the children of a remote component; the engine runs the transforms
    on each)."""
    for transform in component.transforms:
        result = transform(pulumi.ResourceTransformArgs(custom=True, type_=typ, name="child", props=props,
                                                        opts=pulumi.ResourceOptions()))
        props = result.props if result is not None else props
    return props


def _system_group(run: ProgramRun) -> dict[str, Any]:
    return next(g.inputs for g in run.of_type("eks:index:ManagedNodeGroup")
                if not g.inputs.get("enableEfaSupport"))


def test_system_node_group_is_labelled_and_sized_by_the_config(program):
    config, run = program
    cfg = parse_stack_config(config)
    system = _system_group(run)
    n = cfg.system_node_count
    assert system["instanceTypes"] == [cfg.system_instance_type]
    assert system["labels"] == {"role": "system"}
    assert system["scalingConfig"] == {"desiredSize": n, "minSize": n, "maxSize": n}
    assert n == 2  # the default: losing one node does not take DNS, the operator and the head
    assert "taints" not in system


def test_the_system_group_size_is_configurable(monkeypatch):
    config = {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
              "ray-eks:systemNodeCount": 3}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    assert _system_group(run)["scalingConfig"] == {"desiredSize": 3, "minSize": 3, "maxSize": 3}


def test_helm_releases_are_pinned_and_get_exactly_the_rendered_values(program):
    config, run = program
    cfg = parse_stack_config(config)
    releases = {r.inputs["chart"]: r.inputs for r in run.of_type("kubernetes:helm.sh/v3:Release")}
    assert {c: r["version"] for c, r in releases.items()} == chart_versions(cfg)
    assert {c: r["values"] for c, r in releases.items()} == chart_values(
        cfg, cluster_name=run.outputs[outputs.CLUSTER_NAME])
    efa_image = releases["aws-efa-k8s-device-plugin"]["values"]["image"]["repository"]
    assert f".dkr.ecr.{cfg.region}.amazonaws.com/" in efa_image


def test_raycluster_is_the_rendered_manifest_and_waits_for_the_operator(program):
    config, run = program
    cfg = parse_stack_config(config)
    ray = run.one("kubernetes:ray.io/v1:RayCluster").inputs
    expected = build_raycluster(cfg)
    assert ray["spec"] == expected["spec"]
    assert ray["metadata"] == expected["metadata"]
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"][EFA_RESOURCE] == str(cfg.gpu_instance.efa_interfaces)
    assert worker["resources"]["limits"][GPU_RESOURCE] == str(cfg.gpu_instance.gpus)
    assert worker["image"] == cfg.ray_image
    # The operator's release installs the RayCluster CRD: created before it, deleted after it.
    operator = next(r.name for r in run.of_type("kubernetes:helm.sh/v3:Release")
                    if r.inputs["chart"] == "kuberay-operator")
    namespace = run.one("kubernetes:core/v1:Namespace").name
    ray_cluster = run.one("kubernetes:ray.io/v1:RayCluster").name
    assert {operator, namespace} <= run.waits_for("kubernetes:ray.io/v1:RayCluster", ray_cluster)


def test_checkpoint_bucket_is_private_encrypted_versioned_and_kept(program):
    config, run = program
    cfg = parse_stack_config(config)
    bucket = run.one("aws:s3/bucket:Bucket").inputs
    assert bucket["forceDestroy"] is (not cfg.retain_checkpoints_on_destroy)
    pab = run.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    assert all(pab[k] is True for k in ("blockPublicAcls", "blockPublicPolicy",
                                        "ignorePublicAcls", "restrictPublicBuckets"))
    versioning = run.one("aws:s3/bucketVersioning:BucketVersioning").inputs
    assert versioning["versioningConfiguration"]["status"] == "Enabled"
    sse = run.one("aws:s3/bucketServerSideEncryptionConfiguration:"
                  "BucketServerSideEncryptionConfiguration").inputs
    assert sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"


def _bucket_and_its_configuration(run: ProgramRun) -> list[Declared]:
    """The bucket and every resource that configures it (its `bucket` input is the bucket)."""
    bucket = run.one("aws:s3/bucket:Bucket")
    children = [r for r in run.resources if r.inputs.get("bucket") == f"{bucket.name}-id"]
    assert {c.typ.rsplit(":", 1)[-1] for c in children} >= {
        "BucketServerSideEncryptionConfiguration", "BucketVersioning",
        "BucketLifecycleConfiguration", "BucketPublicAccessBlock", "BucketOwnershipControls", "BucketPolicy"}
    return [bucket, *children]


def test_a_kept_bucket_keeps_all_of_its_configuration(program):
    # Deleting a configuration resource strips it from the bucket (versioning suspended, the
    # public access block and the lifecycle gone), so each is retained with the bucket.
    config, run = program
    assert parse_stack_config(config).retain_checkpoints_on_destroy
    assert [r.name for r in _bucket_and_its_configuration(run) if not r.retain_on_delete] == []


def test_a_bucket_not_kept_is_deleted_with_its_configuration(monkeypatch):
    config = {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
              "ray-eks:retainCheckpointsOnDestroy": False}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    resources = _bucket_and_its_configuration(run)
    assert [r.name for r in resources if r.retain_on_delete] == []
    assert resources[0].inputs["forceDestroy"] is True


def _lifecycle(run: ProgramRun) -> dict[str, dict[str, Any]]:
    config = run.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration").inputs
    assert config["bucket"] == run.one("aws:s3/bucket:Bucket").name + "-id"
    assert all(r["status"] == "Enabled" and r["filter"] == {} for r in config["rules"])
    return {r["id"]: r for r in config["rules"]}


def test_checkpoint_versions_and_failed_uploads_expire(program):
    config, run = program
    cfg = parse_stack_config(config)
    rules = _lifecycle(run)
    assert rules["expire-noncurrent-versions"]["noncurrentVersionExpiration"] == {
        "noncurrentDays": cfg.checkpoint_noncurrent_version_days}
    assert rules["abort-incomplete-multipart-uploads"]["abortIncompleteMultipartUpload"] == {
        "daysAfterInitiation": cfg.checkpoint_incomplete_upload_days}
    assert rules["remove-expired-delete-markers"]["expiration"] == {
        "expiredObjectDeleteMarker": True}
    assert "checkpoints-versioning" in run.waits_for(
        "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
        "checkpoints-lifecycle")


def test_checkpoint_lifecycle_is_configurable(monkeypatch):
    config = {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
              "ray-eks:checkpointNoncurrentVersionDays": 0,
              "ray-eks:checkpointIncompleteUploadDays": 3}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    rules = _lifecycle(run)
    assert set(rules) == {"abort-incomplete-multipart-uploads"}  # versions kept forever
    assert rules["abort-incomplete-multipart-uploads"]["abortIncompleteMultipartUpload"] == {
        "daysAfterInitiation": 3}


def test_only_the_ray_service_account_can_use_the_bucket_prefix(program):
    config, run = program
    cfg = parse_stack_config(config)
    assoc = run.one("aws:eks/podIdentityAssociation:PodIdentityAssociation").inputs
    assert (assoc["namespace"], assoc["serviceAccount"]) == (cfg.ray_namespace, "ray-train")
    policy = json.loads(next(r.inputs["policy"] for r in run.of_type("aws:iam/rolePolicy:RolePolicy")))
    bucket_arn = "arn:aws:s3:::ray-checkpoints-abc123"
    resources = {s["Sid"]: s["Resource"] for s in policy["Statement"]}
    assert resources == {"Objects": f"{bucket_arn}/ray-train/*", "List": bucket_arn}
    for statement in policy["Statement"]:
        tags = statement["Condition"]["StringEquals"]
        assert tags["aws:PrincipalTag/kubernetes-service-account"] == "ray-train"
        assert tags["aws:PrincipalTag/kubernetes-namespace"] == cfg.ray_namespace
        assert not any(a.endswith("*") for a in statement["Action"])


def test_ray_namespace_and_service_account_are_declared(program):
    config, run = program
    cfg = parse_stack_config(config)
    ns = run.one("kubernetes:core/v1:Namespace").inputs
    sa = run.one("kubernetes:core/v1:ServiceAccount").inputs
    assert ns["metadata"]["name"] == cfg.ray_namespace
    assert sa["metadata"] == {"name": "ray-train", "namespace": cfg.ray_namespace}


def test_a_bad_value_fails_the_program_before_any_resource(monkeypatch):
    config = read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")
    config["ray-eks:rayImage"] = "public.ecr.aws/deep-learning-containers/ray:latest"
    with pytest.raises(Exception, match=r"ray-eks:rayImage = .*latest.*Fix: pin") as info:
        run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    assert type(info.value).__name__ == "RunError"


def test_a_gpu_az_id_the_account_lacks_fails_with_a_fix(monkeypatch):
    config = read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")
    config["ray-eks:gpuAvailabilityZoneId"] = "usw2-az4"
    with pytest.raises(Exception, match="usw2-az4 is not available.*capacity probe") as info:
        run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    assert type(info.value).__name__ == "RunError"


# In this account the zone the probe checked (usw2-az1, "us-west-2a" where the probe ran) is
# named us-west-2b.
SHUFFLED = [("us-west-2a", "usw2-az3"), ("us-west-2b", "usw2-az1"), ("us-west-2c", "usw2-az2")]


def test_the_gpu_az_is_resolved_from_its_id_in_the_deploying_account(monkeypatch):
    config = read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")
    assert (config["ray-eks:gpuAvailabilityZone"], config["ray-eks:gpuAvailabilityZoneId"]) == (
        "us-west-2a", "usw2-az1")
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch, zones=SHUFFLED)
    gpu = next(g.inputs for g in run.of_type("eks:index:ManagedNodeGroup")
               if g.inputs.get("enableEfaSupport"))
    assert gpu["placementGroupAvailabilityZone"] == "us-west-2b"
    (gpu_subnet,) = [s for s in run.of_type("aws:ec2/subnet:Subnet")
                     if f"{s.name}-id" in gpu["subnetIds"]]
    assert gpu_subnet.inputs["availabilityZone"] == "us-west-2b"
    ray = run.one("kubernetes:ray.io/v1:RayCluster").inputs
    selector = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert selector["topology.kubernetes.io/zone"] == "us-west-2b"
    assert run.outputs[outputs.GPU_AVAILABILITY_ZONE] == "us-west-2b"
    (warning,) = [w for w in run.warnings if "usw2-az1" in w]
    assert "us-west-2b in this account, not us-west-2a" in warning


def test_a_gpu_az_name_that_matches_its_id_gives_no_warning(monkeypatch):
    config = read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    assert not [w for w in run.warnings if "availability zone" in w]


def test_s3_traffic_from_the_nodes_bypasses_the_nat_gateway(program):
    config, run = program
    cfg = parse_stack_config(config)
    endpoint = run.one("aws:ec2/vpcEndpoint:VpcEndpoint").inputs
    assert endpoint["vpcEndpointType"] == "Gateway"
    assert endpoint["serviceName"] == f"com.amazonaws.{cfg.region}.s3"
    private_rt = next(r for r in run.of_type("aws:ec2/routeTable:RouteTable")
                      if any("natGatewayId" in route for route in r.inputs["routes"]))
    assert endpoint["routeTableIds"] == [f"{private_rt.name}-id"]


def test_the_operator_waits_for_the_system_nodes_only(program):
    _, run = program
    release = "kubernetes:helm.sh/v3:Release"
    assert "system-nodes" in run.waits_for(release, "addons-kuberay-operator")
    assert not {n for n in run.waits_for(release, "addons-kuberay-operator")
                if n.startswith("gpu-")}
    for plugin in ("addons-nvidia-device-plugin", "addons-aws-efa-k8s-device-plugin"):
        assert "gpu-nodes" in run.waits_for(release, plugin)


def test_the_raycluster_waits_for_the_pod_identity_association(program):
    _, run = program
    waits = run.waits_for("kubernetes:ray.io/v1:RayCluster", "ray-raycluster")
    assert {"checkpoints-pod-identity", "addons-kuberay-operator", "ray-service-account"} <= waits


def test_the_pod_identity_agent_version_is_pinned(program):
    config, run = program
    addon = next(a.inputs for a in run.of_type("aws:eks/addon:Addon")
                 if a.inputs["addonName"] == "eks-pod-identity-agent")
    assert addon["addonName"] == "eks-pod-identity-agent"
    assert addon["addonVersion"] == parse_stack_config(config).pod_identity_agent_version


READY_TYPE = "pulumi-python:dynamic/ray-eks:RayWorkersReady"


def test_pulumi_up_waits_for_every_worker_after_the_raycluster(program):
    config, run = program
    cfg = parse_stack_config(config)
    ready = run.one(READY_TYPE)
    assert ready.inputs["expectedWorkers"] == cfg.gpu_node_count
    assert ready.inputs["hugePagesMib"] == cfg.gpu_huge_pages_mib  # named if the nodes lack them
    assert ready.inputs["timeoutSeconds"] == cfg.workers_ready_timeout_minutes * 60 > 0
    assert (ready.inputs["namespace"], ready.inputs["clusterName"]) == (
        cfg.ray_namespace, run.outputs[outputs.RAY_CLUSTER_NAME])
    kubeconfig = ready.inputs["kubeconfig"]  # stored as a secret in the state
    assert kubeconfig[rpc._special_sig_key] == rpc._special_secret_sig
    assert "ray-raycluster" in run.waits_for(READY_TYPE, ready.name)


def test_the_workers_huge_page_request_is_the_stack_setting(monkeypatch):
    config = {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
              "ray-eks:gpuHugePagesMib": 5120}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    ray = run.one("kubernetes:ray.io/v1:RayCluster").inputs
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["hugepages-2Mi"] == "5120Mi"
    assert run.one(READY_TYPE).inputs["hugePagesMib"] == 5120


def test_a_zero_timeout_does_not_wait_for_the_workers(monkeypatch):
    config = {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
              "ray-eks:workersReadyTimeoutMinutes": 0}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config,
                      monkeypatch=monkeypatch)
    assert run.of_type(READY_TYPE) == []


def test_the_kubernetes_provider_fails_loudly_on_an_unreachable_cluster(program):
    # Only the PR preview workflow turns on skipping (PULUMI_K8S_SKIP_UPDATE_UNREACHABLE); an
    # explicit provider setting would override that environment variable either way.
    _, run = program
    provider = run.one("pulumi:providers:kubernetes").inputs
    assert not {"skipUpdateUnreachable", "deleteUnreachable"} & set(provider)


def test_the_program_needs_no_pulumi_cli(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `pulumi` (nor any other binary) to find
    config = read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    assert run.one("kubernetes:ray.io/v1:RayCluster")
