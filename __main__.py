"""The Pulumi program: reads the stack config, wires one component per concern, exports outputs."""

import dataclasses

import pulumi

from infra import outputs
from infra import scale_to_zero
from infra.addons import Addons, AddonsArgs
from infra.autoscaler import ClusterAutoscaler, ClusterAutoscalerArgs
from infra.cluster import EksCluster, EksClusterArgs
from infra.cost import estimated_cost_per_hour, estimated_idle_cost_per_hour, reservation_idle_note
from infra.health import NodeHealth, NodeHealthArgs
from infra.helm_values import CLUSTER_AUTOSCALER, chart_values, chart_versions
from infra.images import require_pinned_images
from infra.prices import on_demand
from infra.network import Network, NetworkArgs
from infra.nodegroups import GpuNodeGroup, GpuNodeGroupArgs, ScaleToZero, SystemNodeGroup, SystemNodeGroupArgs
from infra.nodegroups import gpu_launch_window
from infra.pulumi_config import load_running_stack_config
from infra.raycluster import (AUTH_SECRET_KEY, DASHBOARD_PORT, SERVICE_ACCOUNT,
                              RayClusterDeployment, RayClusterDeploymentArgs, auth_secret_name,
                              build_raycluster, head_service_name)
from infra.reservation import reservation_output
from infra.storage import CheckpointStorage, CheckpointStorageArgs
from infra.tracking import MlflowTracking, MlflowTrackingArgs

cfg = load_running_stack_config()
require_pinned_images(cfg)  # pulumi up stops here on an image not pinned by digest
gpu_window = gpu_launch_window(cfg)  # a reservation that has ended stops the program here
name = f"{pulumi.get_project()}-{pulumi.get_stack()}"
idle_to_zero = scale_to_zero.enabled(cfg)
if not cfg.api_access_cidrs:
    pulumi.log.warn("the EKS API endpoint is private (ray-eks:apiAccessCidrs is empty): run `pulumi up` and "
                    "`python -m workloads submit` from a machine that reaches the VPC, or name your address: "
                    "pulumi config set --path 'ray-eks:apiAccessCidrs[0]' \"$(curl -fsS "
                    "https://checkip.amazonaws.com)/32\" (docs/SECURITY.md)")
if reservation_idle_note(cfg):
    pulumi.log.warn(f"ray-eks:gpuIdleMinutes scales the GPU nodes to zero, but {reservation_idle_note(cfg)}")

network = Network("network", NetworkArgs(
    cluster_name=name, region=cfg.region, gpu_availability_zone_id=cfg.gpu_availability_zone_id,
    gpu_availability_zone=cfg.gpu_availability_zone))
# From here on the GPU AZ is this account's name for the zone ID the probe checked.
cfg = dataclasses.replace(cfg, gpu_availability_zone=network.gpu_availability_zone)
manifest = build_raycluster(cfg)
ray_cluster_name = manifest["metadata"]["name"]
cluster = EksCluster("cluster", EksClusterArgs(
    cluster_name=name, kubernetes_version=cfg.kubernetes_version, vpc_id=network.vpc_id,
    public_subnet_ids=network.public_subnet_ids, private_subnet_ids=network.private_subnet_ids,
    api_access_cidrs=cfg.api_access_cidrs, api_open_to_internet=cfg.api_open_to_internet,
    admin_principal_arns=cfg.admin_principal_arns,
    pod_identity_agent_version=cfg.pod_identity_agent_version, vpc_cni_version=cfg.vpc_cni_version))
system_nodes = SystemNodeGroup("system", SystemNodeGroupArgs(
    cluster=cluster.cluster, instance_type=cfg.system_instance_type,
    subnet_ids=network.node_subnet_ids, node_count=cfg.system_node_count, after=[cluster.vpc_cni]))
gpu_nodes = GpuNodeGroup("gpu", GpuNodeGroupArgs(
    cluster=cluster.cluster, instance_type=cfg.gpu_instance_type, node_count=cfg.gpu_node_count,
    availability_zone=cfg.gpu_availability_zone, subnet_id=network.gpu_subnet_id,
    root_volume_gib=cfg.gpu_root_volume_gib, capacity_type=cfg.gpu_capacity_type,
    reservation=cfg.gpu_reservation,
    window=gpu_window, cluster_name=cluster.cluster_name, after=[cluster.vpc_cni],
    scale_to_zero=ScaleToZero(asg_tags=scale_to_zero.node_template_tags(cfg, cluster_name=name),
                              extra_labels=scale_to_zero.accelerator_label(cfg))
    if idle_to_zero else None))
node_health = NodeHealth("node-health", NodeHealthArgs(
    cluster_name=cluster.cluster_name, cluster=cluster.cluster, version=cfg.node_monitoring_agent_version))
helm_values = chart_values(cfg, cluster_name=name)
addons = Addons("addons", AddonsArgs(
    provider=cluster.provider, values=helm_values, versions=chart_versions(cfg),
    system_nodes=system_nodes, gpu_nodes=gpu_nodes))
if idle_to_zero:
    ClusterAutoscaler("autoscaler", ClusterAutoscalerArgs(
        provider=cluster.provider, cluster_name=name, region=cfg.region,
        values=helm_values[CLUSTER_AUTOSCALER.name], version=cfg.cluster_autoscaler_chart_version,
        cluster=cluster.cluster, system_nodes=system_nodes))
storage = CheckpointStorage("checkpoints", CheckpointStorageArgs(
    bucket_prefix=cfg.checkpoint_bucket_prefix,
    retain_on_destroy=cfg.retain_checkpoints_on_destroy,
    noncurrent_version_days=cfg.checkpoint_noncurrent_version_days,
    incomplete_upload_days=cfg.checkpoint_incomplete_upload_days, key_prefix=ray_cluster_name,
    cluster_name=cluster.cluster_name, namespace=cfg.ray_namespace,
    service_account=SERVICE_ACCOUNT, cluster=cluster))
tracking = MlflowTracking("mlflow", MlflowTrackingArgs(
    server_name=name, size=cfg.mlflow_size, bucket_name=storage.bucket_name, bucket_arn=storage.bucket_arn,
    key_prefix=storage.key_prefix, pod_role_name=storage.pod_role_name, cluster_name=cluster.cluster_name,
    namespace=cfg.ray_namespace, service_account=SERVICE_ACCOUNT)) if cfg.mlflow else None
ray = RayClusterDeployment("ray", RayClusterDeploymentArgs(
    manifest=manifest, provider=cluster.provider, operator_release=addons.kuberay_operator,
    pod_identity=storage.pod_identity, kubeconfig=cluster.kubeconfig,
    workers_ready_timeout_minutes=cfg.workers_ready_timeout_minutes, kubernetes_version=cfg.kubernetes_version,
    workers_now=0 if idle_to_zero else gpu_window.desired_nodes if gpu_window else None,
    workers_note=scale_to_zero.idle_note(cfg) if idle_to_zero else gpu_window.note if gpu_window else ""))

pulumi.export(outputs.KUBECONFIG, cluster.kubeconfig)
pulumi.export(outputs.CLUSTER_NAME, cluster.cluster_name)
pulumi.export(outputs.REGION, cfg.region)
pulumi.export(outputs.GPU_AVAILABILITY_ZONE, cfg.gpu_availability_zone)
pulumi.export(outputs.RAY_NAMESPACE, ray.namespace)
pulumi.export(outputs.RAY_CLUSTER_NAME, ray.cluster_name)
pulumi.export(outputs.RAY_HEAD_SERVICE, head_service_name(ray_cluster_name))
pulumi.export(outputs.RAY_DASHBOARD_PORT, DASHBOARD_PORT)
pulumi.export(outputs.RAY_AUTH_SECRET_NAME, auth_secret_name(ray_cluster_name))
pulumi.export(outputs.RAY_AUTH_SECRET_KEY, AUTH_SECRET_KEY)
pulumi.export(outputs.CHECKPOINT_BUCKET_URI, storage.uri)
pulumi.export(outputs.ESTIMATED_COST_PER_HOUR_USD, estimated_cost_per_hour(cfg))
pulumi.export(outputs.ESTIMATED_IDLE_COST_PER_HOUR_USD, estimated_idle_cost_per_hour(cfg))
pulumi.export(outputs.GPU_IDLE_MINUTES, cfg.gpu_idle_minutes)
pulumi.export(outputs.PRICE_TABLE_DATE, on_demand(cfg.gpu_instance_type, cfg.region).date)
pulumi.export(outputs.GPU_INSTANCE_TYPE, cfg.gpu_instance_type)
pulumi.export(outputs.GPU_MEMORY_GIB, cfg.gpu_instance.gpu_memory_gib)
pulumi.export(outputs.RAY_WORKER_GPUS, cfg.gpu_node_count * cfg.gpu_instance.gpus)
pulumi.export(outputs.GPU_RESERVATION, reservation_output(cfg, stack=pulumi.get_stack()))
if tracking is not None:
    pulumi.export(outputs.MLFLOW_TRACKING_SERVER_ARN, tracking.arn)
    pulumi.export(outputs.MLFLOW_UI_URL, tracking.ui_url)
