"""How much task history the Ray head's GCS keeps: a bound on the head's memory for runs of days.

The GCS keeps the events of the tasks the cluster runs, for the dashboard and the State API, up to
`task_events_max_num_task_in_gcs` task attempts (Ray's default 100,000), the finished ones evicted
first; it remembers each evicted attempt, up to `task_events_max_dropped_task_attempts_tracked_per_job_in_gcs`
per job (default 1,000,000), so that its late events are dropped (src/ray/gcs/gcs_task_manager.cc).
A training run makes tasks for as long as it runs: Ray Train's controller polls every worker and
takes every report, and the loop checks for a preemption notice at every step. Measured on the local
cluster (docs/RELIABILITY.md section 8), a task's events cost the GCS about 8.4 KiB: Ray's defaults
let the head grow by about 0.8 GiB before the cap holds it, which the soak's memory check reads as
growth. These caps keep the last few thousand tasks for the dashboard (the running ones first) and
bound the task history at about 40 MiB, plus a few MiB of evicted attempts' ids.
"""

from __future__ import annotations

TASK_EVENTS_KEPT = 5_000
"""Task attempts whose events the GCS keeps."""
EVICTED_ATTEMPTS_TRACKED = 50_000
"""Evicted task attempts the GCS remembers per job (their late events are dropped, not stored again)."""

TASK_HISTORY_ENV = {
    "RAY_task_events_max_num_task_in_gcs": str(TASK_EVENTS_KEPT),
    "RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs": str(EVICTED_ATTEMPTS_TRACKED),
}
"""The head's environment that sets both (on EKS the head container's, locally every node's)."""
