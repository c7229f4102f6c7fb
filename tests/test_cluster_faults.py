"""The faults of a long run on EKS, on a local cluster of the RayCluster's shape (a head that runs no
training worker, two worker nodes) whose checkpoints go to an S3 API (moto): a node lost for good,
the head restarted in a checkpoint's registration window, a soak that meets six faults in one run
(a worker killed, a node drained and replaced, the head restarted, the tracker and the storage
down, a save interrupted), and a Spot interruption (a drained node, then one lost without notice)
of an elastic run.

Each fault lands at its intended moment: the training process stops at a pause point
(workloads/launch/faults.py, set up through WORKLOADS_PAUSE_PLAN before the nodes start) and the
test brings the fault while it waits there. Ray's node health checks are made faster than their
defaults so that a lost node is noticed in seconds; the worker nodes' drain on SIGTERM and Ray
Train's poll for it are shortened (workloads/rehearse/soak.py's CLUSTER_ENV). The tests share one
cluster and one S3 server: each starts with both worker nodes up, and each run has a name (and a
prefix in the bucket) of its own.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from fault_support import (BUCKET, checkpoint_folders, download, fake_s3, paused, progress,
                           steps_logged, wait_for)
from test_preemption_elastic import _run as run_loop

from workloads.rehearse.services import MlflowServer
from workloads.rehearse.soak import CLUSTER_ENV, Soak
from workloads.rehearse.soak_plan import SoakSettings
from workloads.rehearse.soak_record import Reference, write_record
from workloads.rehearse.soak_checks import judge
from workloads.client import submit
from workloads.client.cluster import free_port
from workloads.launch.checkpoints import SNAPSHOT_NAME, registered_names
from workloads.client.cluster import connect, job_client
from workloads.local.run import LocalClusterSpec, local_ray_cluster
from workloads.client.outcome import placement_check
from workloads.client.report import WORKER_PID, completed_losses, loop_summary, resize_events
from workloads.launch.driver import parse_driver_line
from workloads.launch.faults import PAUSE_PLAN_ENV, Pause, write_plan
from workloads.train.config import preset, with_overrides

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

PREFIX = "runs"
STEPS, CHECKPOINT_EVERY, MICRO_BATCH, WORKERS = 8, 2, 2, 2
OVERRIDES = [f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", f"micro_batch={MICRO_BATCH}",
             "seq_len=32", "warmup_steps=1"]
TRAIN = ["--preset", "demo-cpu", *(arg for override in OVERRIDES for arg in ("--set", override))]

DRAIN_S = int(CLUSTER_ENV["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
"""The worker nodes' drain on SIGTERM (95 s on EKS Spot nodes, infra/spot.py): short, for CI."""


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The cluster, the bucket and the pause plan every Ray process reads."""
    work = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as env, fake_s3(env) as s3:
        env.setenv(PAUSE_PLAN_ENV, str(work / "plan.json"))
        # Lost nodes noticed in seconds, a short drain on SIGTERM, Ray Train's watcher of drains
        # every second (workloads/rehearse/soak.py's CLUSTER_ENV says why each).
        for name, value in CLUSTER_ENV.items():
            env.setenv(name, value)
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
    write_plan(plan, [Pause(**pause)])
    return plan


def _final_checkpoint(s3, logs: str, target: Path) -> dict:
    finished = next(r for r in map(parse_driver_line, logs.splitlines()) if r and r.get("event") == "finished")
    return progress(download(s3, finished["checkpoint"].split("/", 1)[1], target))


def _gate_processes(logs: str) -> set[str]:
    """The worker processes (Ray's `pid=` prefix) that logged a transport gate verdict."""
    return {match.group(1) for line in logs.splitlines() if "[transport-gate] " in line
            and (match := WORKER_PID.search(line))}


def test_a_node_that_does_not_come_back_fails_the_run_with_the_reason(faults, monkeypatch, capsys):
    cluster, s3, work = faults
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
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
        code = submit.main("submit", ["--address", cluster.address, *TRAIN, "--quiet",
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


def test_a_head_lost_before_it_registered_a_complete_checkpoint_costs_no_step_of_it(faults, tmp_path, monkeypatch,
                                                                                     capsys):
    """The head restarts in the window between the step-4 checkpoint's upload by every rank and its
    registration: rank 1 waits after its upload, before its report reaches the controller, so the
    snapshot names step 2's. The resubmitted run resumes from step 4's, complete in storage: a lost
    head costs at most the steps since the newest complete checkpoint."""
    cluster, s3, work = faults
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
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
        code = submit.main("submit", ["--address", cluster.address, *TRAIN, "--quiet",
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
    # Ray Train's retention counts registered checkpoints only: the one resumed from goes once step 6's
    # supersedes it, and no folder Ray does not keep is left (a soak held one too many for the rest of its run).
    assert (f"[checkpoints] removed {restarted['window'][0]}, the never registered checkpoint this attempt resumed "
            "from: the checkpoint of step 6 supersedes it") in logs
    left = checkpoint_folders(s3, f"{PREFIX}/{run}")
    assert restarted["window"][0] not in left and set(left) == registered_checkpoints(s3, f"{PREFIX}/{run}"), left
    final = _final_checkpoint(s3, logs, tmp_path / "final")
    assert final == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nhead loss: head restarted after step 4 (down {restarted['up'] - restarted['at']:.1f} s), run "
          f"resubmitted and resumed from step 4, {STEPS - summary['steps_done'] - 4} step redone, final step "
          f"{final['step']} at data position "
          f"{final['data_position']}, restart to end {ended - restarted['at']:.1f} s, "
          f"wall {ended - started:.1f} s")


SOAK = SoakSettings(steps=250, faults=6, seed=22, tracker_down_s=10, storage_down_s=20, drain_timeout_s=DRAIN_S,
                    sample_every_s=2, memory_warmup_s=20, memory_judged_after_s=30)
"""The soak's short version (250 steps, about 4 minutes alone on two cores): each of its six faults once,
in the seeded order. Seed 22 brings the faults that restart the run first (a node drained, a save
interrupted, a worker killed, then the head restarted in a checkpoint's registration window) and the
outages last, so that the last attempt trains long enough for its workers' memory to be judged (the
soak holds it near its end until then, if it must); the tracker is down 10 s, the storage 20 s
(long enough that the checkpoint it meets is skipped, not stored late). The 30-minute soak of
docs/RELIABILITY.md keeps each down a minute."""


def test_a_soak_meets_each_fault_once_and_the_run_loses_no_more_than_each_allows(faults, tmp_path, capsys):
    """workloads/rehearse/soak.py on this module's cluster: one run meets a worker SIGKILLed, a drained
    node, the head restarted, the tracker and the storage down, and a save interrupted, at seeded
    random steps; every check of the soak holds (docs/RELIABILITY.md, section 8, records a 30-minute
    one). A storage outage skips a checkpoint and the run trains through it; a killed save leaves a
    half-written folder, which the next attempt deletes and does not resume from; the drained node
    is waited for, as a lost one is, until it is back."""
    cluster, s3, work = faults
    tracker = MlflowServer(root=tmp_path / "mlflow", port=free_port())
    tracker.start()
    soak = Soak(cluster, storage=s3.server, bucket=BUCKET, tracker=tracker, plan=work / "plan.json",
                out=tmp_path, settings=SOAK)
    # The uninterrupted run trains in what the soak leaves idle (its faults are mostly waits).
    reference = Reference(SOAK, out=tmp_path / "reference", niceness=10)
    try:
        soak.run()
        record = judge(soak, reference=reference.losses())
    finally:
        reference.stop()
        tracker.kill()
        if not s3.server.up:
            s3.server.start()
    write_record(soak, out=tmp_path)
    failed = {name: check for name, check in record["checks"].items() if not check["within"]}
    assert not failed, f"seed {SOAK.seed}: {json.dumps(failed, default=str)[:4000]} (record in {tmp_path})"
    rows = {row["kind"]: row for row in record["fault_table"]}
    assert sorted(rows) == sorted(("worker-kill", "node-drain", "head-restart", "tracker-down", "storage-down",
                                   "save-interrupted"))
    lines = soak.logs.lines
    # The outage met a checkpoint: skipped on every rank, then the folder it left deleted.
    assert record["skipped_checkpoints"] >= 1 and any("storage answers again: removed the folder(s)" in line
                                                      for line in lines)
    # The killed save cost one checkpoint interval: its half-written folder was deleted, not resumed from.
    assert rows["save-interrupted"]["lost"] == SOAK.checkpoint_every
    assert any("[checkpoints] removed 1 unregistered checkpoint(s): written by some ranks only" in line
               for line in lines)
    assert any("answers again after" in line for line in lines)  # the tracker, back, took what was kept
    # The drained node's loss: the job said it waited for the node, and placed its workers again once back.
    assert any("waiting for a lost node" in line for line in lines) and any("are placed again after" in line
                                                                            for line in lines)
    # The head, lost with a checkpoint complete in storage but not registered, cost no step of it.
    assert rows["head-restart"]["lost"] == 0 and any("complete in storage but never registered" in line
                                                     for line in lines)
    # Every attempt that trained ran the transport gate first, in its new worker group.
    assert {str(pid) for pid in soak.logs.attempt_pids} <= _gate_processes("\n".join(lines))
    assert "is gone from the cluster: its Ray head restarted" in (tmp_path / "submit.txt").read_text()
    figures = {"seed": SOAK.seed, "wall_s": record["wall_s"], "skipped_checkpoints": record["skipped_checkpoints"],
               "faults": [(r["kind"], r["step"], r["lost"], r["recovery_s"]) for r in record["fault_table"]],
               "max_bucket_bytes": record["checks"]["retention"]["max_bytes"],
               "memory_growth_mib": {role: r["max_growth_mib"]
                                     for role, r in record["checks"]["memory"]["roles"].items()},
               "sampler": {key: record["sampler"][key] for key in ("passes", "error_count")}}
    with capsys.disabled():
        print("\n[soak] " + json.dumps(figures))


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
    write_plan(plan, pauses)
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
