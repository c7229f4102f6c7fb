"""A Spot interruption rehearsed on the local cluster of the RayCluster's shape (a head that runs no
training worker, two worker nodes, checkpoints to an S3 API): worker node 2's `ray start --block`
gets SIGTERM, as the kubelet sends it when EKS drains a Spot node on its notice. Ray marks the node
as draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, Ray Train's watcher tells the loop, which
saves a checkpoint at once; when the node is gone the elastic run (--min-nodes 1) restarts from that
checkpoint on the one node left at the same samples per step, and grows back to two nodes when
node 2 returns. Then node 2 is lost without notice (every process SIGKILLed, as an instance that
goes at once): the run restarts from its latest checkpoint on node 1 and finishes there. The whole
run's loss curve is compared with an uninterrupted run of the same data on two ranks.

Pause points (workloads/launch/faults.py) hold rank 0 at chosen steps so that each event lands at
its moment on a busy machine: the SIGTERM at step 4, the drain running out while the run waits at
step 6, node 2's return while the one-node run waits at step 9, the unannounced loss at step 13.
The figures the test measures are written to the log (docs/RELIABILITY.md records a run).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict

import pytest
from fault_support import BUCKET, fake_s3, paused, steps_logged, wait_for
from test_preemption_elastic import _run as run_loop

from workloads.client import submit
from workloads.client.cluster import connect, job_client
from workloads.client.local import LocalClusterSpec, local_ray_cluster
from workloads.client.outcome import placement_check
from workloads.client.report import completed_losses, loop_summary, resize_events
from workloads.launch.faults import PAUSE_PLAN_ENV, Pause
from workloads.train.config import preset, with_overrides

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

DRAIN_S = 20
"""The worker nodes' drain on SIGTERM (95 s on EKS Spot nodes, infra/spot.py): short, for CI."""
STEPS, CHECKPOINT_EVERY = 16, 4
OVERRIDES = [f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", "micro_batch=2", "seq_len=32",
             "warmup_steps=1", "preemption_check_every=1", "transport.expect=any"]
RUN = "spot"


LOSS_BOUND = 1e-5
"""Relative gap allowed between each step's loss and the uninterrupted run's. The same samples reach
the same steps; what differs is the order of the sums (one rank accumulating two micro-batches
instead of two ranks reducing one each): single steps redone that way differ by about 1e-7
(section 2b of docs/RELIABILITY.md), and fp32 rounding compounds over the steps that follow."""


def test_a_drained_node_checkpoints_at_once_the_run_goes_on_with_one_node_and_grows_back(tmp_path, capsys):
    work = tmp_path
    plan = work / "plan.json"
    pauses = [Pause(point="after-report", run=RUN, step=step, rank=0, max_s=max_s)
              for step, max_s in ((4, 4), (6, DRAIN_S + 30), (9, 120), (13, 120))]
    plan.write_text(json.dumps({"pauses": [asdict(pause) for pause in pauses]}))
    taken = {pause.step: work / pause.marker_name() for pause in pauses}  # each pause's marker, once taken
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
                                           max_failures=2, expect="any", quiet=True, min_nodes=1)
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
            wait_for(taken[9].exists, timeout_s=480,
                     what="the one-node run to reach step 9", job=job)
            cluster.nodes.start(node)
            back_at = time.time()
            # The two-node run again waits at step 13: node 2 is lost without notice.
            wait_for(taken[13].exists, timeout_s=480,
                     what="the grown-back run to reach step 13", job=job)
            cluster.nodes.kill(node)
            killed_at = time.time()
            status = submit.wait_terminal(client, job_id)
            logs = client.get_job_logs(job_id)
    (work / "job.log").write_text(logs)
    assert str(status) == "SUCCEEDED", logs
    # Ended on one node of the two planned: within --min-nodes 1, so submit's placement check passes.
    placement = placement_check(logs)
    assert placement.passed and "at the end, within the elastic run's 1 to 2" in placement.message, placement.message
    events = resize_events(logs.splitlines())
    starts = [(e["workers"], e["why"]) for e in events["worker_group_starts"]]
    # A start of two workers just after a node went may time out (its resources still counted); the
    # starts that trained are the world sizes below.
    assert starts[0] == (2, "start") and (1, "preemption") in starts and (2, "capacity back") in starts, starts
    # The loss without notice is a failure (--max-failures). The drained node's loss is charged to
    # the preemption budget when Ray Train sees the drain first; in one run of four it saw a failed
    # health check of the draining node's worker first and charged --max-failures (2 here, for that).
    assert starts[-1] == (1, "failure"), starts
    (notice,) = events["checkpoints_on_notice"]
    saved_at = notice["seen_unix_s"] + notice["save_s"]
    assert notice["step"] == 5 and saved_at - sigterm_at < DRAIN_S
    world_sizes = [(w["world_size"], w["grad_accum_steps"], w["resumed_from_step"]) for w in events["world_sizes"]]
    # Each start that trained: the same samples per optimizer step on one rank (twice the
    # accumulation), resumed from the checkpoint on notice, the periodic one at 8, the one at 12.
    assert world_sizes == [(2, 1, 0), (1, 2, 5), (2, 1, 8), (1, 2, 12)], world_sizes
    # Each restart downloads its checkpoint once per node; the local nodes share one disk, so once
    # per restart here: the checkpoints of steps 5, 8 and 12, each whole.
    restores = events["restores"]
    assert len(restores) == 3 and len({r["checkpoint"] for r in restores}) == 3, restores
    # Each whole: the ranks' shards, .metadata and progress.json (and Ray Train's own files).
    assert all(r["files"] >= 4 and r["bytes"] > 0 for r in restores), restores
    summary = loop_summary(logs.splitlines())
    assert summary["world_size"] == 1 and summary["steps_done"] == STEPS - 12
    trained = steps_logged(logs)
    assert max(trained) == STEPS

    # The whole run against an uninterrupted one of the same data: each step's loss as the attempt
    # that completed it logged it.
    reference = run_loop(work / "reference", "uninterrupted", 2, {"cfg": train})[0]
    uninterrupted = {r["metrics"]["step"]: r["metrics"]["loss"] for r in reference["reports"]}
    interrupted = completed_losses(logs.splitlines())
    assert sorted(interrupted) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    gaps = [abs(interrupted[s] - uninterrupted[s]) / abs(uninterrupted[s]) for s in range(1, STEPS + 1)]
    assert max(gaps) < LOSS_BOUND, gaps
    figures = {
        "notice_to_checkpoint_s": round(saved_at - sigterm_at, 2),
        "checkpoint_save_s": notice["save_s"],
        "drain_s": DRAIN_S,
        "sigterm_to_node_gone_s": round(node_gone_at - sigterm_at, 1),
        "steps_lost": 6 - notice["step"],
        "world_sizes_accum_resumed_from": world_sizes,
        "node_back_to_kill_s": round(killed_at - back_at, 1),
        "kill_to_end_s": round(time.time() - killed_at, 1),
        "max_relative_loss_gap_vs_uninterrupted": max(gaps),
        "final_loss": [interrupted[STEPS], uninterrupted[STEPS]],
        "preemption_check_ms": summary["preemption_checks"],
        "restores_bytes_s": [(r["bytes"], r["seconds"]) for r in restores],
        "worker_group_starts": starts,
    }
    with capsys.disabled():
        print("\n[spot-rehearsal] " + json.dumps(figures))
