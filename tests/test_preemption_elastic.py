"""A checkpoint on a drain notice and an elastic run: the asking schedule (every N steps, once per
drain), accumulation rescaled to the world size (a clear error where it cannot divide), the
driver's elastic worker range and preemption budget (checked against Ray 2.58's own FailureConfig
and ScalingConfig), the job log's resize lines; and the loop itself in gloo processes: a notice
saves a checkpoint at once, and a run resumed on one rank from a two-rank checkpoint trains the
next steps with the same samples per step and the same losses."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.client.cluster import free_port
from workloads.client.report import resize_events
from workloads.client.submission import build_submission
from workloads.context import TrainContext
from workloads.launch.driver import WorkerPlan, parse_args, worker_range
from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.train.checkpoint import read_progress
from workloads.train.elastic import ELASTIC_PREFIX, accumulation_for, planned_world_size
from workloads.train.preemption import Notice, PreemptionWatch, notice_record

NOTICE = Notice(deadline_unix_s=1_000_095.0, ranks=(2, 3), nodes=("node-b",))


def test_the_watch_asks_every_n_steps_and_acts_once_per_drain():
    answers = iter([None, NOTICE, NOTICE, Notice(deadline_unix_s=2e6, ranks=(0,), nodes=("node-a",))])
    watch = PreemptionWatch(lambda: next(answers), every=3)
    seen = {step: watch.check(step) for step in range(1, 13)}
    assert [s for s, n in seen.items() if n is not None] == [6, 12]
    assert watch.asks == 4 and watch.summary()["every"] == 3
    assert PreemptionWatch(None, every=1).check(1) is None
    assert PreemptionWatch(lambda: NOTICE, every=0).check(5) is None


def test_the_notice_record_says_the_save_time_and_what_was_left():
    record = notice_record(NOTICE, step=12, seen_unix_s=1_000_040.0, saved_unix_s=1_000_043.5)
    assert (record["save_s"], record["seconds_left_at_save"], record["ranks"]) == (3.5, 51.5, [2, 3])


@pytest.mark.parametrize("world, accum, planned, expected", [(8, 1, 8, 1), (4, 1, 8, 2), (4, 3, 8, 6), (2, 2, 2, 2)])
def test_accumulation_keeps_the_samples_per_step(world, accum, planned, expected):
    assert accumulation_for(world, grad_accum_steps=accum, planned_world_size=planned) == expected
    assert expected * world == accum * planned


def test_a_world_size_that_cannot_keep_the_samples_per_step_is_refused_clearly():
    with pytest.raises(ValueError, match=r"3 ranks cannot keep .* 8 micro-batches .* world sizes that do: 1, 2, 4, 8"):
        accumulation_for(3, grad_accum_steps=1, planned_world_size=8)


def test_min_nodes_makes_an_elastic_worker_range():
    plan = WorkerPlan(num_workers=8, use_gpu=True, cpus_per_worker=11, nodes=2)
    assert worker_range(plan, min_nodes=0) == 8 and worker_range(plan, min_nodes=2) == 8
    assert worker_range(plan, min_nodes=1) == (4, 8)
    with pytest.raises(ValueError, match="more than the 2 node"):
        worker_range(plan, min_nodes=3)
    from ray.train import ScalingConfig

    scaling = ScalingConfig(num_workers=worker_range(plan, min_nodes=1), elastic_resize_monitor_interval_s=10)
    assert scaling.elasticity_enabled


def test_the_driver_takes_min_nodes_and_a_preemption_budget_of_its_own():
    from ray.train import FailureConfig

    args = parse_args(["--config-json", "{}", "--run-name", "r", "--storage-path", "/tmp/s", "--min-nodes", "1",
                       "--max-preemptions", "5"])
    assert (args.min_nodes, args.max_preemptions, args.max_failures) == (1, 5, 1)
    assert parse_args(["--config-json", "{}", "--run-name", "r", "--storage-path", "/tmp/s"]).max_preemptions == -1
    config = FailureConfig(max_failures=1, max_preemption_failures=5)  # Ray 2.58's field, counted apart
    assert config.max_preemption_failures == 5
    with pytest.raises(ValueError, match="--min-nodes"):
        parse_args(["--config-json", "{}", "--run-name", "r", "--storage-path", "/tmp/s", "--min-nodes", "-1"])


def test_submit_passes_min_nodes_to_the_driver():
    sub = build_submission(train={}, run_name="r", storage_path="/tmp/s", max_failures=1, working_dir="/tmp",
                           expect="any", min_nodes=1)
    argv = shlex.split(sub.entrypoint)
    assert argv[argv.index("--min-nodes") + 1] == "1"
    assert "--min-nodes" not in build_submission(train={}, run_name="r", storage_path="/tmp/s", max_failures=1,
                                                 working_dir="/tmp", expect="any").entrypoint


def test_the_job_log_resizes_are_collected_for_the_report():
    lines = ['[driver] {"event": "workers", "planned_workers": 2, "start": 1, "why": "start", "workers": 2}',
             '(RayTrainWorker pid=1) [preemption] {"event":"checkpoint-on-notice","step":6}',
             '(RayTrainWorker pid=1) [preemption] {"event":"checkpoint-on-notice","step":6}',  # Ray's second copy
             '[driver] {"event": "workers", "planned_workers": 2, "start": 2, "why": "preemption", "workers": 1}',
             '(RayTrainWorker pid=2) [restore] {"bytes": 4096, "files": 4, "rank": 0, "seconds": 0.5}',
             '(RayTrainWorker pid=2) [elastic] {"world_size":1,"planned_world_size":2,"grad_accum_steps":2}']
    events = resize_events(lines)
    assert [(e["workers"], e["why"]) for e in events["worker_group_starts"]] == [(2, "start"), (1, "preemption")]
    assert events["checkpoints_on_notice"][0]["step"] == 6 and events["world_sizes"][0]["grad_accum_steps"] == 2
    assert events["restores"] == [{"bytes": 4096, "files": 4, "rank": 0, "seconds": 0.5}]


# --- the loop, in gloo processes ------------------------------------------------------------------

STEPS = 6


def _cfg(**extra) -> dict:
    base = with_overrides(preset("demo-cpu"), [f"steps={STEPS}", "log_every=1", "warmup_steps=1", "eval_every=0",
                                               "checkpoint_every=0", "preemption_check_every=2", "micro_batch=2",
                                               "export_model=false"])
    return with_overrides(base, [f"{k}={v}" for k, v in extra.items()]).to_dict()


def _worker(rank: int, world: int, port: int, root: Path, scenarios: dict[str, dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, scenario in scenarios.items():
            _scenario(rank, world, root, name, scenario)
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, world: int, root: Path, name: str, scenario: dict) -> None:
    reports: list[dict] = []
    # The drain is seen from the `notice_from`-th ask on (every rank the same answer, as Ray's broadcast gives).
    seen_steps = iter(range(2, 100, 2))
    notice_from = scenario.get("notice_from")

    def ask():
        return NOTICE if notice_from is not None and next(seen_steps) >= notice_from else None

    ctx = TrainContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=rank,
                       report=lambda m, checkpoint_dir=None: reports.append(
                           {"metrics": m, "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir)}),
                       latest_checkpoint=lambda: None if scenario.get("resume") is None else Path(scenario["resume"]),
                       scratch_dir=root / name, preemption_notice=ask,
                       planned_world_size=scenario.get("planned", 0))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(TrainConfig.from_dict(scenario["cfg"]), ctx)
    (root / f"{name}-rank{rank}.json").write_text(json.dumps({"summary": summary, "reports": reports,
                                                             "stdout": out.getvalue()}))


def train(cfg, ctx):
    from workloads.train.loop import train as loop_train

    return loop_train(cfg, ctx)


def _run(root: Path, world: int, scenarios: dict[str, dict]) -> dict[str, list[dict]]:
    """The scenarios one after another in one process group of `world` ranks."""
    run_ranks(_worker, args=(world, free_port(), root, scenarios), nprocs=world)
    return {name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(world)]
            for name in scenarios}


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    two = _run(root, 2, {"two": {"cfg": _cfg(), "notice_from": 4}})["two"]
    saved_by_two = str(root / "two" / "checkpoint-0000004")
    ones = _run(root, 1, {
        # An elastic run on one of its two planned ranks: the notice at its first ask (step 6) saves.
        "one": {"cfg": _cfg(), "planned": 2, "resume": saved_by_two, "notice_from": 2},
        # The same checkpoint resumed on one rank by a run that is not elastic.
        "one-not-elastic": {"cfg": _cfg(), "resume": saved_by_two},
    })
    return two, ones["one"], ones["one-not-elastic"]


@pytest.mark.slow
def test_a_notice_saves_a_checkpoint_at_once_and_only_once(loop_runs):
    two, _, _ = loop_runs
    saved = [r["metrics"]["step"] for r in two[0]["reports"] if r["checkpoint_dir"]]
    assert saved == [4]  # checkpoint_every=0: only the notice, seen at the ask of step 4
    (line,) = [ln for ln in two[0]["stdout"].splitlines() if ln.startswith("[preemption] ")]
    assert json.loads(line.split(" ", 1)[1])["step"] == 4
    assert two[0]["summary"]["preemption_checks"]["asks"] == STEPS // 2


@pytest.mark.slow
def test_one_rank_resumes_a_two_rank_run_with_the_same_samples_per_step_and_losses(loop_runs):
    two, (one,), _ = loop_runs
    assert one["summary"]["resumed_from_step"] == 4 and one["summary"]["grad_accum_steps"] == 2
    assert one["summary"]["world_size"] == 1 and one["summary"]["planned_world_size"] == 2
    before = {r["metrics"]["step"]: r["metrics"]["loss"] for r in two[0]["reports"]}
    after = {r["metrics"]["step"]: r["metrics"]["loss"] for r in one["reports"]}
    assert sorted(after) == [5, 6]
    # The same samples in the same order, summed in another order (one rank's accumulation instead
    # of two ranks' reduction): equal to fp32 rounding.
    assert [after[s] for s in (5, 6)] == pytest.approx([before[s] for s in (5, 6)], rel=1e-5)
    assert any(ln.startswith("[elastic] ") for ln in one["stdout"].splitlines())


@pytest.mark.slow
def test_a_run_that_is_not_elastic_resumed_on_fewer_ranks_keeps_its_samples_per_step(loop_runs):
    two, _, (one,) = loop_runs
    summary = one["summary"]
    assert (summary["world_size"], summary["planned_world_size"], summary["grad_accum_steps"]) == (1, 2, 2)
    before = {r["metrics"]["step"]: r["metrics"]["loss"] for r in two[0]["reports"]}
    after = {r["metrics"]["step"]: r["metrics"]["loss"] for r in one["reports"]}
    assert [after[s] for s in (5, 6)] == pytest.approx([before[s] for s in (5, 6)], rel=1e-5)
    (line,) = [ln for ln in one["stdout"].splitlines() if ln.startswith(ELASTIC_PREFIX)]
    said = json.loads(line.removeprefix(ELASTIC_PREFIX))
    assert (said["world_size"], said["planned_world_size"], said["samples_per_step"]) == (1, 2, 4)


@pytest.mark.slow
def test_an_elastic_checkpoint_saved_on_fewer_ranks_resumes_for_its_planned_world_size(loop_runs):
    _, (one,), _ = loop_runs
    (saved,) = [r["checkpoint_dir"] for r in one["reports"] if r["checkpoint_dir"]]
    progress = read_progress(Path(saved))
    assert (progress["world_size"], progress["planned_world_size"]) == (1, 2)
    # Resumed on its two ranks by a run that is not elastic: one micro-step each again, not two halves.
    planned = planned_world_size(world_size=2, elastic_planned=0, saved=progress)
    assert planned == 2 and accumulation_for(2, grad_accum_steps=1, planned_world_size=planned) == 1


@pytest.mark.parametrize(("saved", "elastic_planned", "planned"), [
    ({}, 0, 3),  # a fresh run plans for its ranks
    ({}, 8, 8),  # a fresh elastic run for its largest world size
    ({"world_size": 4, "planned_world_size": 8}, 0, 8),  # an elastic run's checkpoint, resumed as any
    ({"world_size": 8, "planned_world_size": 8}, 16, 8),  # the checkpoint's, not a larger cluster's
    ({"world_size": 4}, 0, 4),  # a checkpoint from before the record: the ranks that saved it
    ({"world_size": 4}, 8, 8),  # ... or, elastic, its largest world size
])
def test_a_resumed_run_plans_for_the_world_size_of_its_checkpoint(saved, elastic_planned, planned):
    assert planned_world_size(world_size=3, elastic_planned=elastic_planned, saved=saved) == planned


def test_a_resume_that_cannot_keep_the_samples_per_step_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"^resuming on 16 ranks cannot keep the samples per optimizer step of the "
                                         r"checkpoint's run, planned for 8 ranks with grad_accum_steps=1: 8 micro-"
                                         r"batches per step do not divide among 16\. Resume on 1, 2, 4, 8 ranks, or "
                                         r"lower micro_batch and raise grad_accum_steps by one factor until 16 "
                                         r"divides grad_accum_steps x 8$"):
        accumulation_for(16, grad_accum_steps=1, planned_world_size=8, cause="resume")
    # Halving micro_batch and doubling grad_accum_steps keeps the samples per step, on 16 ranks too.
    assert accumulation_for(16, grad_accum_steps=2, planned_world_size=8, cause="resume") == 1
