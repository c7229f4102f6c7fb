"""The RayCluster: built by a pure function from the stack config, then applied by a component.

`build_raycluster` returns the plain `ray.io/v1` dict that `pulumi up` applies and that
`python -m infra render` prints. Everything instance-specific comes from infra/instance_types.py
through infra/sizing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import StackConfig
from infra.nodes import GPU_NODE_LABELS, SYSTEM_NODE_LABELS, gpu_toleration
from infra.network_policy import ray_network_policy
from infra.readiness import RayWorkersReady, manifest_fingerprint
from infra.scale_to_zero import SAFE_TO_EVICT_ANNOTATION, enabled as scales_to_zero, ray_autoscaler_options
from infra.sizing import HUGEPAGES_RESOURCE, head_pod_size, worker_pod_size
from infra.spot import worker_shutdown
from workloads.launch.credentials import CREDENTIALS_DIR, CREDENTIALS_SECRET
from workloads.launch.task_history import TASK_HISTORY_ENV
from workloads.transport.gate import EFA_TRANSPORT_ENV, NODE_NAME_ENV, node_network_env

RAY_CLUSTER_NAME = "ray-train"
SERVICE_ACCOUNT = "ray-train"
"""The Kubernetes service account of every Ray pod; the only one allowed to use the checkpoint
bucket (infra/storage.py)."""
WORKER_GROUP = "gpu"
DASHBOARD_PORT = 8265
GCS_PORT = 6379
CLIENT_PORT = 10001
AUTH_SECRET_KEY = "auth_token"
"""The key KubeRay writes the Ray auth token under in the Secret it generates."""
RAY_POD_LABELS = {"app.kubernetes.io/part-of": RAY_CLUSTER_NAME}
"""On every Ray pod: the NetworkPolicy selects them by it (infra/network_policy.py)."""


def head_service_name(cluster_name: str = RAY_CLUSTER_NAME) -> str:
    """The Service KubeRay creates in front of the head pod."""
    return f"{cluster_name}-head-svc"


def auth_secret_name(cluster_name: str = RAY_CLUSTER_NAME) -> str:
    """The Secret KubeRay generates with the Ray auth token when `authOptions.secretName` is
    unset: named after the RayCluster, stable for its lifetime."""
    return cluster_name


def nccl_env() -> list[dict[str, str]]:
    """The network transport, declared rather than left to NCCL's silent fallback to sockets. NCCL's
    log settings are not here: each training process sets its own (workloads/launch/ray_train.py),
    so that one place decides where the transport gate finds it."""
    return [{"name": name, "value": value} for name, value in EFA_TRANSPORT_ENV.items()]


EFA_HUGE_PAGE_ENV = "FI_EFA_USE_HUGE_PAGE"
"""libfabric's EFA provider takes its buffers from 2 MiB huge pages unless this is 0."""


def huge_page_env(hugepages_mib: int) -> list[dict[str, str]]:
    """Without a `hugepages-2Mi` request the container may use no huge page (Kubernetes limits it
    to none), so libfabric is told to use regular pages instead of failing on them."""
    return [] if hugepages_mib else [{"name": EFA_HUGE_PAGE_ENV, "value": "0"}]


def node_name_env() -> dict[str, Any]:
    """The pod's Kubernetes node, from the downward API: a failing transport gate names the node to
    drain (workloads/transport/gate.py)."""
    return {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def gpu_network_env(cfg: StackConfig) -> list[dict[str, str]]:
    """The GPU nodes' EFA interfaces and line rate, from which the transport gate sets its floor
    between nodes (workloads/transport/gate.py): the Ray workers cannot read the instance type from
    the instance metadata (infra/imds.py)."""
    instance = cfg.gpu_instance
    env = node_network_env(efa_interfaces=instance.efa_interfaces, line_gbps=instance.network_gbps)
    return [{"name": name, "value": value} for name, value in env.items()]


def region_env(cfg: StackConfig) -> dict[str, str]:
    """The stack's region for the AWS SDKs in the Ray pods (S3, MLflow's signing plugin): EKS Pod
    Identity gives credentials, not a region, and the pods cannot ask the instance metadata for one
    (infra/imds.py)."""
    return {"name": "AWS_REGION", "value": cfg.region}


def _shm_volume() -> dict[str, Any]:
    # Memory-backed and counted against the pod's memory limit; Docker's 64 MiB default would
    # starve the Ray object store and NCCL's shared-memory transport.
    return {"name": "dshm", "emptyDir": {"medium": "Memory"}}


CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
"""Every Ray container (and the Ray autoscaler's): no privilege escalation, no Linux capability. EFA
needs none added: its device plugin hands the container the node's EFA devices, and EKS's own EFA
example (the EKS user guide's NCCL test on p5) runs its workers with no securityContext at all."""
POD_SECURITY_CONTEXT = {"seccompProfile": {"type": "RuntimeDefault"}}
"""Every Ray pod: the container runtime's default seccomp profile."""
POD_SECURITY_LEVEL = "baseline"
"""The strictest Pod Security Standard the Ray pods meet, enforced on the Ray namespace. Not
`restricted`: it also requires `runAsNonRoot`, and the Ray image chooses its own user (the DLC image
is not known to run as non-root); the namespace warns and audits against `restricted`."""


def pod_security_labels(kubernetes_version: str) -> dict[str, str]:
    """The Pod Security Admission labels of the Ray namespace: `POD_SECURITY_LEVEL` enforced at
    the cluster's Kubernetes minor, `restricted` warned and audited."""
    version = f"v{kubernetes_version}"
    prefix = "pod-security.kubernetes.io"
    return {f"{prefix}/enforce": POD_SECURITY_LEVEL, f"{prefix}/enforce-version": version,
            f"{prefix}/warn": "restricted", f"{prefix}/warn-version": version,
            f"{prefix}/audit": "restricted", f"{prefix}/audit-version": version}


def _credentials_volume() -> dict[str, Any]:
    # The job's MLflow and hub credentials, as files its processes read at start
    # (workloads/launch/credentials.py): kept out of the entrypoint and runtime_env, which Ray shows
    # to whoever lists jobs, and out of the pod's environment, so a change needs no new pod.
    # Optional: the pods start without it.
    return {"name": "job-credentials", "secret": {"secretName": CREDENTIALS_SECRET, "optional": True,
                                                  "defaultMode": 0o444}}


def _volume_mounts() -> list[dict[str, Any]]:
    return [{"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "job-credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True}]


def _pod_metadata(cfg: StackConfig) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": dict(RAY_POD_LABELS)}
    if scales_to_zero(cfg):
        # The Cluster Autoscaler never removes a node that runs a Ray pod: only Ray's autoscaler
        # ends a worker, once it is idle.
        metadata["annotations"] = {SAFE_TO_EVICT_ANNOTATION: "false"}
    return metadata


def _head_template(cfg: StackConfig) -> dict[str, Any]:
    resources = head_pod_size(cfg.system_instance).resources()
    return {
        "metadata": _pod_metadata(cfg),
        "spec": {
            "serviceAccountName": SERVICE_ACCOUNT,
            "securityContext": dict(POD_SECURITY_CONTEXT),
            "nodeSelector": dict(SYSTEM_NODE_LABELS),
            "containers": [{
                "name": "ray-head",
                "image": cfg.ray_image,
                "imagePullPolicy": "IfNotPresent",
                "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
                "env": [
                    # The DLC image sets NVIDIA_VISIBLE_DEVICES=all; the head has no GPU.
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                    region_env(cfg),
                    # The GCS's task history bounded, so that a run of days does not grow the head.
                    *({"name": name, "value": value} for name, value in TASK_HISTORY_ENV.items()),
                ],
                "ports": [
                    {"name": "gcs-server", "containerPort": GCS_PORT},
                    {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                    {"name": "client", "containerPort": CLIENT_PORT},
                ],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "volumeMounts": _volume_mounts(),
            }],
            "volumes": [_shm_volume(), _credentials_volume()],
        },
    }


def _worker_template(cfg: StackConfig) -> dict[str, Any]:
    resources = worker_pod_size(cfg.gpu_instance, hugepages_mib=cfg.gpu_huge_pages_mib).resources()
    # On Spot and Capacity Blocks: a grace period and Ray drain that fit a checkpoint between the
    # drain and the reclaim (infra/spot.py).
    shutdown_spec, shutdown_env = worker_shutdown(cfg)
    return {
        "metadata": _pod_metadata(cfg),
        "spec": {
            **shutdown_spec,
            "serviceAccountName": SERVICE_ACCOUNT,
            "securityContext": dict(POD_SECURITY_CONTEXT),
            "nodeSelector": {
                **GPU_NODE_LABELS,
                "node.kubernetes.io/instance-type": cfg.gpu_instance_type,
                "topology.kubernetes.io/zone": cfg.gpu_availability_zone,
            },
            "tolerations": [gpu_toleration()],
            "containers": [{
                "name": "ray-worker",
                "image": cfg.ray_image,
                "imagePullPolicy": "IfNotPresent",
                "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
                "env": [*nccl_env(), *huge_page_env(cfg.gpu_huge_pages_mib), node_name_env(), region_env(cfg),
                        *gpu_network_env(cfg), *shutdown_env],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "volumeMounts": _volume_mounts(),
            }],
            "volumes": [_shm_volume(), _credentials_volume()],
        },
    }


def _worker_group(cfg: StackConfig) -> dict[str, Any]:
    """One worker per GPU node. A fixed count (replicas = min = max) unless the GPU nodes scale to
    zero: then Ray's autoscaler sets the count between 0 and `gpuNodeCount`, and `replicas` is left
    out so that `pulumi up` never owns (and never resets) the field the autoscaler writes."""
    nodes = cfg.gpu_node_count
    counts = ({"minReplicas": 0, "maxReplicas": nodes} if scales_to_zero(cfg)
              else {"replicas": nodes, "minReplicas": nodes, "maxReplicas": nodes})
    return {"groupName": WORKER_GROUP, **counts, "rayStartParams": {},
            "template": _worker_template(cfg)}


def worker_counts(manifest: dict[str, Any]) -> tuple[int, int]:
    """(worker pods the RayCluster starts with, the most it may have) of a built manifest."""
    (group,) = manifest["spec"]["workerGroupSpecs"]
    return group.get("replicas", group["minReplicas"]), group["maxReplicas"]


def build_raycluster(cfg: StackConfig, *, name: str = RAY_CLUSTER_NAME) -> dict[str, Any]:
    """The RayCluster manifest for this stack: one head on a system node, one worker per GPU
    node (with `gpuIdleMinutes`, as many as the jobs ask for, none when idle)."""
    autoscaling = ({"enableInTreeAutoscaling": True, "autoscalerOptions": {
                       **ray_autoscaler_options(cfg), "securityContext": dict(CONTAINER_SECURITY_CONTEXT)}}
                   if scales_to_zero(cfg) else {"enableInTreeAutoscaling": False})
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": cfg.ray_namespace},
        "spec": {
            "rayVersion": cfg.ray_version,
            # KubeRay generates the token Secret (auth_secret_name) and injects RAY_AUTH_MODE and
            # RAY_AUTH_TOKEN into every Ray container.
            "authOptions": {"mode": "token"},
            **autoscaling,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                # No GPU and no CPU for tasks: the job's driver and Ray Train's controller reserve
                # none, and training workers belong on the GPU nodes only.
                "rayStartParams": {"num-gpus": "0", "num-cpus": "0", "dashboard-host": "0.0.0.0"},
                "template": _head_template(cfg),
            },
            "workerGroupSpecs": [_worker_group(cfg)],
        },
    }


@dataclass(frozen=True, kw_only=True)
class RayClusterDeploymentArgs:
    manifest: dict[str, Any]
    """The output of `build_raycluster`, applied as is."""
    provider: k8s.Provider
    """Kubernetes provider of the EKS cluster."""
    operator_release: pulumi.Resource
    """The KubeRay operator Helm release: it installs the CRD and must outlive the RayCluster."""
    pod_identity: pulumi.Resource
    """The Pod Identity association of the Ray service account: EKS injects credentials only
    into pods admitted after it exists."""
    kubeconfig: pulumi.Input[str]
    """The cluster's kubeconfig, with which `pulumi up` watches the worker pods."""
    workers_ready_timeout_minutes: int
    """How long `pulumi up` waits for every worker pod to be Ready; 0 does not wait."""
    kubernetes_version: str
    """The cluster's Kubernetes minor: the Pod Security Standards' version the namespace enforces."""
    workers_now: int | None = None
    """Worker pods `pulumi up` waits for: fewer than the worker group's replicas while a Capacity
    Block has not started (0 nodes until then), none when the GPU nodes scale to zero (the workers
    come with a job). None: every replica."""
    workers_note: str = ""
    """Why fewer workers than the most the group may have are waited for (a line for
    `pulumi up`)."""


class RayClusterDeployment(pulumi.ComponentResource):
    """The Ray namespace, the Ray pods' service account and NetworkPolicy, the RayCluster itself, and (unless the
    timeout is 0, or the workers scale to zero) `workers_ready`, which exists once every worker
    pod is Ready."""

    def __init__(self, name: str, args: RayClusterDeploymentArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:RayClusterDeployment", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.provider)
        meta = args.manifest["metadata"]
        namespace = k8s.core.v1.Namespace(
            f"{name}-namespace", metadata={"name": meta["namespace"],
                                           "labels": pod_security_labels(args.kubernetes_version)},
            opts=child)
        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-service-account",
            metadata={"name": SERVICE_ACCOUNT, "namespace": meta["namespace"]},
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                depends_on=[namespace])))
        # Before the RayCluster, so that no Ray pod runs a moment unguarded.
        policy = ray_network_policy(namespace=meta["namespace"], ray_pod_labels=RAY_POD_LABELS)
        self.network_policy = k8s.networking.v1.NetworkPolicy(
            f"{name}-network-policy", metadata=policy["metadata"], spec=policy["spec"],
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[namespace])))
        self.ray_cluster = k8s.apiextensions.CustomResource(
            f"{name}-raycluster",
            api_version=args.manifest["apiVersion"],
            kind=args.manifest["kind"],
            metadata=meta,
            spec=args.manifest["spec"],
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(
                depends_on=[namespace, self.service_account, self.network_policy, args.operator_release,
                            args.pod_identity])))
        self.workers_ready = None
        (group,) = args.manifest["spec"]["workerGroupSpecs"]
        replicas, _ = worker_counts(args.manifest)
        workers_now = replicas if args.workers_now is None else args.workers_now
        autoscaled = args.manifest["spec"]["enableInTreeAutoscaling"]
        if autoscaled:
            # The workers come with a job (the client reports their coming); none to wait for.
            pulumi.log.info(f"pulumi up waits for no Ray worker pod: {args.workers_note}",
                            resource=self)
        elif workers_now < replicas:
            pulumi.log.warn(f"pulumi up waits for {workers_now} of the {replicas} Ray "
                            f"worker pods, the rest stay Pending until their GPU nodes exist: "
                            f"{args.workers_note}", resource=self)
        if args.workers_ready_timeout_minutes and not autoscaled:
            requests = group["template"]["spec"]["containers"][0]["resources"]["requests"]
            self.workers_ready = RayWorkersReady(
                f"{name}-workers-ready", kubeconfig=args.kubeconfig,
                namespace=meta["namespace"], cluster_name=meta["name"],
                expected_workers=workers_now,
                timeout_minutes=args.workers_ready_timeout_minutes,
                manifest_fingerprint=manifest_fingerprint(args.manifest),
                huge_pages_mib=int(requests.get(HUGEPAGES_RESOURCE, "0Mi").removesuffix("Mi")),
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.ray_cluster]))
        self.namespace = pulumi.Output.from_input(meta["namespace"])
        self.cluster_name = pulumi.Output.from_input(meta["name"])
        self.register_outputs({"namespace": self.namespace, "clusterName": self.cluster_name})
