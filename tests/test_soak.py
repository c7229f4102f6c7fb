"""The soak's plan and its checks as data (workloads/rehearse/: soak_plan.py, job_logs.py, soak_checks.py): the
seeded faults, the job logs read as they grow across restarted heads, what each fault cost against its
allowance, memory growth, the bucket's bound and the loss comparison. The soak itself runs in
tests/test_cluster_faults.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from workloads.rehearse.cluster_processes import Process, role_of
from workloads.rehearse.job_logs import JobLogs
from workloads.rehearse.soak import progress_line, storage_figures
from workloads.rehearse.soak_plan import FAULT_KINDS, SoakSettings, plan_faults
from workloads.rehearse.soak_checks import (FAILED, failed_lines, fault_rows, judgeable_at, loss_gaps, memory_growth,
                                            retention)

SETTINGS = SoakSettings(steps=1000, faults=9, seed=5)


def test_the_faults_are_each_kind_once_then_random_ones_in_rising_stretches_of_the_run():
    planned = plan_faults(SETTINGS)
    assert sorted(f.kind for f in planned[:6]) == sorted(FAULT_KINDS) and len(planned) == 9
    steps = [f.step for f in planned]
    assert steps == sorted(steps) and steps[0] >= SETTINGS.warmup_steps and steps[-1] < 0.9 * SETTINGS.steps
    assert all(f.target in ((1, 2) if f.kind == "node-drain" else (0, 1)) for f in planned)
    assert plan_faults(SETTINGS) == planned  # the seed is the plan
    assert plan_faults(dataclasses.replace(SETTINGS, seed=6)) != planned


def test_too_few_steps_for_the_faults_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="steps=30 leaves too few steps for 9 faults .* give more steps"):
        SoakSettings(steps=30, faults=9, seed=1)


def _train(pid: int, step: int, loss: float = 1.0) -> str:
    return f"(RayTrainWorker pid={pid}, ip=127.0.0.2) [train] " + json.dumps({"step": step, "loss": loss})


def test_the_job_logs_are_read_as_they_grow_across_jobs_and_sessions(tmp_path):
    first = tmp_path / "session_2026-12-04_10-00-00_1" / "logs" / "job-driver-soak-job1.log"
    second = tmp_path / "session_2026-12-04_10-05-00_2" / "logs" / "job-driver-soak-job2.log"
    first.parent.mkdir(parents=True)
    second.parent.mkdir(parents=True)
    first.write_text(_train(11, 1) + "\n" + _train(11, 2) + "\n" + _train(11, 2) + "\n" + _train(11, 3)[:20])
    latest = tmp_path / "session_latest"  # Ray's link to the newest session, moved when a head restarts
    latest.symlink_to(first.parent.parent.name)
    logs = JobLogs(tmp_path, "soak")
    logs.read()
    assert logs.attempt_pids == [11] and logs.steps[11] == [1, 2] and logs.latest_step() == 2
    with first.open("a") as f:  # the rest of the half-written line, then a restarted attempt
        f.write(_train(11, 3)[20:] + "\n" + _train(12, 3) + "\n")
    second.write_text(_train(13, 3) + "\n" + _train(13, 4) + "\n")
    latest.unlink()
    latest.symlink_to(second.parent.parent.name)
    logs.read()
    assert logs.attempt_pids == [11, 12, 13] and logs.steps[11] == [1, 2, 3] and logs.latest_step() == 4
    # Each line once: none read again through the link.
    assert len(logs.lines) == 7 and logs.files() == [first, second]
    assert JobLogs(tmp_path, "other").files() == []


def test_the_latest_session_is_never_read_even_while_a_starting_node_remakes_its_link(tmp_path, monkeypatch):
    """Each node that starts removes Ray's session_latest link and makes it again; a glob that lists
    it just before the removal must not keep it (it is no link at that moment, and its files are
    gone when opened)."""
    log = tmp_path / "session_2026-12-05_10-00-00_1" / "logs" / "job-driver-soak-job1.log"
    log.parent.mkdir(parents=True)
    log.write_text(_train(11, 1) + "\n")
    latest = tmp_path / "session_latest"
    latest.symlink_to(log.parent.parent.name)
    listed = list(tmp_path.glob("session_*/logs/job-driver-soak-job*.log"))
    latest.unlink()  # the node's try_to_symlink, between the glob and the checks
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(listed))
    logs = JobLogs(tmp_path, "soak")
    assert logs.files() == [log]
    logs.read()
    assert logs.steps == {11: [1]}


def _logs(attempts: dict[int, list[int]], extra: tuple[str, ...] = ()) -> JobLogs:
    logs = JobLogs(Path("/nonexistent"), "soak")
    for pid, steps in attempts.items():
        for step in steps:
            logs._add(_train(pid, step))
    for line in extra:
        logs._add(line)
    return logs


def _event(kind: str, *, step: int, before: int, after, detail: str = "") -> dict:
    return {"kind": kind, "step": step, "at_s": 10.0, "trained_again_s": 20.0, "attempt_before": before,
            "attempt_after": after, "detail": detail}


def test_each_fault_is_judged_against_its_allowance():
    notice = ('(RayTrainWorker pid=2) [preemption] {"event":"checkpoint-on-notice","step":33,"ranks":[0],'
              '"nodes":["n"],"seen_unix_s":1,"save_s":0.2,"seconds_left_at_save":19}')
    logs = _logs({1: list(range(1, 25)), 2: list(range(21, 41)), 3: list(range(31, 51)), 4: list(range(41, 61)),
                  5: list(range(51, 63))}, extra=(notice,))
    record = {"faults": [
        _event("save-interrupted", step=24, before=1, after=2),  # resumed from 20: 4 steps lost
        _event("node-drain", step=32, before=2, after=3),  # 40 trained, resumed from 30: 10 lost
        _event("storage-down", step=35, before=3, after=None),
        _event("worker-kill", step=50, before=3, after=4),  # 50 trained, resumed from 40: 10 lost
        _event("head-restart", step=60, before=4, after=5, detail="..., complete in storage and not registered"),
    ]}
    rows = fault_rows(record, logs, checkpoint_every=10)
    assert [(r["kind"], r["lost"], r["within"]) for r in rows] == [
        ("save-interrupted", 4, True), ("node-drain", 10, True), ("storage-down", 0, True),
        ("worker-kill", 10, True), ("head-restart", 10, False)]  # in the window it may lose none
    assert rows[1]["notice_step"] == 33
    # An outage that restarted the run, and a drain without a checkpoint on its notice, fail.
    record = {"faults": [_event("tracker-down", step=30, before=2, after=3)]}
    assert not fault_rows(record, logs, checkpoint_every=10)[0]["within"]
    record = {"faults": [_event("node-drain", step=32, before=2, after=3)]}
    assert not fault_rows(record, _logs({2: list(range(21, 41)), 3: [31]}), checkpoint_every=10)[0]["within"]


def _series(pid: int, role: str, rss: list[float], *, start: float = 0.0, every: float = 10.0) -> list[dict]:
    return [{"t": start + i * every, "pid": pid, "role": role, "rss_mib": value} for i, value in enumerate(rss)]


def test_memory_grows_only_when_a_process_grows_after_its_warm_up_while_the_run_trains():
    settings = dataclasses.replace(SETTINGS, memory_warmup_s=30, memory_judged_after_s=60,
                                   memory_growth_limit_mib=64)
    warm_then_flat = [100, 300, 400, *[400] * 12]
    leaking = [100, 300, 400, *[400 + 10 * i for i in range(12)]]
    samples = (_series(1, "driver", warm_then_flat) + _series(2, "train worker", leaking)
               + _series(3, "head", [50, 60]))  # too short a life to judge
    roles = memory_growth(samples, settings=settings, until_s=1000, attempts_trained_s=[0.0])
    assert roles["driver"]["max_growth_mib"] == 0 and roles["driver"]["within"]
    assert roles["train worker"]["max_growth_mib"] == 90 and not roles["train worker"]["within"]
    assert roles["head"]["judged"] == 0 and roles["head"]["max_growth_mib"] is None
    assert roles["train worker"]["longest"] == {"pid": 2, "lived_s": 140, "start_mib": 410.0, "end_mib": 500.0}
    assert roles["head"]["longest"] is None
    # What a process does after training ended (the driver's report) is not growth.
    ends_high = _series(4, "driver", [*warm_then_flat, 800, 800])
    assert memory_growth(ends_high, settings=settings, until_s=140,
                         attempts_trained_s=[0.0])["driver"]["max_growth_mib"] == 0


def test_a_train_workers_warm_up_counts_from_its_attempts_first_step():
    """A worker group started on a just-restarted cluster waits a minute before it trains; its
    growth into training is warm-up, and what it grows after that is judged."""
    settings = dataclasses.replace(SETTINGS, memory_warmup_s=30, memory_judged_after_s=60)
    waits_then_trains = [190, *[190] * 6, 600, 650, 660, *[660] * 10]  # a sample every 10 s from t=100
    worker = _series(7, "train worker", waits_then_trains, start=100)
    # Its attempt first trained at t=170; an earlier attempt's first step (t=20) is not its own.
    judged = memory_growth(worker, settings=settings, until_s=1000, attempts_trained_s=[20.0, 170.0])
    assert judged["train worker"]["max_growth_mib"] == 0 and judged["train worker"]["within"]
    from_start = memory_growth(worker, settings=settings, until_s=1000, attempts_trained_s=[20.0, 100.0])
    assert from_start["train worker"]["max_growth_mib"] == 470 and not from_start["train worker"]["within"]
    never = memory_growth(worker, settings=settings, until_s=1000, attempts_trained_s=[20.0])
    assert never["train worker"]["judged"] == 0
    leaking = _series(8, "train worker", [*waits_then_trains[:10], *[660 + 10 * i for i in range(10)]], start=100)
    assert not memory_growth(leaking, settings=settings, until_s=1000,
                             attempts_trained_s=[170.0])["train worker"]["within"]


def test_a_role_not_judged_says_why_for_its_longest_sampled_process():
    settings = dataclasses.replace(SETTINGS, memory_warmup_s=30, memory_judged_after_s=60)
    short = _series(3, "head", [50, 60, 60, 60, 60, 60])  # t 0..50: warm-up to 30, then 3 samples over 20 s
    never_sampled_after = _series(4, "driver", [100, 100])
    never_trained = _series(5, "train worker", [300] * 10, start=100)
    roles = memory_growth(short + never_sampled_after + never_trained, settings=settings, until_s=1000,
                          attempts_trained_s=[20.0])
    assert roles["head"]["unjudged"] == {"pid": 3, "span_s": 20.0, "why": "3 samples over 20.0 s after its warm-up "
                                         "(t >= 30.0 s), short of 6 samples over 60 s"}
    assert roles["driver"]["unjudged"]["why"] == ("no sample after its warm-up (t >= 30.0 s): its last sample while "
                                                  "the run trained was at t = 10.0 s (training ended at 1000 s)")
    assert roles["train worker"]["unjudged"]["why"] == "it never trained (sampled from t = 100.0 to 190.0 s)"
    judged = memory_growth(_series(6, "head", [60] * 12), settings=settings, until_s=1000, attempts_trained_s=[])
    assert judged["head"]["judged"] == 1 and judged["head"]["unjudged"] is None


def test_the_hold_lasts_until_the_newest_process_of_each_role_can_be_judged():
    """The in-suite soak's run is counted in steps and its judging window in seconds: the soak holds
    the run near its end until each required role's process can be judged, however fast the machine
    trained; this is when."""
    settings = dataclasses.replace(SETTINGS, sample_every_s=2, memory_warmup_s=20, memory_judged_after_s=30)
    samples = (_series(1, "driver", [100] * 30, every=2) + _series(2, "driver", [100] * 10, start=40, every=2)
               + _series(3, "head", [50] * 30, every=2) + _series(4, "train worker", [300] * 5, start=50, every=2)
               + _series(9, "worker node", [10] * 30, every=2))
    # At t = 58 the driver of pid 1 and the head live since t = 0, a driver since 40 (both alive: the
    # earlier is enough), a train worker since 50 whose attempt first trained at 52.
    ready = judgeable_at(samples, settings=settings, attempts_trained_s=[10.0, 52.0])
    assert ready == {"driver": 52.0, "head": 52.0, "train worker": 104.0}  # 20 s warm-up + 30 s + one sample
    assert judgeable_at([], settings=settings, attempts_trained_s=[]) == {}
    # Gone from the latest samples: not waited for.
    assert "train worker" not in judgeable_at(samples + [{"t": 60, "pid": 1, "role": "driver", "rss_mib": 1}],
                                              settings=settings, attempts_trained_s=[52.0])


def test_the_bucket_is_bounded_by_the_checkpoints_kept_plus_two():
    prefix = "runs/soak/"
    objects = [{"key": f"{prefix}checkpoint_a/__0_0.distcp", "bytes": 900},
               {"key": f"{prefix}checkpoint_a/.metadata", "bytes": 100},
               {"key": f"{prefix}checkpoint_b/__0_0.distcp", "bytes": 500},
               {"key": f"{prefix}checkpoint_manager_snapshot.json", "bytes": 10}]
    figures = storage_figures(objects, prefix=prefix)
    assert figures == {"bytes": 1510, "checkpoint_folders": 2, "checkpoint_bytes": [500, 1000]}
    samples = [{"t": 0, **figures}, {"t": 5, "bytes": 4 * 1000 + 10, "checkpoint_folders": 4,
                                     "checkpoint_bytes": [1000] * 4}]
    assert retention(samples, keep=2)["within"]
    samples.append({"t": 10, "bytes": 5 * 1000 + 2**20, "checkpoint_folders": 5, "checkpoint_bytes": [1000] * 5})
    bounded = retention(samples, keep=2)
    assert not bounded["within"] and bounded["bound_bytes"] == 4 * 1000 + 2**20


def test_the_losses_must_be_the_uninterrupted_runs_bit_for_bit():
    reference = {1: 2.0, 2: 1.5, 3: 1.25}
    assert loss_gaps(dict(reference), reference)["within"]
    assert not loss_gaps({1: 2.0, 2: 1.5, 3: 1.2500001}, reference)["within"]
    missing = loss_gaps({1: 2.0, 3: 1.25}, reference)
    assert missing["missing_steps"] == [2] and not missing["within"]


def test_an_attempt_lost_with_its_head_is_judged_by_the_last_step_its_rank_0_wrote_itself(tmp_path):
    """The job log lacks the steps the head's log monitor had not forwarded when the head went; the
    rank's own output file on its node has them, and the steps lost count from there."""
    logs = _logs({1: list(range(1, 28)), 2: list(range(31, 41))})
    own = tmp_path / "session_2026-12-04_10-00-00_1" / "logs" / "worker-ab12-01000000-1.out"
    own.parent.mkdir(parents=True)
    own.write_text("\n".join(f"[train] {json.dumps({'step': step, 'loss': 1.0})}" for step in range(1, 34)) + "\n")
    logs.temp_dir = tmp_path
    assert logs.last_trained(1) == 33 and logs.last_trained(2) == 40  # attempt 2 has no file: the job log's
    event = {**_event("head-restart", step=27, before=1, after=2), "trained_to": logs.last_trained(1)}
    row = fault_rows({"faults": [event]}, logs, checkpoint_every=10)[0]
    assert (row["resumed_from"], row["lost"], row["within"]) == (30, 3, True)
    # Without it, the attempt seems to have stopped before the step the next one resumed from.
    blind = fault_rows({"faults": [_event("head-restart", step=27, before=1, after=2)]}, logs, checkpoint_every=10)[0]
    assert blind["lost"] == -3 and not blind["within"]


def test_a_progress_line_gives_the_step_the_memory_per_role_and_the_bucket():
    processes = [Process(pid=1, role="driver", node=0, rss_mib=300.4, started=1),
                 Process(pid=2, role="train worker", node=1, rss_mib=600.0, started=1),
                 Process(pid=3, role="train worker", node=2, rss_mib=610.0, started=1),
                 Process(pid=4, role="head", node=0, rss_mib=1500.0, started=1)]
    line = progress_line(at_s=90, step=120, steps=3000, attempts=2, processes=processes,
                         storage={"bytes": 3 * 2**20, "checkpoint_folders": 2, "checkpoint_bytes": []})
    assert line == ("  1.5 min  step 120/3000, attempt 2; RSS MiB: driver 300, train worker 1210, head 1500; "
                    "bucket 3.0 MiB in 2 checkpoint folder(s)")
    empty = progress_line(at_s=0, step=0, steps=10, attempts=0, processes=[], storage=None)
    assert empty.endswith("RSS MiB: ; bucket not read yet")


def test_each_failed_check_gets_one_line_that_says_what_failed():
    rows = fault_rows({"faults": [_event("worker-kill", step=50, before=3, after=4)]},
                      _logs({3: list(range(31, 61)), 4: list(range(41, 50))}), checkpoint_every=10)
    checks = {
        "run_succeeded": {"exit_code": 0, "within": True},
        "faults_within_allowance": {"beyond": [r for r in rows if not r["within"]], "within": False},
        "memory": {"roles": {"driver": {"within": False, "pid": 7, "max_growth_mib": 80.0, "judged": 1},
                             "head": {"within": True, "judged": 0,
                                      "unjudged": {"pid": 3, "span_s": 12.0, "why": "4 samples over 12.0 s"}},
                             "train worker": {"within": True, "judged": 2}},
                   "sampler": {"stopped": {"at_s": 44.6, "error": "KeyError: 2", "traceback": "..."}},
                   "within": False},
        "no_shared_memory_left": {"left": ["/dev/shm/torch_1"], "within": False},
    }
    assert failed_lines(checks) == [
        "FAILED faults_within_allowance: worker-kill after step 50 lost 20 step(s), resumed from 40 "
        "(allowance: at most 10 (the checkpoint interval))",
        "FAILED memory: the memory sampler stopped at t = 44.6 s: KeyError: 2 (no sample after it: what follows is "
        "judged on the samples before); driver pid 7 grew 80.0 MiB after its warm-up; no head process was judged "
        "(pid 3, the one sampled longest after its warm-up: 4 samples over 12.0 s)",
        "FAILED no_shared_memory_left: left: /dev/shm/torch_1"]
    assert set(FAILED) >= {"run_succeeded", "every_fault_brought", "no_unplanned_restart", "losses_match_uninterrupted",
                           "retention", "mlflow", "no_process_left"}


def test_the_driver_is_the_python_process_not_the_shell_that_runs_it():
    entry = "python -m workloads.launch.driver --config-json {}"
    assert role_of(entry, node=0) == "driver"
    assert role_of(f"/bin/sh -c {entry}", node=0) == "head"  # Ray's JobSupervisor starts it through a shell
    assert role_of("ray::RayTrainWorker.run", node=1) == "train worker"
    assert role_of("ray::TrainController.run", node=0) == "controller"
    assert role_of("/venv/bin/raylet --node_ip_address=127.0.0.2", node=2) == "worker node"
