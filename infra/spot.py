"""Spot GPU nodes: the node group's capacity type, the AWS Node Termination Handler that turns EC2's
interruption notice into the pod's SIGTERM, and the shutdown timing that fits a checkpoint inside
the two-minute notice. Pure data: no Pulumi.

What happens on a notice: EC2 announces the reclaim 120 s ahead (instance metadata, EventBridge).
Two things may drain the node, and either is enough:

- The AWS Node Termination Handler (NTH, a DaemonSet on the Spot GPU nodes, IMDS mode, on Spot
  stacks only) reads the notice from the instance metadata and drains the node at once. From its
  source (aws/aws-node-termination-handler v1.25.6, the chart's app version):
  `cmd/node-termination-handler.go` runs each IMDS monitor every 2 s (`time.Tick(time.Second * 2)`)
  and hands active events to the drain every 1 s (`time.NewTicker(1 * time.Second)`); an event is
  active from its start time less `nodeTerminationGracePeriod`
  (`pkg/interruptioneventstore`, `TimeUntilDrain`), and the Spot monitor's start time is the
  interruption time, the notice plus 120 s (`pkg/monitor/spotitn`), so with that setting at 120 the
  drain starts at the notice. The drain (`pkg/node/node.go`) taints and cordons the node, then
  evicts its pods with kubectl's drain helper, `GracePeriodSeconds: podTerminationGracePeriod`: -1
  leaves each pod its own grace period.
- The managed node group: EKS enables Capacity Rebalancing on a Spot group's Auto Scaling group,
  and on the two-minute notice drains the node if the replacement it launched on the rebalance
  recommendation is not Ready yet (EKS user guide, "Managed node groups", Spot capacity). EKS
  calls this best effort and gives no latency; NTH is the bounded path.

Both draining one node is harmless: an eviction of a pod already being deleted skips its
disruption budget (Kubernetes `canIgnorePDB`, a deletion timestamp set) and a second deletion can
only shorten the grace period, never restart it (`BeforeDelete` in the apiserver's registry), and
NTH asks for no grace period of its own (-1). What EKS's own drain asks for is not documented: if
it asked for less than the pod's, it would shorten it (only modelled here; docs/RELIABILITY.md).

The drain evicts the pod: the kubelet sends the Ray worker pod's `ray start --block` (PID 1)
SIGTERM. Ray marks the node as draining for `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` before it stops
its processes; Ray Train's preemption watcher sees the drain (it polls every
`RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`, 5 s) and the training loop, which asks at step boundaries
(workloads/train/preemption.py), saves a checkpoint at once. The kubelet SIGKILLs the pod when its
termination grace period ends, and EC2 takes the instance at 120 s whatever is still running.

The budget, from the notice:
- up to 10 s before the kubelet sends SIGTERM (`NOTICE_TO_SIGTERM_S`): NTH's 2 s poll and 1 s
  hand-off, then its API calls (node labels, taint, cordon, pod list, the evictions) and the
  kubelet seeing the deletion through its watch, allowed 7 s (they take well under one on a
  responsive API server);
- the pod's grace period, 105 s: it ends at 115 s, 5 s before EC2 takes the instance;
- inside it, Ray's drain timeout, 95 s: Ray stops its own processes (raylet, object store,
  workers) in the 10 s left before the SIGKILL, instead of being killed half-way;
- inside the drain: 5 s until the watcher sees it, up to `check_every` steps until the loop asks,
  then the save and its upload. On a g6.12xlarge the 1.5B model's checkpoint is about 18.5 GB, half
  of it per node, written to local NVMe and uploaded to S3 over the node's 40 Gbps; what is left
  of the 95 s after the first two is the save's budget (docs/RELIABILITY.md has the measured
  figures of the local rehearsal). A save that cannot finish leaves the latest complete checkpoint
  the one to resume from (Ray registers a checkpoint only once every rank has reported it).

NTH watches the notice only. Rebalance recommendations it leaves alone (`enableRebalanceMonitoring`
and `enableRebalanceDraining` off): the managed node group already acts on them, replacement
first, then the drain; NTH draining on one too would evict before a replacement exists, and its
monitoring mode would cordon a node whose worker is still wanted. Auto Scaling terminations
(`enableASGLifecycleDraining`) it leaves to the managed node group's own lifecycle hook, which
drains them.
"""

from __future__ import annotations

from typing import Any

from infra.config import StackConfig
from infra.nodes import GPU_NODE_LABELS, gpu_toleration

SPOT_NOTICE_S = 120
"""EC2's Spot interruption notice: the instance is reclaimed this long after it."""
NTH_IMDS_POLL_S = 2
"""How often NTH reads the instance metadata for a notice (its monitor loop)."""
NTH_EVENT_LOOP_S = 1
"""How often NTH hands an active interruption event to its drain."""
DRAIN_API_ALLOWANCE_S = 7
"""NTH's API calls before the eviction, and the kubelet acting on the pod's deletion."""
NOTICE_TO_SIGTERM_S = NTH_IMDS_POLL_S + NTH_EVENT_LOOP_S + DRAIN_API_ALLOWANCE_S
"""From the notice to the pod's SIGTERM, at most (10)."""
SIGKILL_MARGIN_S = 5
"""Between the end of the pod's grace period (SIGKILL) and EC2 taking the instance."""
RAY_TEARDOWN_S = 10
"""Between the end of Ray's drain and the SIGKILL: Ray stopping its processes itself."""

SPOT_TERMINATION_GRACE_PERIOD_S = SPOT_NOTICE_S - NOTICE_TO_SIGTERM_S - SIGKILL_MARGIN_S
"""The Ray worker pods' terminationGracePeriodSeconds on Spot nodes (105)."""
SPOT_DRAIN_TIMEOUT_S = SPOT_TERMINATION_GRACE_PERIOD_S - RAY_TEARDOWN_S
"""`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` of the Ray workers on Spot nodes (95)."""
DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
"""Read by `ray start --block` when it gets SIGTERM (ray/_private/ray_constants.py)."""
PREEMPTION_POLL_S = 5.0
"""Ray Train's preemption watcher's poll (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, its default)."""

EKS_CAPACITY_TYPE = {"on-demand": "ON_DEMAND", "spot": "SPOT"}
"""The managed node group's capacityType for each gpuCapacityType."""


def save_budget_s(*, step_s: float, check_every: int) -> float:
    """Seconds a checkpoint on notice has, in the worst case, inside Ray's drain: the drain less
    the watcher's poll and the steps until the loop next asks."""
    return SPOT_DRAIN_TIMEOUT_S - PREEMPTION_POLL_S - check_every * step_s


SPOT_NODE_LABEL = {"eks.amazonaws.com/capacityType": "SPOT"}
"""The label EKS puts on every node of a Spot managed node group."""
NODE_TERMINATION_HANDLER_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"},
                                      "limits": {"memory": "128Mi"}}
"""NTH's pod on each Spot GPU node (the chart sets none); its requests are counted against the
worker's size (infra/sizing.py)."""


def node_termination_handler_values() -> dict[str, Any]:
    """Helm values of the aws-node-termination-handler chart: the IMDS-mode DaemonSet on the Spot
    GPU nodes only (their labels, their taint tolerated), draining on the interruption notice at
    once, each pod with its own grace period, and nothing else (module docstring)."""
    return {
        "daemonsetNodeSelector": {**GPU_NODE_LABELS, **SPOT_NODE_LABEL},
        "daemonsetTolerations": [gpu_toleration()],
        "enableSqsTerminationDraining": False,
        "enableSpotInterruptionDraining": True,
        "enableRebalanceMonitoring": False,
        "enableRebalanceDraining": False,
        "enableASGLifecycleDraining": False,
        "enableScheduledEventDraining": True,
        "podTerminationGracePeriod": -1,
        "nodeTerminationGracePeriod": SPOT_NOTICE_S,
        "resources": NODE_TERMINATION_HANDLER_RESOURCES,
    }


def drained_before_reclaim(cfg: StackConfig) -> bool:
    """Whether the GPU nodes are taken back on a known clock with a drain first: Spot (the
    two-minute notice) and a Capacity Block (its scheduled scale-down, infra/reservation.py)."""
    return cfg.is_spot or (cfg.gpu_reservation is not None and cfg.gpu_reservation.is_capacity_block)


def worker_shutdown(cfg: StackConfig) -> tuple[dict[str, int], list[dict[str, str]]]:
    """(pod spec fields, container env) for a Ray worker pod: where the nodes are drained before
    they are taken back (`drained_before_reclaim`), the grace period and Ray's drain timeout above;
    otherwise the defaults (nothing added)."""
    if not drained_before_reclaim(cfg):
        return {}, []
    return ({"terminationGracePeriodSeconds": SPOT_TERMINATION_GRACE_PERIOD_S},
            [{"name": DRAIN_TIMEOUT_ENV, "value": str(SPOT_DRAIN_TIMEOUT_S)}])
