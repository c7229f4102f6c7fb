"""The faults of a long run on EKS, on a local cluster of the RayCluster's shape (a head that runs no
training worker, two worker nodes) whose checkpoints go to an S3 API (moto): a rank killed while the
checkpoint is written, a whole worker node lost and back, a node lost for good, the head restarted,
and a Spot interruption (a drained node, then one lost without notice) of an elastic run.

Each fault lands at its intended moment: the training process stops at a pause point
(workloads/launch/faults.py, set up through WORKLOADS_PAUSE_PLAN before the nodes start) and the
test brings the fault while it waits there. Ray's node health checks are made faster than their
defaults so that a lost node is noticed in seconds; the worker nodes' drain on SIGTERM and Ray
Train's poll for it are shortened for the Spot rehearsal (the other tests kill with SIGKILL, which
does not drain). The tests share one cluster and one S3 server: each starts with both worker nodes
up, and each run has a name (and a prefix in the bucket) of its own.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from fault_support import (BUCKET, attempts, checkpoint_folders, download, fake_s3, paused, progress,
                           steps_logged, train_worker_pids, wait_for)
from test_preemption_elastic import _run as run_loop

from workloads.client import submit
from workloads.launch.checkpoints import SNAPSHOT_NAME, registered_names
from workloads.client.cluster import connect, job_client
from workloads.client.local import LocalClusterSpec, local_ray_cluster
from workloads.client.outcome import placement_check
from workloads.client.report import WORKER_PID, completed_losses, loop_summary, resize_events
from workloads.launch.driver import parse_driver_line
from workloads.launch.faults import PAUSE_PLAN_ENV, Pause
from workloads.train.config import preset, with_overrides

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

PREFIX = "runs"
STEPS, CHECKPOINT_EVERY, MICRO_BATCH, WORKERS = 8, 2, 2, 2
OVERRIDES = [f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", f"micro_batch={MICRO_BATCH}",
             "seq_len=32", "warmup_steps=1"]
TRAIN = ["--preset", "demo-cpu", *(arg for override in OVERRIDES for arg in ("--set", override))]

DRAIN_S = 20
"""The worker nodes' drain on SIGTERM (95 s on EKS Spot nodes, infra/spot.py): short, for CI."""


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The cluster, the bucket and the pause plan every Ray process reads."""
    work = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as env, fake_s3(env) as s3:
        env.setenv(PAUSE_PLAN_ENV, str(work / "plan.json"))
        # A lost raylet is declared dead after 5 failed checks of its health, 0.5 s apart.
        env.setenv("RAY_health_check_period_ms", "500")
        env.setenv("RAY_health_check_initial_delay_ms", "1000")
        # A SIGTERMed worker node drains for DRAIN_S (the default is 30 s), and Ray Train's watcher
        # looks for a drain every second (5 s by default).
        env.setenv("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", str(DRAIN_S))
        env.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
        with local_ray_cluster(LocalClusterSpec(nodes=2, cpus_per_node=1), log_dir=work / "ray") as cluster:
            yield cluster, s3, work


@pytest.fixture(autouse=True)
def whole_cluster(faults):
    """Each test starts with both worker nodes up, whatever an earlier test left down."""
    cluster = faults[0]
    for index in range(1, cluster.nodes.spec.nodes + 1):
        if index not in cluster.nodes.procs:
            cluster.nodes.start(index)


def _plan(work: Path, **pause) -> Path:
    """The one pause of this test; markers of taken pauses are written beside the plan."""
    plan = work / "plan.json"
    plan.write_text(json.dumps({"pauses": [pause]}))
    return plan


def _request(run_name: str, **extra) -> submit.SubmitRequest:
    train = with_overrides(preset("demo-cpu"), [*OVERRIDES, "transport.expect=any"]).to_dict()
    return submit.SubmitRequest(train=train, run_name=run_name, storage_path=f"s3://{BUCKET}/{PREFIX}",
                                max_failures=1, expect="any", quiet=True, **extra)


def _final_checkpoint(s3, logs: str, target: Path) -> dict:
    finished = next(r for r in map(parse_driver_line, logs.splitlines()) if r and r.get("event") == "finished")
    return progress(download(s3, finished["checkpoint"].split("/", 1)[1], target))


def _check_resumed(logs: str, *, resumed_from: int, last_before: int) -> dict:
    """Two attempts; the second started after the last complete checkpoint and redid its steps
    with the losses they had."""
    runs = attempts(logs)
    assert len(runs) == 2, f"expected one restarted attempt, got {len(runs)}:\n{logs}"
    first, second = runs
    assert max(r["step"] for r in first) == last_before
    summary = loop_summary(logs.splitlines())
    assert summary["resumed_from_step"] == resumed_from and summary["steps_done"] == STEPS - resumed_from
    assert [r["step"] for r in second] == list(range(resumed_from + 1, STEPS + 1))
    before = {r["step"]: r["loss"] for r in first}
    redone = [r for r in second if r["step"] in before]
    assert len(redone) == last_before - resumed_from
    assert [before[r["step"]] for r in redone] == pytest.approx([r["loss"] for r in redone], rel=1e-6)
    return summary


def _gate_processes(logs: str) -> set[str]:
    """The worker processes (Ray's `pid=` prefix) that logged a transport gate verdict."""
    return {match.group(1) for line in logs.splitlines() if "[transport-gate] " in line
            and (match := WORKER_PID.search(line))}


def test_a_rank_killed_while_the_checkpoint_is_written_resumes_from_the_last_complete_one(faults, tmp_path):
    cluster, s3, work = faults
    run = "save-kill"
    plan = _plan(work, point="checkpoint-upload", run=run, step=4, rank=1)
    started = time.monotonic()
    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        client = job_client(conn)
        job_id = submit.submit_job(client, _request(run))
        victim = paused(plan, run=run, timeout_s=240)
        # Rank 0 has written its part of step 4's checkpoint, .metadata included; rank 1's is not there.
        folders = wait_for(lambda: (f := checkpoint_folders(s3, f"{PREFIX}/{run}")) and len(f) == 2
                           and all({".metadata", "__0_0.distcp"} <= files for files in f.values()) and f,
                           timeout_s=60, what="rank 0's part of the step-4 checkpoint in the bucket")
        broken = next(name for name, files in folders.items() if "__1_0.distcp" not in files)
        # The paused process is one of the two live Ray Train workers the State API lists.
        assert victim["pid"] in train_worker_pids(address=cluster.address, token=cluster.token)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        status = submit.wait_terminal(client, job_id)
        logs = client.get_job_logs(job_id)
    (tmp_path / "job.log").write_text(logs)
    assert str(status) == "SUCCEEDED", logs
    # Never loaded: the run went back to step 2, the last checkpoint every rank had written.
    _check_resumed(logs, resumed_from=2, last_before=4)
    # The transport gate ran again in the new worker group, before its first step.
    assert len(_gate_processes(logs)) == 2, logs
    assert (f"removed 1 unregistered checkpoint(s): written by some ranks only, or older than the one the run "
            f"resumes from: {broken}") in logs and "[checkpoints] resuming from" not in logs
    kept = checkpoint_folders(s3, f"{PREFIX}/{run}")
    assert broken not in kept and len(kept) == 2  # --keep-checkpoints 2, each complete
    assert all(files == {".metadata", "__0_0.distcp", "__1_0.distcp", "progress.json"} for files in kept.values())
    final = _final_checkpoint(s3, logs, tmp_path / "final")
    assert final == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nsave kill: rank 1 SIGKILLed during step 4's checkpoint, {broken} removed, resumed from step 2, "
          f"2 steps redone, final step {final['step']} at data position {final['data_position']}, "
          f"kill to end {time.monotonic() - killed_at:.1f} s, wall {time.monotonic() - started:.1f} s")


def test_a_lost_worker_node_is_waited_for_and_the_run_resumes_when_it_is_back(faults, tmp_path):
    cluster, s3, work = faults
    run = "node-loss"
    plan = _plan(work, point="after-report", run=run, step=5, rank=1)
    started = time.monotonic()
    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        client = job_client(conn)
        job_id = submit.submit_job(client, _request(run, wait_nodes_s=60))
        victim = paused(plan, run=run, timeout_s=240)
        node = cluster.nodes.node_of(victim["pid"])
        assert node in (1, 2), victim
        cluster.nodes.kill(node)  # its raylet and every worker on it
        killed_at = time.monotonic()
        wait_for(lambda: "waiting for a lost node" in client.get_job_logs(job_id), timeout_s=120,
                 what="the job to say that it waits for the lost node", poll_s=1)
        waited_at = time.monotonic()
        cluster.nodes.start(node)
        back_at = time.monotonic()
        status = submit.wait_terminal(client, job_id)
        logs = client.get_job_logs(job_id)
    (tmp_path / "job.log").write_text(logs)
    assert str(status) == "SUCCEEDED", logs
    _check_resumed(logs, resumed_from=4, last_before=5)
    assert "workers are placed again after" in logs
    final = _final_checkpoint(s3, logs, tmp_path / "final")
    assert final == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nnode loss: node {node} killed after step 5, first wait message after {waited_at - killed_at:.1f} s, "
          f"node back {back_at - killed_at:.1f} s after the kill, resumed from step 4, 1 step redone, "
          f"final step {final['step']} at data position {final['data_position']}, "
          f"end {time.monotonic() - back_at:.1f} s after it was back, wall {time.monotonic() - started:.1f} s")


def test_a_node_that_does_not_come_back_fails_the_run_with_the_reason(faults, capsys):
    cluster, s3, work = faults
    run = "node-gone"
    plan = _plan(work, point="after-report", run=run, step=1, rank=1)
    killed: dict = {}

    def lose_the_node() -> None:
        victim = paused(plan, run=run, timeout_s=240)
        killed["node"] = cluster.nodes.node_of(victim["pid"])
        cluster.nodes.kill(killed["node"])
        killed["at"] = time.monotonic()

    thread = threading.Thread(target=lose_the_node)
    thread.start()
    try:
        code = submit.main("submit", ["--address", cluster.address, "--token", cluster.token, *TRAIN, "--quiet",
                                      "--storage-path", f"s3://{BUCKET}/{PREFIX}", "--run-name", run,
                                      "--wait-nodes-s", "10"])
        ended = time.monotonic()
    finally:
        thread.join()
        if killed.get("node"):
            cluster.nodes.start(killed["node"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1, out
    assert "job waiting for a lost node: the 2 workers cannot be placed" in out
    assert (f"job {run}-job1 FAILED: error: training failed: the 2 workers could not be placed for") in out
    assert "(--wait-nodes-s 10): a lost node did not come back." in out
    # Bounded: the wait, plus noticing the loss and one start of the group that times out.
    assert ended - killed["at"] < 10 + 45, out
    print(f"\nnode gone: node {killed['node']} killed after step 1, job failed {ended - killed['at']:.1f} s later")


def registered_checkpoints(s3, run_prefix: str) -> set[str]:
    """The checkpoint folders the run's Ray Train snapshot in the bucket registers (none yet: empty)."""
    try:
        text = s3.client.get_object(Bucket=BUCKET, Key=f"{run_prefix}/{SNAPSHOT_NAME}")["Body"].read().decode()
    except s3.client.exceptions.NoSuchKey:
        return set()
    return registered_names(text) or set()


COMPLETE = {".metadata", "progress.json", *(f"__{rank}_0.distcp" for rank in range(WORKERS))}
"""The files of a checkpoint every rank has uploaded (rank 0's metadata and progress, each rank's shard)."""


def test_a_head_lost_before_it_registered_a_complete_checkpoint_costs_no_step_of_it(faults, tmp_path, capsys):
    """The head restarts in the window between the step-4 checkpoint's upload by every rank and its
    registration: rank 1 waits after its upload, before its report reaches the controller, so the
    snapshot names step 2's. The resubmitted run resumes from step 4's, complete in storage: a lost
    head costs at most the steps since the newest complete checkpoint."""
    cluster, s3, work = faults
    run = "head-loss"
    plan = _plan(work, point="checkpoint-uploaded", run=run, step=4, rank=1)
    restarted: dict = {}

    def complete_unregistered() -> list[str]:
        registered = registered_checkpoints(s3, f"{PREFIX}/{run}")
        return [name for name, files in checkpoint_folders(s3, f"{PREFIX}/{run}").items()
                if COMPLETE <= files and name not in registered]

    def restart_the_head() -> None:
        paused(plan, run=run, timeout_s=240)
        restarted["window"] = wait_for(complete_unregistered, timeout_s=60,
                                       what="the step-4 checkpoint uploaded by every rank, not registered")
        restarted["registered"] = sorted(registered_checkpoints(s3, f"{PREFIX}/{run}"))
        restarted["at"] = time.monotonic()
        cluster.nodes.restart_head()
        restarted["up"] = time.monotonic()

    thread = threading.Thread(target=restart_the_head)
    thread.start()
    started = time.monotonic()
    try:
        code = submit.main("submit", ["--address", cluster.address, "--token", cluster.token, *TRAIN, "--quiet",
                                      "--storage-path", f"s3://{BUCKET}/{PREFIX}", "--run-name", run])
    finally:
        thread.join()
    ended = time.monotonic()
    out = " ".join(capsys.readouterr().out.split())
    (tmp_path / "submit.out").write_text(out)
    assert code == 0, out
    assert f"job submitted {run}-job1" in out and "train step 5/8" in out
    assert (f"job {run}-job1 is gone from the cluster: its Ray head restarted and kept no job; submitting run {run} "
            "again (1 of 3), to resume from its latest checkpoint") in out
    assert f"job submitted {run}-job2" in out and f"job {run}-job2 SUCCEEDED" in out
    assert "train step 8/8" in out and "train step 4/8" not in out.split(f"submitted {run}-job2")[1]
    # The head went with step 2's checkpoint the only one registered and step 4's complete beside it.
    assert len(restarted["registered"]) == 1 and len(restarted["window"]) == 1
    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        client = job_client(conn)
        assert [job.submission_id for job in client.list_jobs()] == [f"{run}-job2"]  # the new head's only job
        logs = client.get_job_logs(f"{run}-job2")
    summary = loop_summary(logs.splitlines())
    assert summary["resumed_from_step"] == 4 and summary["steps_done"] == STEPS - 4
    assert steps_logged(logs)[0] == 5
    assert f"[checkpoints] resuming from {restarted['window'][0]} (step 4): complete in storage but never " \
           "registered" in logs
    final = _final_checkpoint(s3, logs, tmp_path / "final")
    assert final == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nhead loss: head restarted after step 4 (down {restarted['up'] - restarted['at']:.1f} s), run "
          f"resubmitted and resumed from step 4, {STEPS - summary['steps_done'] - 4} step redone, final step "
          f"{final['step']} at data position "
          f"{final['data_position']}, restart to end {ended - restarted['at']:.1f} s, "
          f"wall {ended - started:.1f} s")


# A Spot interruption rehearsed on the same cluster: worker node 2's `ray start --block`
# gets SIGTERM, as the kubelet sends it when EKS drains a Spot node on its notice. Ray marks the node
# as draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, Ray Train's watcher tells the loop, which
# saves a checkpoint at once; when the node is gone the elastic run (--min-nodes 1) restarts from that
# checkpoint on the one node left at the same samples per step, and grows back to two nodes when
# node 2 returns. Then node 2 is lost without notice (every process SIGKILLed, as an instance that
# goes at once): the run restarts from its latest checkpoint on node 1 and finishes there. The whole
# run's loss curve is compared with an uninterrupted run of the same data on two ranks.
#
# Pause points (workloads/launch/faults.py) hold rank 0 at chosen steps so that each event lands at
# its moment on a busy machine: the SIGTERM at step 4, the drain running out while the run waits at
# step 6, node 2's return while the one-node run waits at step 9, the unannounced loss at step 13.
# The figures the test measures are written to the log (docs/RELIABILITY.md records a run).

SPOT_STEPS, SPOT_CHECKPOINT_EVERY = 16, 4
SPOT_OVERRIDES = [f"steps={SPOT_STEPS}", f"checkpoint_every={SPOT_CHECKPOINT_EVERY}", "log_every=1", "micro_batch=2",
                  "seq_len=32", "warmup_steps=1", "preemption_check_every=1", "transport.expect=any"]
SPOT_RUN = "spot"

LOSS_BOUND = 1e-5
"""Relative gap allowed between each step's loss and the uninterrupted run's. The same samples reach
the same steps; what differs is the order of the sums (one rank accumulating two micro-batches
instead of two ranks reducing one each): single steps redone that way differ by about 1e-7
(section 2b of docs/RELIABILITY.md), and fp32 rounding compounds over the steps that follow."""


def test_a_drained_node_checkpoints_at_once_the_run_goes_on_with_one_node_and_grows_back(faults, tmp_path, capsys):
    cluster, _, work = faults
    plan = work / "plan.json"
    pauses = [Pause(point="after-report", run=SPOT_RUN, step=step, rank=0, max_s=max_s)
              for step, max_s in ((4, 4), (6, DRAIN_S + 30), (9, 120), (13, 120))]
    plan.write_text(json.dumps({"pauses": [asdict(pause) for pause in pauses]}))
    taken = {pause.step: work / pause.marker_name() for pause in pauses}  # each pause's marker, once taken
    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        client = job_client(conn)
        train = with_overrides(preset("demo-cpu"), SPOT_OVERRIDES).to_dict()
        request = submit.SubmitRequest(train=train, run_name=SPOT_RUN, storage_path=f"s3://{BUCKET}/{PREFIX}",
                                       max_failures=2, expect="any", quiet=True, min_nodes=1)
        job_id = submit.submit_job(client, request)
        job = (client, job_id)
        paused_at_4 = paused(plan, run=SPOT_RUN, timeout_s=300, job=job)
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
    (tmp_path / "job.log").write_text(logs)
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
    assert summary["world_size"] == 1 and summary["steps_done"] == SPOT_STEPS - 12
    trained = steps_logged(logs)
    assert max(trained) == SPOT_STEPS

    # The whole run against an uninterrupted one of the same data: each step's loss as the attempt
    # that completed it logged it.
    reference = run_loop(tmp_path / "reference", 2, {"uninterrupted": {"cfg": train}})["uninterrupted"][0]
    uninterrupted = {r["metrics"]["step"]: r["metrics"]["loss"] for r in reference["reports"]}
    interrupted = completed_losses(logs.splitlines())
    assert sorted(interrupted) == sorted(uninterrupted) == list(range(1, SPOT_STEPS + 1))
    gaps = [abs(interrupted[s] - uninterrupted[s]) / abs(uninterrupted[s]) for s in range(1, SPOT_STEPS + 1)]
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
        "final_loss": [interrupted[SPOT_STEPS], uninterrupted[SPOT_STEPS]],
        "preemption_check_ms": summary["preemption_checks"],
        "restores_bytes_s": [(r["bytes"], r["seconds"]) for r in restores],
        "worker_group_starts": starts,
    }
    with capsys.disabled():
        print("\n[spot-rehearsal] " + json.dumps(figures))
