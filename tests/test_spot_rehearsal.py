"""A Spot interruption rehearsed on the local cluster of the RayCluster's shape (a head that runs no
training worker, two worker nodes, checkpoints to an S3 API): worker node 2's `ray start --block`
gets SIGTERM, as the kubelet sends it when EKS drains a Spot node on its notice. Ray marks the node
as draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, Ray Train's watcher tells the loop, which
saves a checkpoint at once; when the node is gone the elastic run (--min-nodes 1) restarts from that
checkpoint on the one node left at the same samples per step, and grows back to two nodes when
node 2 returns.

Pause points (workloads/launch/faults.py) hold rank 0 at chosen steps so that each event lands at
its moment on a busy machine: the SIGTERM at step 4, the drain running out while the run waits at
step 6, node 2's return while the one-node run waits at step 9. The figures the test measures are
written to the log (docs/RELIABILITY.md records a run).
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from fault_support import BUCKET, fake_s3, paused, steps_logged, wait_for

from workloads.client import submit
from workloads.client.cluster import connect, job_client
from workloads.client.local import LocalClusterSpec, local_ray_cluster
from workloads.client.report import loop_summary, resize_events
from workloads.launch.faults import PAUSE_PLAN_ENV
from workloads.train.config import preset, with_overrides

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

DRAIN_S = 20
"""The worker nodes' drain on SIGTERM (95 s on EKS Spot nodes, infra/spot.py): short, for CI."""
STEPS, CHECKPOINT_EVERY = 12, 4
OVERRIDES = [f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", "micro_batch=2", "seq_len=32",
             "warmup_steps=1", "preemption_check_every=1", "transport.expect=any"]
RUN = "spot"


def test_a_drained_node_checkpoints_at_once_the_run_goes_on_with_one_node_and_grows_back(tmp_path, capsys):
    work = tmp_path
    plan = work / "plan.json"
    plan.write_text(json.dumps({"pauses": [
        {"point": "after-report", "run": RUN, "step": 4, "rank": 0, "max_s": 4},
        {"point": "after-report", "run": RUN, "step": 6, "rank": 0, "max_s": DRAIN_S + 30},
        {"point": "after-report", "run": RUN, "step": 9, "rank": 0, "max_s": 120}]}))
    with pytest.MonkeyPatch.context() as env, fake_s3(env):
        env.setenv(PAUSE_PLAN_ENV, str(plan))
        env.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", str(DRAIN_S))
        env.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
        env.setenv("RAY_health_check_period_ms", "500")
        env.setenv("RAY_health_check_initial_delay_ms", "1000")
        with local_ray_cluster(LocalClusterSpec(nodes=2, cpus_per_node=1), log_dir=work / "ray") as cluster, \
                connect(stack=None, address=cluster.address, token=cluster.token) as conn:
            client = job_client(conn)
            train = with_overrides(preset("demo-cpu"), OVERRIDES).to_dict()
            request = submit.SubmitRequest(train=train, run_name=RUN, storage_path=f"s3://{BUCKET}/runs",
                                           max_failures=0, expect="any", quiet=True, min_nodes=1)
            job_id = submit.submit_job(client, request)
            job = (client, job_id)
            paused_at_4 = paused(plan, run=RUN, timeout_s=300, job=job)
            assert paused_at_4["step"] == 4
            node = 2
            sigterm_at = time.time()
            cluster.nodes.procs[node].send_signal(signal.SIGTERM)  # the kubelet, on EKS's drain
            gone = cluster.nodes.procs.pop(node)
            gone.wait(timeout=DRAIN_S + 60)
            node_gone_at = time.time()
            # The one-node run waits at step 9: node 2 comes back, as the node group replaces it.
            wait_for(lambda: (work / f"paused-{RUN}-after-report-step9-rank0.json").exists(), timeout_s=480,
                     what="the one-node run to reach step 9", job=job)
            cluster.nodes.start(node)
            back_at = time.time()
            status = submit.wait_terminal(client, job_id)
            logs = client.get_job_logs(job_id)
    (work / "job.log").write_text(logs)
    assert str(status) == "SUCCEEDED", logs
    events = resize_events(logs.splitlines())
    starts = [(e["workers"], e["why"]) for e in events["worker_group_starts"]]
    assert starts[0] == (2, "start") and (1, "preemption") in starts and starts[-1] == (2, "capacity back"), starts
    (notice,) = events["checkpoints_on_notice"]
    saved_at = notice["seen_unix_s"] + notice["save_s"]
    assert notice["step"] == 5 and saved_at - sigterm_at < DRAIN_S
    one_node = next(w for w in events["world_sizes"] if w["world_size"] == 1)
    # The same samples per optimizer step on one rank: twice the accumulation.
    assert (one_node["grad_accum_steps"], one_node["resumed_from_step"]) == (2, 5)
    two_again = events["world_sizes"][-1]
    assert two_again["world_size"] == 2 and two_again["resumed_from_step"] == 8
    summary = loop_summary(logs.splitlines())
    assert summary["world_size"] == 2 and summary["steps_done"] == STEPS - 8
    trained = steps_logged(logs)
    assert max(trained) == STEPS
    figures = {
        "notice_to_checkpoint_s": round(saved_at - sigterm_at, 2),
        "checkpoint_save_s": notice["save_s"],
        "drain_s": DRAIN_S,
        "sigterm_to_node_gone_s": round(node_gone_at - sigterm_at, 1),
        "steps_lost": 6 - notice["step"],
        "one_node_grad_accum_steps": one_node["grad_accum_steps"],
        "grow_back_resumed_from_step": two_again["resumed_from_step"],
        "node_back_to_end_s": round(time.time() - back_at, 1),
        "preemption_check_ms": summary["preemption_checks"],
        "worker_group_starts": starts,
    }
    with capsys.disabled():
        print("\n[spot-rehearsal] " + json.dumps(figures))
