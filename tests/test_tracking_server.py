"""Tracking against a real `mlflow server` on 127.0.0.1 (sqlite store, local artifacts), read back with
MLflow's own client: the parameters, every metric's full history, the tags and events, the summary,
a resumed run continuing the same run (by the id kept with its checkpoint, or by its name), the
training loop in two gloo ranks, and a server killed mid-run that comes back while training goes on."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.rehearse.services import MlflowServer, kill_group
from workloads.client.cluster import free_port
from workloads.context import SUMMARY_PREFIX, TRACKING_PREFIX, TrainContext
from workloads.train import tracking
from workloads.train.checkpoint import PROGRESS_FILE, Progress, read_progress
from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.train.parallel import MeshPlan

pytestmark = pytest.mark.slow

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = MlflowServer(root=tmp_path_factory.mktemp("mlflow"), port=free_port())
    running.start()
    try:
        yield running
    finally:
        running.kill()


def client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def history(mlflow, run_id: str, key: str) -> list[tuple[int, float]]:
    """Every logged value of a metric, in the order logged: (step, value)."""
    return [(m.step, m.value) for m in sorted(mlflow.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


def tracking_lines(stdout: str) -> list[dict]:
    return [json.loads(line.split(TRACKING_PREFIX, 1)[1]) for line in stdout.splitlines()
            if TRACKING_PREFIX + "{" in line]


def test_a_run_its_history_and_its_continuations_read_back(server):
    cfg = with_overrides(preset("demo-cpu"), [f"tracking.uri={server.uri}", "tracking.experiment=direct",
                                              "tracking.run_name=direct-1", 'tracking.tags={"stack":"local"}'])
    plan = MeshPlan(kind="fsdp", ranks=((0, 1),), nodes=1, reason="")
    said: list[str] = []

    def run(progress: Progress, steps: range, settings: TrainConfig = cfg) -> tracking.Tracker:
        tracker = tracking.start(settings, rank=0, progress=progress, world_size=2, nodes=1, plan=plan,
                                 say=said.append)
        for n in steps:
            tracker.log_step({"step": n, "loss": 3.0 / n, "lr": 1e-3 * n, "tokens_per_s_per_device": 50.0 + n,
                              "mfu": None, "peak_mem_gib": 0.5, "grad_norm": 1.0 / n,
                              **({"eval_loss": 2.5 / n} if n % 2 == 0 else {})})
        tracker.finish({"steps_done": len(steps), "resumed_from_step": progress.step,
                        "tokens_per_s_per_device": 55.0, "mfu": None})
        return tracker

    first = run(Progress(step=0, data_position=0), range(1, 5))
    run_id = first.run_id
    mlflow = client(server.uri)
    got = mlflow.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "direct-1"
    assert got.data.params == tracking.config_params(cfg)
    assert {k: got.data.tags[k] for k in ("stack", "world_size", "nodes", "parallelism", tracking.RUN_NAME_TAG)} == {
        "stack": "local", "world_size": "2", "nodes": "1", "parallelism": "fsdp 2", tracking.RUN_NAME_TAG: "direct-1"}
    assert history(mlflow, run_id, "train_loss") == [(n, pytest.approx(3.0 / n)) for n in range(1, 5)]
    assert history(mlflow, run_id, "eval_loss") == [(2, 1.25), (4, 0.625)]
    assert [s for s, _ in history(mlflow, run_id, "lr")] == [1, 2, 3, 4]
    assert history(mlflow, run_id, "mean_tokens_per_s_per_device") == [(4, 55.0)]
    assert "mfu" not in got.data.metrics
    summary = json.loads(Path(mlflow.download_artifacts(run_id, "summary.json")).read_text())
    assert summary["steps_done"] == 4

    # Resumed from a checkpoint that names the run (under another run name, so only the id finds it),
    # on fewer ranks than saved it, with a changed setting.
    other = with_overrides(cfg, ["tracking.run_name=renamed", "steps=300"])
    second = run(Progress(step=4, data_position=32, world_size=4, tracking_run_id=run_id), range(5, 7), other)
    assert second.run_id == run_id
    # Resumed from a checkpoint saved before the run was open: found again by its run name.
    third = run(Progress(step=6, data_position=48, world_size=2), range(7, 9))
    assert third.run_id == run_id
    got = mlflow.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert history(mlflow, run_id, "train_loss") == [(n, pytest.approx(3.0 / n)) for n in range(1, 9)]
    assert history(mlflow, run_id, "world_size") == [(0, 2.0), (4, 2.0), (6, 2.0)]
    assert got.data.tags["event.step-0000004.resize"] == ("resumed after step 4 on 2 ranks (1 node(s)), was 4; 16 "
                                                          "samples per optimizer step kept with grad_accum_steps=1")
    assert got.data.tags["event.step-0000006.restart"] == "resumed after step 6 on 2 ranks (1 node(s))"
    assert got.data.tags["params_changed.step-0000004"] == "steps: 200 -> 300"
    assert got.data.params["steps"] == "200"  # parameters are immutable in MLflow
    assert [line["continued"] for line in map(json.loads, (s.removeprefix(TRACKING_PREFIX) for s in said
                                                             if s.startswith(TRACKING_PREFIX + "{")))] == [
        False, True, True]
    assert len(mlflow.search_runs([got.info.experiment_id])) == 1
    assert not [s for s in said if "warning" in s]


def recorder(reports: list[dict], on_report=None):
    def report(metrics: dict, checkpoint_dir: Path | None = None) -> None:
        reports.append({"metrics": metrics, "at": time.monotonic(),
                        "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir)})
        if on_report is not None:
            on_report(metrics)

    return report


def restart_server_at(step: int, plan: dict):
    """Rank 0's report hook of the goes-away scenario: at `step`, kill the server's process group and
    start it again on the same port and store (not waiting for it: training goes on meanwhile)."""

    def hook(metrics: dict) -> None:
        if metrics.get("step") != step:
            return
        kill_group(plan["server_pid"])
        again = MlflowServer(root=Path(plan["server_root"]), port=plan["server_port"])
        again.start(wait_s=0)
        Path(plan["restarted_pid_file"]).write_text(str(again.proc.pid))
        Path(plan["killed_at_file"]).write_text(str(time.monotonic()))

    return hook


def worker(rank: int, port: int, root: Path, plan: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for name, scenario in plan["scenarios"].items():
            resume_from = scenario.get("resume_from")
            if resume_from and scenario.get("saved_world_size"):
                if rank == 0:  # as if a run of another size had saved it
                    copy = root / f"{name}-resume"
                    shutil.copytree(resume_from, copy)
                    saved = read_progress(copy)
                    (copy / PROGRESS_FILE).write_text(json.dumps({**saved, "world_size": scenario["saved_world_size"],
                                                                  "planned_world_size": scenario["saved_world_size"]}))
                dist.barrier()
                resume_from = str(root / f"{name}-resume")
            if scenario.get("preimport_mlflow") and rank == 0:
                import mlflow  # noqa: F401  (the tracker's import is then not the slow part of opening)
            reports: list[dict] = []
            hook = restart_server_at(scenario["kill_at_step"], plan) if rank == 0 and "kill_at_step" in scenario \
                else None
            ctx = TrainContext(rank=rank, world_size=WORLD_SIZE, local_rank=rank, local_world_size=WORLD_SIZE,
                               node_rank=0, report=recorder(reports, hook),
                               latest_checkpoint=lambda r=resume_from: Path(r) if r else None,
                               scratch_dir=root / name)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                summary = train_loop(TrainConfig.from_dict(scenario["cfg"]), ctx)
            record = {"summary": summary, "reports": reports, "stdout": out.getvalue(),
                      "mlflow_imported": any(m.split(".")[0] == "mlflow" for m in sys.modules),
                      "ended": time.monotonic()}
            (root / f"{name}-rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def train_loop(cfg: TrainConfig, ctx: TrainContext) -> dict:
    from workloads.train.loop import train

    return train(cfg, ctx)


def spawn(root: Path, plan: dict) -> dict[str, list[dict]]:
    root.mkdir(parents=True, exist_ok=True)
    wire = {**plan, "scenarios": {name: {**s, "cfg": s["cfg"].to_dict()} for name, s in plan["scenarios"].items()}}
    run_ranks(worker, args=(free_port(), root, wire), nprocs=WORLD_SIZE)
    return {name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
            for name in plan["scenarios"]}


def test_the_loop_tracks_on_rank_0_and_a_resumed_run_continues_it(server, tmp_path):
    demo = with_overrides(preset("demo-cpu"), ["eval_every=10", "eval_batches=1", "log_every=5",
                                               "checkpoint_every=10", "warmup_steps=2"])
    tracked = with_overrides(demo, [f"tracking.uri={server.uri}", "tracking.experiment=loop",
                                    "tracking.run_name=loop-a"])
    plan = {"scenarios": {
        "plain": {"cfg": with_overrides(demo, ["steps=5", "checkpoint_every=0", "eval_every=0"])},
        "a": {"cfg": with_overrides(tracked, ["steps=30"]), "preimport_mlflow": True},
        # Resubmitted under another name from a's last checkpoint, which names a's tracker run; its
        # progress.json says 4 ranks saved it: a resize.
        "b": {"cfg": with_overrides(tracked, ["steps=40", "tracking.run_name=loop-b"]),
              "resume_from": str(tmp_path / "a" / "checkpoint-0000030"), "saved_world_size": 4},
    }}
    records = spawn(tmp_path, plan)

    # Without a URI the loop never imported MLflow (checked before any tracked run in these processes).
    assert [r["mlflow_imported"] for r in records["plain"]] == [False, False]
    assert TRACKING_PREFIX not in records["plain"][0]["stdout"]
    # Only rank 0 tracks.
    assert TRACKING_PREFIX not in records["a"][1]["stdout"] + records["b"][1]["stdout"]
    (opened,) = tracking_lines(records["a"][0]["stdout"])
    run_id = opened["run_id"]
    assert opened["continued"] is False and opened["experiment"] == "loop"
    assert read_progress(tmp_path / "a" / "checkpoint-0000030")["tracking_run_id"] == run_id
    (continued,) = tracking_lines(records["b"][0]["stdout"])
    assert continued == {**opened, "continued": True}

    mlflow = client(server.uri)
    got = mlflow.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params == tracking.config_params(plan["scenarios"]["a"]["cfg"])
    reported = {r["metrics"]["step"]: r["metrics"] for r in records["a"][0]["reports"] + records["b"][0]["reports"]}
    assert sorted(reported) == list(range(5, 41, 5))
    for metric, key in tracking.STEP_METRICS.items():
        want = [(s, pytest.approx(m[metric])) for s, m in sorted(reported.items()) if m.get(metric) is not None]
        assert history(mlflow, run_id, key) == want, key
    assert [s for s, _ in history(mlflow, run_id, "eval_loss")] == [10, 20, 30, 40]
    assert "mfu" not in got.data.metrics  # None on CPU: not logged
    assert history(mlflow, run_id, "world_size") == [(0, 2.0), (30, 2.0)]
    tags = got.data.tags
    assert (tags["world_size"], tags["nodes"], tags["parallelism"]) == ("2", "1", "fsdp 2")
    # Two micro-steps on each of the 2 ranks keep the 4 ranks' samples per step.
    assert tags["event.step-0000030.resize"] == ("resumed after step 30 on 2 ranks (1 node(s)), was 4; 32 samples "
                                                 "per optimizer step kept with grad_accum_steps=2")
    assert tags["params_changed.step-0000030"] == "grad_accum_steps: 1 -> 2; steps: 30 -> 40"
    summary = json.loads(Path(mlflow.download_artifacts(run_id, "summary.json")).read_text())
    assert summary == records["b"][0]["summary"]
    assert len(mlflow.search_runs([got.info.experiment_id])) == 1


def test_a_server_that_goes_away_mid_run_neither_stops_nor_holds_up_training(tmp_path):
    away = MlflowServer(root=tmp_path / "mlflow", port=free_port())
    away.start()
    restarted_pid = tmp_path / "restarted.pid"
    try:
        cfg = with_overrides(preset("demo-cpu"), [
            "steps=12", "log_every=1", "checkpoint_every=0", "eval_every=0", "warmup_steps=2",
            f"tracking.uri={away.uri}", "tracking.experiment=away", "tracking.run_name=away-1",
            "tracking.flush_timeout_s=180"])
        plan = {"scenarios": {"away": {"cfg": cfg, "kill_at_step": 3, "preimport_mlflow": True}},
                "server_pid": away.proc.pid, "server_root": str(away.root), "server_port": away.port,
                "restarted_pid_file": str(restarted_pid), "killed_at_file": str(tmp_path / "killed_at")}
        records = spawn(tmp_path / "runs", plan)
        first = records["away"][0]
        lines = first["stdout"].splitlines()
        assert first["summary"]["steps_done"] == 12
        warned = [i for i, line in enumerate(lines) if "did not answer" in line]
        back = [i for i, line in enumerate(lines) if "answers again" in line]
        summary_at = next(i for i, line in enumerate(lines) if line.startswith(SUMMARY_PREFIX))
        # One warning; the last nine steps and the summary came before the server was back.
        assert len(warned) == 1 and len(back) == 1 and warned[0] < summary_at < back[0], first["stdout"]
        steps_after_kill = [r["at"] for r in first["reports"] if r["metrics"]["step"] > 3]
        assert len(steps_after_kill) == 9

        # The store, read back through the server rank 0 started again on it (the tracker's flush
        # after the summary went there).
        restarted = MlflowServer(root=away.root, port=away.port)
        restarted.wait_up()
        (opened,) = tracking_lines(first["stdout"])
        mlflow = client(restarted.uri)
        got = mlflow.get_run(opened["run_id"])
        assert got.info.status == "FINISHED"
        losses = {r["metrics"]["step"]: r["metrics"]["loss"] for r in first["reports"]}
        assert history(mlflow, opened["run_id"], "train_loss") == [
            (s, pytest.approx(losses[s])) for s in range(1, 13)]
        assert len(mlflow.search_runs([got.info.experiment_id])) == 1
    finally:
        away.kill()
        if restarted_pid.exists():
            kill_group(int(restarted_pid.read_text()))


def test_the_driver_tags_the_run_with_its_final_checkpoint_and_exported_model(server, tmp_path):
    from pyarrow.fs import LocalFileSystem

    from workloads.launch.driver import tell_tracker_where

    mlflow = client(server.uri)
    experiment = mlflow.create_experiment("driver")
    run_id = mlflow.create_run(experiment).info.run_id
    final = tmp_path / "run" / "checkpoint_2026-12-02_10-00-00.000000"
    (final / "model").mkdir(parents=True)
    (final / "model" / "model.safetensors").write_bytes(b"weights")
    (final / PROGRESS_FILE).write_text(json.dumps({"step": 4, "data_position": 32, "world_size": 2,
                                                   "tracking_run_id": run_id}))
    train = with_overrides(preset("demo-cpu"), [f"tracking.uri={server.uri}"]).to_dict()
    assert tell_tracker_where(train, filesystem=LocalFileSystem(), path=str(final))
    tags = mlflow.get_run(run_id).data.tags
    assert tags["checkpoint"] == str(final) and tags["model_location"] == str(final / "model")
    # A checkpoint saved before the run was open names none: the run is found by its name.
    named = mlflow.create_run(experiment, run_name="drv-2", tags={tracking.RUN_NAME_TAG: "drv-2"}).info.run_id
    early = tmp_path / "run" / "checkpoint_2026-12-02_10-05-00.000000"
    early.mkdir()
    (early / PROGRESS_FILE).write_text(json.dumps({"step": 4, "data_position": 32, "world_size": 2,
                                                   "tracking_run_id": ""}))
    train = with_overrides(preset("demo-cpu"), [f"tracking.uri={server.uri}", "tracking.experiment=driver",
                                                "tracking.run_name=drv-2"]).to_dict()
    assert tell_tracker_where(train, filesystem=LocalFileSystem(), path=str(early))
    assert mlflow.get_run(named).data.tags["checkpoint"] == str(early)
    assert "model_location" not in mlflow.get_run(named).data.tags  # no weights were exported there
    # Untracked: nothing is asked of any tracker.
    assert not tell_tracker_where(preset("demo-cpu").to_dict(), filesystem=LocalFileSystem(), path=str(final))


def test_the_driver_ends_the_run_of_a_job_that_failed_as_failed(server):
    from workloads.launch.driver import tell_tracker_it_failed

    mlflow = client(server.uri)
    experiment = mlflow.create_experiment("driver-failed")
    # Left RUNNING: its rank 0 was killed (a lost worker) before Ray Train gave up on the run.
    run_id = mlflow.create_run(experiment, run_name="drv-f", tags={tracking.RUN_NAME_TAG: "drv-f"}).info.run_id
    train = with_overrides(preset("demo-cpu"), [f"tracking.uri={server.uri}", "tracking.experiment=driver-failed",
                                                "tracking.run_name=drv-f"]).to_dict()
    assert tell_tracker_it_failed(train)
    assert mlflow.get_run(run_id).info.status == "FAILED"
    assert not tell_tracker_it_failed(train)  # ended already: left as it is
    assert not tell_tracker_it_failed(preset("demo-cpu").to_dict())  # untracked: nothing is asked
