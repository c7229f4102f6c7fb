"""The faults of a long run on EKS, on a local cluster of the RayCluster's shape (a head that runs no
training worker, two worker nodes) whose checkpoints go to an S3 API (moto): a rank killed while the
checkpoint is written, a whole worker node lost and back, a node lost for good, the head restarted.

Each fault lands at its intended moment: the training process stops at a pause point
(workloads/launch/faults.py, set up through WORKLOADS_PAUSE_PLAN before the nodes start) and the
test brings the fault while it waits there. Ray's node health checks are made faster than their
defaults so that a lost node is noticed in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from fault_support import (BUCKET, attempts, checkpoint_folders, download, fake_s3, paused, progress,
                           steps_logged, train_worker_pids, wait_for)

from workloads.client import submit
from workloads.launch.checkpoints import SNAPSHOT_NAME, registered_names
from workloads.client.cluster import connect, job_client
from workloads.client.local import LocalClusterSpec, local_ray_cluster
from workloads.client.report import WORKER_PID, loop_summary
from workloads.launch.driver import parse_driver_line
from workloads.launch.faults import PAUSE_PLAN_ENV
from workloads.train.config import preset, with_overrides

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

PREFIX = "runs"
STEPS, CHECKPOINT_EVERY, MICRO_BATCH, WORKERS = 8, 2, 2, 2
OVERRIDES = [f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", f"micro_batch={MICRO_BATCH}",
             "seq_len=32", "warmup_steps=1"]
TRAIN = ["--preset", "demo-cpu", *(arg for override in OVERRIDES for arg in ("--set", override))]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The cluster, the bucket and the pause plan every Ray process reads."""
    work = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as env, fake_s3(env) as s3:
        env.setenv(PAUSE_PLAN_ENV, str(work / "plan.json"))
        # A lost raylet is declared dead after 5 failed checks of its health, 0.5 s apart.
        env.setenv("RAY_health_check_period_ms", "500")
        env.setenv("RAY_health_check_initial_delay_ms", "1000")
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
    assert (f"removed 1 incomplete checkpoint(s) that a failed attempt left in storage (written by some ranks, "
            f"never registered): {broken}") in logs
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


def test_a_restarted_head_loses_the_job_and_the_submitter_resubmits_the_run(faults, tmp_path, capsys):
    cluster, s3, work = faults
    run = "head-loss"
    plan = _plan(work, point="after-report", run=run, step=5, rank=1)
    restarted: dict = {}

    def restart_the_head() -> None:
        paused(plan, run=run, timeout_s=240)
        # Ray Train registers a checkpoint once every rank has reported it and writes its snapshot
        # to storage on its own time: the head goes only once step 4's is there, so that the run's
        # latest checkpoint is known (a head lost before that would rightly resume from step 2).
        wait_for(lambda: len(registered_checkpoints(s3, f"{PREFIX}/{run}")) >= 2, timeout_s=60,
                 what="the step-4 checkpoint registered in the run's snapshot")
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
    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        client = job_client(conn)
        assert [job.submission_id for job in client.list_jobs()] == [f"{run}-job2"]  # the new head's only job
        logs = client.get_job_logs(f"{run}-job2")
    summary = loop_summary(logs.splitlines())
    assert summary["resumed_from_step"] == 4 and summary["steps_done"] == STEPS - 4
    assert steps_logged(logs)[0] == 5
    final = _final_checkpoint(s3, logs, tmp_path / "final")
    assert final == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nhead loss: head restarted after step 5 (down {restarted['up'] - restarted['at']:.1f} s), run "
          f"resubmitted and resumed from step 4, 1 step redone, final step {final['step']} at data position "
          f"{final['data_position']}, restart to end {ended - restarted['at']:.1f} s, "
          f"wall {ended - started:.1f} s")
