"""The job path of a real cluster, rehearsed on one GPU machine: `python -m workloads.rehearse.rehearsal --out DIR`.

The RayCluster's shape, as `workloads.local.run` builds it: a Ray head that runs no training
worker and two worker nodes, each on its own address and its own GPU(s) (on a one-GPU machine both
share it), each with its own
`NCCL_HOSTID` so that NCCL sees two hosts and carries the traffic between them over its network
transport (sockets on loopback). Checkpoints go to a moto S3 server through `AWS_ENDPOINT_URL_S3`.
Then the user's own command, `python -m workloads submit --address ... --storage-path s3://...` (the
token in its environment, RAY_AUTH_TOKEN), runs three times, each as a subprocess whose output and
exit code are recorded:

  a-any     sockets allowed (--expect any): exit 0, the gate names 2 nodes, checkpoints in the bucket
  b-efa     --expect efa: the gate stops the job before step 1, no retry, exit 1
  c-kill    a worker's training process is SIGKILLed after a checkpoint: the run resumes from S3
  d-node    a whole worker node (raylet, workers) is killed while a rank waits at a pause point after
            step 10; the job says it waits for the node, which is started again: the run resumes from S3
  e-spot    a Spot interruption, elastic (--min-nodes 1): worker node 2's `ray start --block` gets
            SIGTERM as the kubelet sends it on EKS's drain, after step 4; the run saves a checkpoint
            on the notice, goes on with one node once the node has gone, grows back to two when it is
            started again, and finishes on one after the node is then lost without notice; its loss
            curve is compared with an uninterrupted run of the same settings (e-spot-reference)

and the verifier is run on (a)'s per-rank NCCL logs, which are copied to DIR/a-any-nccl/. Needs Ray,
moto and GPUs; DIR/summary.json holds every exit code. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from workloads.rehearse.cluster_processes import train_worker_pids
from workloads.rehearse.services import S3Server, s3_environment
from workloads.launch.faults import Pause, write_plan
from workloads.periodic import pass_error

BUCKET, PREFIX = "rehearsal", "runs"
# A small model keeps checkpoints to moto quick; the job path is the point, not the throughput.
TRAIN_SETTINGS = ["--preset", "qwen2.5-1.5b-synthetic", "--set", "model.name_or_path=tiny-qwen2",
                  "--set", "seq_len=256", "--set", "micro_batch=8", "--set", "log_every=2",
                  "--set", "checkpoint_every=6",
                  "--set", "warmup_steps=2", "--set", "lr=1e-3", "--set", "peak_flops=989e12"]
CASES = ("a-any", "b-efa", "c-kill", "d-node", "e-spot")
KILL_AT_STEP = 10
"""(c) kills a worker once this step is logged: the checkpoint of step 6 is in the bucket, 12's is not."""
NODE_LOSS_STEP = 10
"""(d) loses the node of the last rank once it has reported this step (the checkpoint of step 6 is in
the bucket). A pause is taken only at a reported step: a multiple of log_every (2) or checkpoint_every."""


SPOT_DRAIN_S = 30
"""(e) the worker nodes' drain on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S): 95 s on EKS Spot
nodes (infra/spot.py); shorter here, where the wait is device time."""
SPOT_SETTINGS = ["--set", "steps=16", "--set", "checkpoint_every=4", "--set", "log_every=1",
                 "--set", "preemption_check_every=1"]
SPOT_PAUSES = ((4, 4), (6, SPOT_DRAIN_S + 30), (9, 180), (13, 180))
"""(e) rank 0's pauses after these steps, with how long each may last (s): after 4, node 2 gets its
notice (the loop checkpoints at the next step boundary, 5); after 6 the run waits for the drained
node to go; after 9 (on one node) node 2 is started again; after 13 (two nodes again) it is killed."""


def _say(message: str) -> None:
    print(f"[rehearsal] {message}", flush=True)


def start_s3(port: int):
    """moto's S3 server on 127.0.0.1 with the bucket; the environment every Ray process inherits."""
    server = S3Server(port=port)
    server.start()
    os.environ.update(s3_environment(server.endpoint))
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    return server, client


def bucket_keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def run_logged(argv: list[str], log: Path, *, on_line: Optional[Callable[[str], None]] = None) -> int:
    """Run the user's command, its output to the console and `log`; returns its exit code."""
    with log.open("w") as out:
        out.write("$ " + " ".join(argv) + "\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            out.flush()
            print(line, end="", flush=True)
            if on_line is not None:
                on_line(line)
        code = proc.wait()
        out.write(f"exit code: {code}\n")
    return code


def sockets_allowed(base: list[str], *, s3, out: Path) -> dict:
    """(a): sockets allowed; the per-rank NCCL logs are copied out and verified both ways."""
    from workloads.launch.ray_train import SCRATCH_ROOT

    run = "a-any"
    code = run_logged([*base, "--expect", "any", "--run-name", run], out / f"{run}.txt")
    nccl = out / f"{run}-nccl"
    nccl.mkdir(exist_ok=True)
    for log in sorted((SCRATCH_ROOT / run).glob("rank-*/nccl/*.log")):
        shutil.copy(log, nccl / log.name)
    keys = bucket_keys(s3, f"{PREFIX}/{run}/")
    result = {"exit": code, "checkpoints": sorted({k.split("/")[2] for k in keys if "/checkpoint_" in k})}
    for expect in ("any", "efa"):
        argv = [sys.executable, "-m", "workloads", "verify-transport", *map(str, sorted(nccl.glob("*.log"))),
                "--expect", expect, "--nodes", "2"]
        result[f"verify_{expect}"] = run_logged(argv, out / f"{run}-verify-{expect}.txt")
    return result


def efa_expected(base: list[str], *, out: Path) -> dict:
    """(b): EFA expected where there is none: the gate stops the job before step 1, without a retry."""
    run = "b-efa"
    code = run_logged([*base, "--expect", "efa", "--run-name", run, "--max-failures", "2"], out / f"{run}.txt")
    text = (out / f"{run}.txt").read_text()
    return {"exit": code, "trained_a_step": "train step" in text,
            "gate_failed_lines": text.count("transport gate failed")}


def kill_a_worker(cluster, *, base: list[str], s3, out: Path, steps: int) -> dict:
    """(c): a training worker SIGKILLed midway between checkpoints, once one is in the bucket (Ray
    Train registers a checkpoint a moment after the ranks report it, so a kill right at a save can
    find none registered yet)."""
    run = "c-kill"
    killed: dict = {}

    def kill_after_checkpoint(line: str) -> None:
        words = line.split()
        if killed or words[:2] != ["train", "step"] or int(words[2].split("/")[0]) < KILL_AT_STEP:
            return
        if not any(k.endswith("/.metadata") for k in bucket_keys(s3, f"{PREFIX}/{run}/")):
            return
        pids = train_worker_pids(address=cluster.address, token=cluster.token)
        os.kill(pids[-1], signal.SIGKILL)
        killed.update(pid=pids[-1], after=line.strip(), at=time.time())
        _say(f"SIGKILLed training worker {pids[-1]} after: {line.strip()}")

    code = run_logged([*base, "--expect", "any", "--run-name", run, "--max-failures", "1", "--set", f"steps={steps}"],
                      out / f"{run}.txt", on_line=kill_after_checkpoint)
    resumed = [json.loads(line.split("[train-summary] ", 1)[1]) for line in
               (out / f"{run}.txt").read_text().splitlines() if "[train-summary] " in line]
    return {"exit": code, "killed": killed, "resumed_from_step": resumed[-1]["resumed_from_step"] if resumed else None}


def lose_a_node(cluster, *, base: list[str], run: str, plan: Path, out: Path, rank: int) -> dict:
    """(d): the last rank pauses after step NODE_LOSS_STEP; its whole node is killed; once the job says
    that it waits for the node, the node is started again. Returns what happened, with times."""
    write_plan(plan, [Pause(point="after-report", run=run, step=NODE_LOSS_STEP, rank=rank)])
    events: dict = {}

    def on_line(line: str) -> None:
        marker = next(plan.parent.glob(f"paused-{run}-*.json"), None)
        if marker and "killed_node" not in events:
            pid = json.loads(marker.read_text())["pid"]
            node = cluster.nodes.node_of(pid)
            events.update(killed_node=node, paused_pid=pid)
            if node is None:
                return
            cluster.nodes.kill(node)
            events["killed_at"] = time.time()
            _say(f"killed every process of worker node {node} (rank {rank}'s, pid {pid})")
        if "waiting for a lost node" in line and "restarted_at" not in events and events.get("killed_node"):
            events["first_wait_message_at"] = time.time()
            # Started from another thread: the job's output must go on being read meanwhile.
            _started(restart, record=events, name="restart")

    def restart() -> None:
        events["restarted_at"] = time.time()
        cluster.nodes.start(events["killed_node"])
        events["back_at"] = time.time()
        _say(f"worker node {events['killed_node']} is back")

    code = run_logged([*base, "--expect", "any", "--run-name", run, "--max-failures", "1", "--wait-nodes-s", "180",
                       "--set", f"steps={2 * NODE_LOSS_STEP}"], out / f"{run}.txt", on_line=on_line)
    text = (out / f"{run}.txt").read_text()
    resumed = [json.loads(line.split("[train-summary] ", 1)[1]) for line in text.splitlines()
               if "[train-summary] " in line]
    return {"exit": code, **events, "node_killed": "killed_at" in events,
            "resumed_from_step": resumed[-1]["resumed_from_step"] if resumed else None,
            "placed_again": "placed again" in text}


def _job_logs(cluster, job_id: str) -> str:
    from workloads.client.cluster import connect, job_client

    with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
        return job_client(conn).get_job_logs(job_id)


def _started(target: Callable[[], None], *, record: dict, name: str) -> threading.Thread:
    """`target` on a daemon thread of its own; an exception that ends it goes into the case's record
    (`record[name + "_error"]`, with its traceback) instead of ending the thread without a word."""
    started = time.monotonic()

    def run() -> None:
        try:
            target()
        except Exception as exc:
            record[f"{name}_error"] = asdict(pass_error(exc, at_s=round(time.monotonic() - started, 1)))
            _say(f"{name} failed: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _await_file(path: Path, *, timeout_s: float, what: str, alive: threading.Thread) -> float:
    """Wait for a pause marker while the submit command runs; the time it appeared (epoch s)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not alive.is_alive():
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.time()


def spot_notice(cluster, *, base: list[str], plan: Path, out: Path) -> dict:
    """(e): a drained node (SIGTERM to its `ray start --block`), one node, grow-back, a node lost
    without notice; then the same settings uninterrupted. Returns the events, times (epoch s) and the
    loss curves' largest relative gap."""
    from workloads.client.report import completed_losses, loop_summary, resize_events

    run, node = "e-spot", 2
    pauses = [Pause(point="after-report", run=run, step=step, rank=0, max_s=max_s) for step, max_s in SPOT_PAUSES]
    write_plan(plan, pauses)
    marker = {pause.step: plan.parent / pause.marker_name() for pause in pauses}
    codes: dict = {}
    argv = [*base, "--expect", "any", "--run-name", run, "--min-nodes", "1", "--max-failures", "2", *SPOT_SETTINGS]
    submitter = _started(lambda: codes.update(exit=run_logged(argv, out / f"{run}.txt")), record=codes, name="submit")
    events: dict = {}
    try:
        events["paused_at_4"] = _await_file(marker[4], timeout_s=600, what="step 4", alive=submitter)
        events["sigterm_at"] = time.time()
        gone = cluster.nodes.procs.pop(node)
        gone.send_signal(signal.SIGTERM)  # the kubelet, on EKS's drain of a Spot node
        _say(f"SIGTERM to worker node {node}'s ray start (drain {SPOT_DRAIN_S} s)")
        gone.wait(timeout=SPOT_DRAIN_S + 90)
        events["node_gone_at"] = time.time()
        events["one_node_at_9"] = _await_file(marker[9], timeout_s=600, what="the one-node run's step 9",
                                              alive=submitter)
        cluster.nodes.start(node)
        events["back_at"] = time.time()
        _say(f"worker node {node} is back")
        events["two_nodes_at_13"] = _await_file(marker[13], timeout_s=600, what="the grown-back run's step 13",
                                                alive=submitter)
        cluster.nodes.kill(node)
        events["killed_at"] = time.time()
        _say(f"worker node {node} killed, without notice")
    finally:
        submitter.join()
        if node not in cluster.nodes.procs:
            cluster.nodes.start(node)
    lines = _job_logs(cluster, f"{run}-job1").splitlines()
    (out / f"{run}-job.log").write_text("\n".join(lines) + "\n")
    reference = "e-spot-reference"
    codes["reference_exit"] = run_logged([*base, "--expect", "any", "--run-name", reference, *SPOT_SETTINGS],
                                         out / f"{reference}.txt")
    reference_lines = _job_logs(cluster, f"{reference}-job1").splitlines()
    (out / f"{reference}-job.log").write_text("\n".join(reference_lines) + "\n")
    interrupted, uninterrupted = completed_losses(lines), completed_losses(reference_lines)
    gaps = {step: abs(interrupted[step] - loss) / abs(loss) for step, loss in uninterrupted.items()
            if step in interrupted}
    resizes = resize_events(lines)
    notice = resizes["checkpoints_on_notice"]
    last = max(uninterrupted, default=None)
    return {**codes, **events,
            "notice_to_checkpoint_s": (round(notice[0]["seen_unix_s"] + notice[0]["save_s"] - events["sigterm_at"], 2)
                                       if notice else None),
            "checkpoints_on_notice": notice,
            "worker_group_starts": [(e["workers"], e["why"]) for e in resizes["worker_group_starts"]],
            "world_sizes_accum_resumed_from": [(w["world_size"], w["grad_accum_steps"], w["resumed_from_step"])
                                               for w in resizes["world_sizes"]],
            "restores": resizes["restores"],
            "steps_logged": sorted(interrupted), "reference_steps_logged": sorted(uninterrupted),
            "max_relative_loss_gap_vs_uninterrupted": max(gaps.values()) if gaps else None,
            "relative_loss_gap_by_step": gaps,
            "final_loss": [interrupted.get(last), uninterrupted.get(last)],
            "summary": loop_summary(lines)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.rehearse.rehearsal", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=0, help="default: half the GPUs of this machine")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"which of {', '.join(CASES)} to run, comma-separated (default: all)")
    parser.add_argument("--cpus-only", action="store_true",
                        help="check the harness without GPUs: (a) and (c) on CPU workers (gloo, no gate), no (b)")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases: {', '.join(unknown) or 'none given'}: choose from {', '.join(CASES)}")

    import torch

    from workloads.client.cluster import free_port
    from workloads.local.run import LocalClusterSpec, local_ray_cluster
    from workloads.launch.faults import PAUSE_PLAN_ENV

    gpus = torch.cuda.device_count()
    # One GPU is shared by both nodes: NCCL refuses two ranks on one GPU only within a host
    # (same host hash), and each node has its own NCCL_HOSTID.
    shared = gpus == 1 and not args.gpus_per_node
    per_node = 0 if args.cpus_only else 1 if shared else args.gpus_per_node or gpus // 2
    if not args.cpus_only and not shared and (per_node < 1 or 2 * per_node > gpus):
        print(f"error: two emulated nodes of {per_node} GPU(s) need {2 * per_node} GPUs, this machine has {gpus}",
              file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ[name] = value
    worker_env = tuple(
        {"CUDA_VISIBLE_DEVICES": "0" if shared else ",".join(str(node * per_node + g) for g in range(per_node)),
         "NCCL_HOSTID": f"rehearsal-node-{node}", "NCCL_SOCKET_IFNAME": "lo"}
        for node in range(2)) if per_node else ()
    server, s3 = start_s3(free_port())
    # Every Ray process reads the pause plan of (d); the file is written only for (d).
    pause_plan = out / "pause-plan.json"
    pause_plan.unlink(missing_ok=True)
    os.environ[PAUSE_PLAN_ENV] = str(pause_plan)
    if "d-node" in cases or "e-spot" in cases:
        # A lost raylet is declared dead after 5 failed health checks 0.5 s apart, not Ray's ~30 s.
        os.environ.update({"RAY_health_check_period_ms": "500", "RAY_health_check_initial_delay_ms": "1000"})
    if "e-spot" in cases:
        # Read by each node's `ray start` on SIGTERM, and by Ray Train's poll of the drain.
        os.environ.update({"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(SPOT_DRAIN_S),
                           "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"})
    summary: dict = {"gpus_per_node": per_node, "nodes": 2, "machine_gpus": gpus, "one_gpu_shared": shared,
                     "runs": {}}
    spec = LocalClusterSpec(nodes=2, cpus_per_node=8 * per_node or 1, gpus_per_node=per_node, worker_env=worker_env)
    try:
        with local_ray_cluster(spec, log_dir=out / "ray") as cluster:
            _say(f"cluster up: head + 2 worker nodes x {per_node} GPU, Jobs API {cluster.address}")
            # The submit commands take the token from their environment: a command line is every
            # account's to read (`ps`), and each one run is logged.
            os.environ["RAY_AUTH_TOKEN"] = cluster.token
            base = [sys.executable, "-m", "workloads", "submit", "--address", cluster.address,
                    "--storage-path", f"s3://{BUCKET}/{PREFIX}", "--offline",
                    "--gpus", str(2 * per_node), *TRAIN_SETTINGS, "--set", f"steps={args.steps}"]
            if args.cpus_only:
                base += ["--set", "mixed_precision=false", "--set", "compile=false"]

            if "a-any" in cases:
                summary["runs"]["a-any"] = sockets_allowed(base, s3=s3, out=out)
            if "b-efa" in cases and not args.cpus_only:
                summary["runs"]["b-efa"] = efa_expected(base, out=out)
            if "c-kill" in cases:
                summary["runs"]["c-kill"] = kill_a_worker(cluster, base=base, s3=s3, out=out, steps=2 * args.steps)
            if "d-node" in cases:
                summary["runs"]["d-node"] = lose_a_node(cluster, base=base, run="d-node", plan=pause_plan, out=out,
                                                        rank=2 * per_node - 1 if per_node else 1)
            if "e-spot" in cases:
                summary["runs"]["e-spot"] = spot_notice(cluster, base=base, plan=pause_plan, out=out)
    finally:
        server.stop()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _say(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
