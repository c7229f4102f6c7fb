"""Worker loss mid-run: a training worker is SIGKILLed on a two-node local Ray cluster whose
checkpoints go through an S3 API (a moto server on 127.0.0.1, reached through AWS_ENDPOINT_URL_S3
as any S3-compatible store would be). Ray Train restarts the worker group, the loop resumes from the
latest checkpoint in the bucket, and the job still succeeds having redone at most one checkpoint
interval of steps, with its data position carried across the restart."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fault_support import (BUCKET, attempts, bucket_keys, download, fake_s3, progress, steps_logged,
                           train_worker_pids, wait_for)

from workloads.client import submit
from workloads.client.cluster import connect, job_client
from workloads.train.config import preset, with_overrides
from workloads.launch.driver import parse_driver_line
from workloads.launch.storage import resolve_storage
from workloads.client.local import LocalClusterSpec, local_ray_cluster
from workloads.client.report import loop_summary, parse_prefixed

PREFIX = "runs"
STEPS, CHECKPOINT_EVERY = 24, 6
KILL_AFTER_STEP = CHECKPOINT_EVERY + CHECKPOINT_EVERY // 2
"""Kill once this step is logged: the first checkpoint is in the bucket and the next is not due yet."""
WORKERS = 2
MICRO_BATCH = 8


@pytest.fixture()
def s3(monkeypatch):
    with fake_s3(monkeypatch) as server:
        yield server


def redone_losses(first: list[dict], second: list[dict], *, resumed: int) -> tuple[list[float], list[float]]:
    """The losses of the steps both attempts trained (from the resumed checkpoint to the last step
    logged before the kill), first as the killed attempt logged them, then as the restarted one did.
    Raises when there are none, or when one of them is missing: then a comparison would prove nothing."""
    before = {r["step"]: r["loss"] for r in first}
    again = {r["step"]: r["loss"] for r in second}
    redone = list(range(resumed + 1, max(before) + 1))
    if not redone:
        raise AssertionError(f"no step was redone (killed after step {max(before)}, resumed from step "
                             f"{resumed}): the kill must land between two checkpoints")
    missing = [step for step in redone if step not in before or step not in again]
    if missing:
        raise AssertionError(f"redone steps {missing} were not logged by both attempts")
    return [before[step] for step in redone], [again[step] for step in redone]


def test_redone_losses_are_the_steps_after_the_resumed_checkpoint():
    first = [{"step": s, "loss": 10.0 - s} for s in range(1, 10)]
    second = [{"step": s, "loss": 10.0 - s} for s in range(7, 25)]
    assert redone_losses(first, second, resumed=6) == ([3.0, 2.0, 1.0], [3.0, 2.0, 1.0])


def test_a_kill_that_left_nothing_to_redo_proves_nothing_and_fails():
    first = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)]
    second = [{"step": s, "loss": 10.0 - s} for s in range(7, 25)]
    with pytest.raises(AssertionError, match="no step was redone"):
        redone_losses(first, second, resumed=6)
    with pytest.raises(AssertionError, match=r"redone steps \[8\] were not logged by both attempts"):
        redone_losses(first + [{"step": 8, "loss": 2.0}], second[2:], resumed=7)


@pytest.mark.slow
def test_an_s3_storage_path_reaches_the_endpoint_of_the_standard_aws_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic.invalid:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    filesystem, path = resolve_storage("s3://checkpoints/runs")
    assert path == "checkpoints/runs"
    # What Ray Train pickles to the controller and every worker carries the endpoint with it.
    assert filesystem.__reduce__()[1][0]["endpoint_override"] == "http://127.0.0.1:9000"
    assert resolve_storage("/mnt/checkpoints") == (None, "/mnt/checkpoints")
    with pytest.raises(ValueError, match="Unrecognized filesystem type"):
        resolve_storage("nosuch://bucket/prefix")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # reading a checkpoint here
def test_a_killed_worker_is_replaced_and_the_run_resumes_from_its_latest_s3_checkpoint(
    s3, tmp_path
):
    train = with_overrides(preset("demo-cpu"), [
        f"steps={STEPS}", f"checkpoint_every={CHECKPOINT_EVERY}", "log_every=1", f"micro_batch={MICRO_BATCH}",
        "warmup_steps=2", "transport.expect=any",
    ]).to_dict()
    storage = f"s3://{BUCKET}/{PREFIX}"
    run_name = "worker-loss"
    started = time.monotonic()
    with local_ray_cluster(LocalClusterSpec(nodes=2, cpus_per_node=1), log_dir=tmp_path / "ray") as cluster:
        with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
            client = job_client(conn)
            job_id = submit.submit_job(client, submit.SubmitRequest(
                train=train, run_name=run_name, storage_path=storage, max_failures=1, expect="any", quiet=True))

            def checkpointed_and_past() -> bool:
                assert not client.get_job_status(job_id).is_terminal(), client.get_job_logs(job_id)
                steps = steps_logged(client.get_job_logs(job_id))
                metadata = [k for k in bucket_keys(s3, f"{PREFIX}/{run_name}/") if k.endswith("/.metadata")]
                return bool(metadata) and bool(steps) and max(steps) >= KILL_AFTER_STEP

            wait_for(checkpointed_and_past, timeout_s=150, what=f"step {KILL_AFTER_STEP} and a checkpoint in S3")
            pids = train_worker_pids(address=cluster.address, token=cluster.token)
            assert len(pids) == WORKERS, pids
            os.kill(pids[-1], signal.SIGKILL)
            killed_at = time.monotonic()
            status = submit.wait_terminal(client, job_id)
            logs = client.get_job_logs(job_id)
    (tmp_path / "job.log").write_text(logs)  # kept by pytest for a look after a failure
    wall_s = time.monotonic() - started

    assert str(status) == "SUCCEEDED", logs
    runs = attempts(logs)
    assert len(runs) == 2, f"expected one restarted attempt, got {len(runs)}:\n{logs}"
    first, second = runs
    first_attempt, second_attempt = [r["step"] for r in first], [r["step"] for r in second]
    summary = loop_summary(logs.splitlines())
    resumed = summary["resumed_from_step"]
    last_before_kill = max(first_attempt)
    redone = last_before_kill - resumed
    latest_checkpoint = last_before_kill - last_before_kill % CHECKPOINT_EVERY
    # The latest checkpoint, or the one before it when the kill landed while that one was saving.
    assert resumed in (latest_checkpoint, latest_checkpoint - CHECKPOINT_EVERY) and resumed >= CHECKPOINT_EVERY
    assert 1 <= redone <= CHECKPOINT_EVERY
    assert second_attempt[0] == resumed + 1 and max(second_attempt) == STEPS
    assert summary["steps_done"] == STEPS - resumed
    # Model, optimizer and data position all came back: each redone step has the loss it had before.
    losses_before, losses_again = redone_losses(first, second, resumed=resumed)
    assert losses_again == pytest.approx(losses_before, rel=1e-6)
    assert sum(1 for line in logs.splitlines() if parse_prefixed(line, "[transport-gate] ")) >= 2

    finished = next(r for r in map(parse_driver_line, logs.splitlines()) if r and r.get("event") == "finished")
    assert finished["checkpoint"].startswith(f"{BUCKET}/{PREFIX}/{run_name}/checkpoint_")
    keys = bucket_keys(s3, f"{PREFIX}/{run_name}/")
    assert any(key.endswith("/.metadata") for key in keys)
    final = download(s3, finished["checkpoint"].split("/", 1)[1], tmp_path / "final")
    # The data position went on from the checkpoint, not from zero: no sample is seen twice
    # beyond the redone steps.
    assert progress(final) == {"step": STEPS, "data_position": STEPS * MICRO_BATCH * WORKERS}
    print(f"\nfault injection: 1 worker SIGKILLed after step {last_before_kill}, resumed from step {resumed}, "
          f"{redone} step(s) redone, recovered and finished in {time.monotonic() - killed_at:.1f} s, "
          f"wall {wall_s:.1f} s, {len(keys)} objects in s3://{BUCKET}/{PREFIX}/{run_name}/")
