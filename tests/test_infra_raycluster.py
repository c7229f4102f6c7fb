"""The RayCluster builder: valid against the KubeRay v1.7.0 CRD with unknown fields rejected, pod
templates valid as Kubernetes core objects, and the invariants that keep NCCL on EFA."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra.config import StackConfig
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES
from infra.raycluster import auth_secret_name, build_raycluster, head_service_name
from infra.sizing import max_huge_pages_mib, node_allocatable, worker_pod_size
from workloads.launch.task_history import TASK_HISTORY_ENV
from workloads.transport.gate import EFA_TRANSPORT_ENV, NodeNetwork

BASE = StackConfig(region="eu-west-1", gpu_availability_zone="eu-west-1b",
                   gpu_availability_zone_id="euw1-az2")
CONFIGS = [dataclasses.replace(BASE, gpu_instance_type=t, gpu_node_count=n)
           for t in GPU_INSTANCE_TYPES for n in (1, 2)]


def _strict(schema: Any) -> Any:
    """The schema with additionalProperties: false wherever it lists properties and does not
    preserve unknown fields, so a misspelled field fails instead of being pruned by the API."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd(shared_dir: Path) -> dict:
    # PyYAML's C loader (PyYAML comes with Ray) reads the 17,000-line CRD in well under a second.
    text = (shared_dir / "kuberay" / "ray.io_rayclusters.yaml").read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@pytest.fixture(scope="module")
def raycluster_schema(crd: dict) -> jsonschema.protocols.Validator:
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.gpu_instance_type}x{c.gpu_node_count}")
def test_manifest_validates_against_the_crd(cfg, raycluster_schema):
    raycluster_schema.validate(build_raycluster(cfg))


def test_manifest_is_addressed_as_the_crd_serves_it(crd):
    # The schema does not constrain apiVersion, kind or metadata: they are checked here.
    m = build_raycluster(dataclasses.replace(BASE, ray_namespace="training"))
    served = [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    assert m["apiVersion"] == f"{crd['spec']['group']}/v1" and "v1" in served
    assert m["kind"] == crd["spec"]["names"]["kind"]
    assert m["metadata"] == {"name": "ray-train", "namespace": "training"}
    # KubeRay derives the head Service and the generated token Secret from the cluster's name;
    # the client looks for them under these names.
    assert head_service_name() == f"{m['metadata']['name']}-head-svc"
    assert auth_secret_name() == m["metadata"]["name"]


@pytest.mark.parametrize("misspell", ["serviceTyp", "imagePullPolicyy"])
def test_the_strict_schema_rejects_a_misspelled_field(raycluster_schema, misspell):
    manifest = build_raycluster(BASE)
    head = manifest["spec"]["headGroupSpec"]
    target = head if misspell == "serviceTyp" else head["template"]["spec"]["containers"][0]
    target[misspell] = "x"
    with pytest.raises(jsonschema.ValidationError, match=misspell):
        raycluster_schema.validate(manifest)


def _pods(manifest: dict) -> list[dict]:
    templates = [manifest["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in manifest["spec"]["workerGroupSpecs"]]
    return [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"pod-{i}", **copy.deepcopy(t["metadata"])},
             "spec": copy.deepcopy(t["spec"])} for i, t in enumerate(templates)]


@pytest.mark.parametrize("cfg", CONFIGS[::2], ids=lambda c: c.gpu_instance_type)
def test_pod_templates_are_valid_kubernetes_pods(cfg):
    for pod in _pods(build_raycluster(cfg)):
        kubernetes_validate.validate(pod, desired_version="1.34", strict=True)


def test_kubernetes_validate_catches_a_bad_pod():
    pod = _pods(build_raycluster(BASE))[1]
    pod["spec"]["containers"][0]["resources"]["limits"] = "all of it"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, desired_version="1.34", strict=True)


def _head(manifest):
    return manifest["spec"]["headGroupSpec"]


def _worker(manifest):
    (group,) = manifest["spec"]["workerGroupSpecs"]
    return group


def _env(container) -> dict[str, str]:
    """The container's literal environment values (not those read from the downward API)."""
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_head_has_no_gpu_runs_on_the_system_node_behind_clusterip_with_token_auth():
    m = build_raycluster(BASE)
    head = _head(m)
    container = head["template"]["spec"]["containers"][0]
    # Neither GPUs nor CPUs for tasks: no training worker can land on the head.
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert _env(container)["NVIDIA_VISIBLE_DEVICES"] == "void"
    # The GCS's task history bounded (workloads/launch/task_history.py), on the head, where the GCS runs.
    assert TASK_HISTORY_ENV.items() <= _env(container).items()
    assert head["template"]["spec"]["nodeSelector"] == {"role": "system"}
    assert head["serviceType"] == "ClusterIP"
    assert m["spec"]["authOptions"] == {"mode": "token"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["image"] == BASE.ray_image


def test_the_cluster_is_fixed_size_and_its_jobs_api_listens_on_the_pod_address():
    m = build_raycluster(BASE)
    # No autoscaler: the worker group is the node group, sized by the stack (replicas = min = max).
    assert m["spec"]["enableInTreeAutoscaling"] is False
    # The head Service and `kubectl port-forward` reach the pod's own address, not its loopback.
    assert _head(m)["rayStartParams"] == {"num-gpus": "0", "num-cpus": "0", "dashboard-host": "0.0.0.0"}


def test_every_mount_is_a_volume_of_its_pod_and_shm_is_memory_backed():
    m = build_raycluster(BASE)
    for template in (_head(m)["template"], _worker(m)["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert set(mounts.values()) == set(volumes)
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
        # The image is pinned (tag or digest): pull it once per node, not on every pod start.
        assert container["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.gpu_instance_type}x{c.gpu_node_count}")
def test_workers_take_whole_efa_gpu_nodes_with_guaranteed_qos(cfg):
    worker = _worker(build_raycluster(cfg))
    instance = INSTANCE_TYPES[cfg.gpu_instance_type]
    n = cfg.gpu_node_count
    assert (worker["replicas"], worker["minReplicas"], worker["maxReplicas"]) == (n, n, n)
    resources = worker["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]
    limits = resources["limits"]
    assert limits["nvidia.com/gpu"] == str(instance.gpus)
    assert limits["vpc.amazonaws.com/efa"] == str(instance.efa_interfaces)
    node = node_allocatable(instance)
    assert 0 < int(limits["cpu"]) * 1000 < node.cpu_millicores
    assert 0 < int(limits["memory"].removesuffix("Gi")) * 2**20 < node.memory_kib
    assert "hugepages-2Mi" not in limits  # by default: gpuHugePagesMib 0
    assert int(limits["cpu"]) >= 0.9 * instance.vcpus
    assert worker_pod_size(instance, hugepages_mib=0).resources() == limits


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_workers_tell_the_transport_gate_their_nodes_network(instance_type):
    """The gate's floor between nodes follows each type's EFA, not g6.12xlarge's."""
    spec = _worker(build_raycluster(dataclasses.replace(BASE, gpu_instance_type=instance_type)))["template"]["spec"]
    network = NodeNetwork.from_env(_env(spec["containers"][0]))
    kind = INSTANCE_TYPES[instance_type]
    assert (network.efa_interfaces, network.line_gbps) == (kind.efa_interfaces, kind.network_gbps)
    assert network.floor_gbps == pytest.approx(kind.network_gbps / 8 / 5)


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_workers_request_the_huge_pages_the_stack_asks_for(instance_type):
    most = max_huge_pages_mib(INSTANCE_TYPES[instance_type])
    for asked in (2, most):
        cfg = dataclasses.replace(BASE, gpu_instance_type=instance_type, gpu_huge_pages_mib=asked)
        container = _worker(build_raycluster(cfg))["template"]["spec"]["containers"][0]
        assert container["resources"]["requests"]["hugepages-2Mi"] == f"{asked}Mi"
        assert container["resources"]["limits"]["hugepages-2Mi"] == f"{asked}Mi"
        assert "FI_EFA_USE_HUGE_PAGE" not in _env(container)  # libfabric uses its pages


def test_workers_declare_the_efa_transport_and_leave_the_nccl_log_to_each_rank():
    spec = _worker(build_raycluster(BASE))["template"]["spec"]
    env = _env(spec["containers"][0])
    assert env["FI_PROVIDER"] == "efa"
    assert env["NCCL_NET_PLUGIN"] == "ofi"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["FI_EFA_FORK_SAFE"] == "1"
    # The same declaration as the job's runtime_env. NCCL's log path is set once, by each rank
    # (workloads/launch/ray_train.py), not also here where every process of the pod would get it.
    # Without a huge page request (the default) the container may use no huge page, so libfabric
    # is told to keep its buffers in regular pages.
    # And the stack's region and the nodes' EFA network (the gate's floor between nodes): pods
    # cannot read either from the instance metadata (infra/imds.py).
    assert env == {**EFA_TRANSPORT_ENV, "FI_EFA_USE_HUGE_PAGE": "0", "AWS_REGION": BASE.region,
                   "RAY_EKS_EFA_INTERFACES": "1", "RAY_EKS_NETWORK_GBPS": "40"}
    assert not {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"} & set(env)
    # The pod's node, which a failing transport gate names for draining.
    from_api = {e["name"]: e["valueFrom"] for e in spec["containers"][0]["env"] if "valueFrom" in e}
    assert from_api == {"K8S_NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}


def test_workers_tolerate_the_gpu_taint_and_land_on_the_gpu_nodes_of_the_gpu_az():
    spec = _worker(build_raycluster(BASE))["template"]["spec"]
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Equal",
                                    "value": "true", "effect": "NoSchedule"}]
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert spec["nodeSelector"]["topology.kubernetes.io/zone"] == "eu-west-1b"
    assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == BASE.gpu_instance_type
    assert spec["serviceAccountName"] == "ray-train"


def test_every_ray_pod_uses_the_checkpoint_service_account():
    m = build_raycluster(BASE)
    assert {t["template"]["spec"]["serviceAccountName"]
            for t in [_head(m), *m["spec"]["workerGroupSpecs"]]} == {"ray-train"}


def test_builder_is_pure_and_deterministic():
    assert build_raycluster(BASE) == build_raycluster(BASE)
    first = build_raycluster(BASE)
    first["spec"]["workerGroupSpecs"][0]["replicas"] = 99
    assert build_raycluster(BASE)["spec"]["workerGroupSpecs"][0]["replicas"] == 2


def test_the_builder_holds_no_instance_specific_literal():
    source = (Path(__file__).resolve().parent.parent / "infra" / "raycluster.py").read_text()
    for name in INSTANCE_TYPES:
        assert name not in source
    assert "L4" not in source


def test_the_pulumi_program_imports_the_transport_env_without_torch_or_ray():
    code = ("import sys, infra.raycluster; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
