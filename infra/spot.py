"""Spot GPU nodes: the node group's capacity type, and the shutdown timing that fits a checkpoint
inside EC2's two-minute interruption notice. Pure data: no Pulumi.

What happens on a notice: EC2 announces the reclaim 120 s ahead (instance metadata, EventBridge).
An EKS managed node group with Spot capacity enables Capacity Rebalancing on its Auto Scaling
group: on a rebalance recommendation it launches a replacement and drains the old node once the
new one is Ready, and on the two-minute notice it drains the node at once (EKS user guide,
"Managed node groups", Spot capacity). The drain evicts the pod: the kubelet sends the Ray worker
pod's `ray start --block` (PID 1) SIGTERM. Ray marks the node as draining for
`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` before it stops its processes; Ray Train's preemption
watcher sees the drain (it polls every `RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`, 5 s) and the
training loop, which asks at step boundaries (workloads/train/preemption.py), saves a checkpoint
at once. The kubelet SIGKILLs the pod when its termination grace period ends, and EC2 takes the
instance at 120 s whatever is still running.

The budget, from the notice:
- up to ~10 s before the kubelet sends SIGTERM (EKS reacting to the notice and evicting the pod):
  `NOTICE_TO_SIGTERM_S`;
- the pod's grace period, 105 s: it ends at 115 s, 5 s before EC2 takes the instance;
- inside it, Ray's drain timeout, 95 s: Ray stops its own processes (raylet, object store,
  workers) in the 10 s left before the SIGKILL, instead of being killed half-way;
- inside the drain: 5 s until the watcher sees it, up to `check_every` steps until the loop asks,
  then the save and its upload. On a g6.12xlarge the 1.5B model's checkpoint is about 18.5 GB, half
  of it per node, written to local NVMe and uploaded to S3 over the node's 40 Gbps; what is left
  of the 95 s after the first two is the save's budget (docs/RELIABILITY.md has the measured
  figures of the local rehearsal). A save that cannot finish leaves the latest complete checkpoint
  the one to resume from (Ray registers a checkpoint only once every rank has reported it).
"""

from __future__ import annotations

SPOT_NOTICE_S = 120
"""EC2's Spot interruption notice: the instance is reclaimed this long after it."""
NOTICE_TO_SIGTERM_S = 10
"""Allowed for EKS to act on the notice and the kubelet to send the pod SIGTERM."""
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


def worker_shutdown(capacity_type: str) -> tuple[dict[str, int], list[dict[str, str]]]:
    """(pod spec fields, container env) for a Ray worker pod of this capacity type: on Spot, the
    grace period and Ray's drain timeout above; on On-Demand, the defaults (nothing added)."""
    if capacity_type != "spot":
        return {}, []
    return ({"terminationGracePeriodSeconds": SPOT_TERMINATION_GRACE_PERIOD_S},
            [{"name": DRAIN_TIMEOUT_ENV, "value": str(SPOT_DRAIN_TIMEOUT_S)}])
