"""Names of the stack outputs, defined once.

`python -m workloads submit --stack NAME` reads them with
`pulumi stack output --json --show-secrets`; the README and the tests use these names too.
"""

KUBECONFIG = "kubeconfig"
"""Kubeconfig of the EKS cluster (secret); authenticates through `aws eks get-token`."""
CLUSTER_NAME = "clusterName"
REGION = "region"
GPU_AVAILABILITY_ZONE = "gpuAvailabilityZone"
RAY_NAMESPACE = "rayNamespace"
RAY_CLUSTER_NAME = "rayClusterName"
RAY_HEAD_SERVICE = "rayHeadService"
"""Name of the ClusterIP Service of the Ray head, in RAY_NAMESPACE."""
RAY_DASHBOARD_PORT = "rayDashboardPort"
"""Port of the Ray dashboard and Jobs API on RAY_HEAD_SERVICE."""
RAY_AUTH_SECRET_NAME = "rayAuthSecretName"
"""Kubernetes Secret in RAY_NAMESPACE that holds the Ray auth token."""
RAY_AUTH_SECRET_KEY = "rayAuthSecretKey"
"""Key of the token in RAY_AUTH_SECRET_NAME."""
CHECKPOINT_BUCKET_URI = "checkpointBucketUri"
"""s3://bucket/prefix where Ray Train writes checkpoints."""
ESTIMATED_COST_PER_HOUR_USD = "estimatedCostPerHourUsd"
"""Busy: with the GPU nodes up. The GPU nodes at the region's On-Demand list price of infra/prices.py
where it has one, the rest at infra/instance_types.py's; see PRICE_TABLE_DATE."""
ESTIMATED_IDLE_COST_PER_HOUR_USD = "estimatedIdleCostPerHourUsd"
"""While no job runs: the same as busy unless the GPU nodes scale to zero (GPU_IDLE_MINUTES), and
then the stack without them, plus a targeted On-Demand Capacity Reservation, billed regardless."""
GPU_IDLE_MINUTES = "gpuIdleMinutes"
"""Minutes without a job after which the GPU nodes scale to zero; 0: they stay up. `workloads
submit` then reports the nodes coming back while its job waits for them."""
PRICE_TABLE_DATE = "priceTableDate"
"""The date of the GPU nodes' price behind ESTIMATED_COST_PER_HOUR_USD (infra/prices.py's for a
region it prices, else infra/instance_types.py's)."""
GPU_INSTANCE_TYPE = "gpuInstanceType"
GPU_MEMORY_GIB = "gpuMemoryGib"
"""Memory of one GPU of GPU_INSTANCE_TYPE: `workloads submit` sizes its default preset by it."""
RAY_WORKER_GPUS = "rayWorkerGpus"
"""GPUs of all Ray worker pods together: the job waits for this many to register before training."""

GPU_RESERVATION = "gpuReservation"
"""The capacity reservation the GPU nodes launch into (id, type, AZ, start, end, idle cost per
hour, and what `pulumi destroy` leaves of it), or null. Destroy lists it as it removes it."""

MLFLOW_TRACKING_SERVER_ARN = "mlflowTrackingServerArn"
"""With `ray-eks:mlflow`: the SageMaker managed MLflow tracking server, the runs' tracking URI
(`workloads submit --stack` passes it to the job)."""
MLFLOW_UI_URL = "mlflowUiUrl"
"""With `ray-eks:mlflow`: the tracking server's UI (open it through a presigned URL: docs/WORKLOAD.md)."""

TRACKING = (MLFLOW_TRACKING_SERVER_ARN, MLFLOW_UI_URL)
"""Exported only by a stack with `ray-eks:mlflow`; a stack without it exports ALL alone."""

ALL = (KUBECONFIG, CLUSTER_NAME, REGION, GPU_AVAILABILITY_ZONE, RAY_NAMESPACE, RAY_CLUSTER_NAME,
       RAY_HEAD_SERVICE, RAY_DASHBOARD_PORT, RAY_AUTH_SECRET_NAME, RAY_AUTH_SECRET_KEY,
       CHECKPOINT_BUCKET_URI, ESTIMATED_COST_PER_HOUR_USD, ESTIMATED_IDLE_COST_PER_HOUR_USD,
       PRICE_TABLE_DATE, GPU_INSTANCE_TYPE, GPU_MEMORY_GIB, RAY_WORKER_GPUS, GPU_RESERVATION,
       GPU_IDLE_MINUTES)
SECRET = (KUBECONFIG,)
