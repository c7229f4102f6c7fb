"""The tracker's parts without a server: what it logs (parameters, metrics, tags, events), that no URI
means no MLflow at all, and that a tracker that fails, hangs or refuses never holds the caller up.
A scripted sink stands in for MLflow here; tests/test_tracking_server.py runs the real one."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from workloads.train import tracking
from workloads.train.checkpoint import Progress
from workloads.train.config import TrackingConfig, preset, with_overrides
from workloads.train.parallel import MeshPlan

REPO_ROOT = Path(__file__).resolve().parent.parent
PLAN = MeshPlan(kind="hsdp", ranks=((0, 1), (2, 3)), nodes=2, reason="test")
FRESH = Progress(step=0, data_position=0)


class Down(ConnectionError):
    pass


class Refused(Exception):
    def get_http_status_code(self) -> int:
        return 400


class ScriptedSink:
    """MLflow's calls recorded; `fail` (a callable per call) decides which raise."""

    def __init__(self, *, fail=lambda call: None, runs=None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail
        self.runs = runs or {}
        self.statuses: dict[str, str] = {}
        self.lock = threading.Lock()

    def _call(self, *call):
        error = self.fail(call)
        if error is not None:
            raise error
        with self.lock:
            self.calls.append(call)

    def experiment_id(self, name, *, artifact_location):
        self._call("experiment", name, artifact_location)
        return "7"

    def existing_run(self, experiment_id, *, run_id, run_name):
        self._call("existing", run_id, run_name)
        return self.runs.get(run_id) or self.runs.get(run_name)

    def create_run(self, experiment_id, *, run_name, tags):
        self._call("create", run_name, tags)
        return SimpleNamespace(info=SimpleNamespace(run_id="new-run"))

    def set_running(self, run_id):
        self._call("running", run_id)

    def log_batch(self, run_id, *, metrics=(), params=None, tags=None):
        self._call("batch", run_id, tuple(metrics), dict(params or {}), dict(tags or {}))

    def log_json(self, run_id, obj, name):
        self._call("json", run_id, name, json.dumps(obj))

    def log_file(self, run_id, path):
        self._call("file", run_id, Path(path).name)

    def end(self, run_id, status):
        self._call("end", run_id, status)
        self.statuses[run_id] = status

    def status(self, run_id):
        self._call("status", run_id)
        return self.statuses.get(run_id, "RUNNING")

    def find_run(self, experiment, *, run_name):
        self._call("find", experiment, run_name)
        return self.runs.get(run_name)

    def of(self, kind):
        with self.lock:
            return [c for c in self.calls if c[0] == kind]


def tracked(**settings):
    return with_overrides(preset("demo-cpu"), [f"tracking.{k}={json.dumps(v)}" for k, v in
                                               {"uri": "http://127.0.0.1:1", **settings}.items()])


def start(cfg, sink, *, progress=FRESH, said=None, world_size=4, **kwargs):
    return tracking.start(cfg, rank=0, progress=progress, world_size=world_size, nodes=2, plan=PLAN,
                          sink_factory=lambda: sink, environ={}, say=(said if said is not None else []).append,
                          backoff_s=(0.01, 0.05), **kwargs)


def step(n, **extra):
    return {"step": n, "loss": 2.0 / n, "lr": 1e-3, "tokens_per_s_per_device": 100.0, "mfu": None,
            "peak_mem_gib": 0.0, "grad_norm": 0.5, **extra}


def test_the_uri_comes_from_the_config_else_mlflows_variable():
    assert tracking.tracking_uri(TrackingConfig(uri="http://a:1"), {"MLFLOW_TRACKING_URI": "http://b:2"}) == "http://a:1"
    assert tracking.tracking_uri(TrackingConfig(), {"MLFLOW_TRACKING_URI": "http://b:2"}) == "http://b:2"
    assert tracking.tracking_uri(TrackingConfig(), {}) == ""
    assert tracking.tracking_uri(TrackingConfig(uri="off"), {"MLFLOW_TRACKING_URI": "http://b:2"}) == ""
    assert tracking.public_uri("https://me:secret@mlflow.example:8443/x") == "https://me@mlflow.example:8443/x"
    assert tracking.default_artifact_location("sqlite:////tmp/runs/mlflow/mlflow.db") == "file:///tmp/runs/mlflow/artifacts"
    assert tracking.default_artifact_location("http://127.0.0.1:5000") is None


def test_params_are_the_config_flattened_without_the_tracking_section():
    cfg = with_overrides(tracked(), ["model.revision=main"])
    params = tracking.config_params(cfg)
    assert params["model.revision"] == "main" and params["steps"] == "200" and params["betas"] == "[0.9, 0.95]"
    assert params["transport.expect"] == "efa" and params["mixed_precision"] == "false"
    assert not any(k.startswith("tracking") for k in params)
    assert len(params) == len({k for k in params})


def test_step_metrics_are_named_for_the_tracker_and_skip_missing_values():
    assert tracking.step_metrics(step(3, eval_loss=1.5)) == {
        "train_loss": 2.0 / 3, "eval_loss": 1.5, "lr": 1e-3, "tokens_per_s_per_device": 100.0,
        "peak_mem_gib": 0.0, "grad_norm": 0.5}


def test_a_restart_and_a_resize_are_events_a_fresh_start_is_not():
    assert tracking.Resumption(step=0, world_size=8, saved_world_size=0, nodes=2).event() is None
    assert tracking.Resumption(step=40, world_size=8, saved_world_size=8, nodes=2).event() == (
        "event.step-0000040.restart", "resumed after step 40 on 8 ranks (2 node(s))")
    assert tracking.Resumption(step=40, world_size=4, saved_world_size=8, nodes=1).event() == (
        "event.step-0000040.resize", "resumed after step 40 on 4 ranks (1 node(s)), was 8")
    # A resize says what it kept: the samples per optimizer step, with more micro-steps per rank.
    assert tracking.Resumption(step=40, world_size=4, saved_world_size=8, nodes=1, samples_per_step=128,
                               grad_accum_steps=2).event() == (
        "event.step-0000040.resize", "resumed after step 40 on 4 ranks (1 node(s)), was 8; 128 samples per "
                                     "optimizer step kept with grad_accum_steps=2")


def test_without_a_uri_or_on_another_rank_nothing_is_tracked():
    sink = ScriptedSink()
    for cfg, rank in ((preset("demo-cpu"), 0), (tracked(), 1)):
        tracker = tracking.start(cfg, rank=rank, progress=Progress(step=0, data_position=0), world_size=2,
                                 nodes=1, plan=PLAN, sink_factory=lambda: sink, environ={})
        assert type(tracker) is tracking.Tracker and tracker.run_id == ""
        tracker.log_step(step(1))
        tracker.finish({})
    assert sink.calls == []


def test_without_a_uri_the_loop_the_driver_and_the_clients_never_import_mlflow():
    code = """
import sys
import workloads.train.loop, workloads.launch.driver, workloads.local.run, workloads.client.submit
from workloads.train import tracking
from workloads.train.checkpoint import Progress
from workloads.train.config import preset
from workloads.train.parallel import MeshPlan
t = tracking.start(preset("demo-cpu"), rank=0, progress=Progress(step=0, data_position=0), world_size=1, nodes=1,
                   plan=MeshPlan(kind="fsdp", ranks=((0,),), nodes=1, reason=""))
t.log_step({"step": 1, "loss": 1.0}); t.finish({})
assert not tracking.annotate_run(preset("demo-cpu").tracking, run_id="x", tags={"a": "b"})
print(sorted(m for m in sys.modules if m.split(".")[0] == "mlflow"))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_run_logs_its_config_shape_and_steps_then_its_summary_and_end():
    sink, said = ScriptedSink(), []
    cfg = tracked(run_name="demo-1", experiment="exp", tags={"stack": "us-west-2", "image": "img:v1"})
    tracker = start(cfg, sink, said=said)
    for n in (1, 2):
        tracker.log_step(step(n))
    tracker.finish({"steps_done": 2, "resumed_from_step": 0, "tokens_per_s_per_device": 90.0, "mfu": None})
    assert sink.of("experiment") == [("experiment", "exp", None)]
    assert sink.of("create") == [("create", "demo-1", {tracking.RUN_NAME_TAG: "demo-1"})]
    opening, *steps, means = sink.of("batch")
    _, run_id, metrics, params, tags = opening
    assert run_id == "new-run" and params == tracking.config_params(cfg)
    assert tags == {"stack": "us-west-2", "image": "img:v1", "world_size": "4", "nodes": "2",
                    "parallelism": "hsdp 2x2"}
    assert [(m[0], m[1], m[3]) for m in metrics] == [("world_size", 4.0, 0)]
    assert [[(m[0], m[3]) for m in s[2] if m[0] == "train_loss"] for s in steps] == [[("train_loss", 1)],
                                                                                    [("train_loss", 2)]]
    assert [(m[0], m[1], m[3]) for m in means[2]] == [("mean_tokens_per_s_per_device", 90.0, 2)]
    assert sink.of("json")[0][:3] == ("json", "new-run", "summary.json")
    assert sink.of("end") == [("end", "new-run", "FINISHED")]
    assert tracker.run_id == "new-run"
    (line,) = said
    assert json.loads(line.removeprefix("[tracking] ")) == {
        "run_id": "new-run", "experiment": "exp", "experiment_id": "7", "uri": "http://127.0.0.1:1",
        "continued": False}


def test_a_resumed_run_continues_its_run_logs_new_params_and_says_which_changed():
    earlier = SimpleNamespace(info=SimpleNamespace(run_id="run-a"),
                              data=SimpleNamespace(params={"steps": "100", "seed": "0"}))
    sink = ScriptedSink(runs={"run-a": earlier})
    cfg = tracked(run_name="demo-1")
    tracker = start(cfg, sink, progress=Progress(step=40, data_position=320, world_size=8, tracking_run_id="run-a"))
    assert tracker.run_id == "run-a"  # known from the checkpoint before the tracker answers
    tracker.finish({})
    assert sink.of("existing") == [("existing", "run-a", "demo-1")] and sink.of("create") == []
    assert sink.of("running") == [("running", "run-a")]
    _, run_id, metrics, params, tags = sink.of("batch")[0]
    assert run_id == "run-a" and "steps" not in params and "seed" not in params and "lr" in params
    assert tags["params_changed.step-0000040"] == "steps: 100 -> 200"
    assert tags["event.step-0000040.resize"] == ("resumed after step 40 on 4 ranks (2 node(s)), was 8; "
                                                 f"{cfg.micro_batch * 4} samples per optimizer step kept with "
                                                 "grad_accum_steps=1")
    assert [(m[0], m[1], m[3]) for m in metrics] == [("world_size", 4.0, 40)]


def test_a_tracker_that_is_down_warns_once_keeps_the_records_and_sends_them_in_order():
    down = threading.Event()
    down.set()
    attempts = []

    def refused(call):
        if down.is_set():
            attempts.append(call)
            return Down("connection refused")
        return None

    sink, said = ScriptedSink(fail=refused), []
    tracker = start(tracked(), sink, said=said)
    for n in range(1, 6):
        tracker.log_step(step(n))
    deadline = time.monotonic() + 30  # several failed attempts, however slowly the sender's thread runs
    while len(attempts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(attempts) >= 2
    assert sink.calls == [] and [line for line in said if "did not answer" in line] == [
        "[tracking] warning: http://127.0.0.1:1 did not answer (connection refused); training goes on, records "
        "are kept (up to 10000) and sent when it answers"]
    down.clear()
    tracker.finish({})
    sent = [[m[3] for m in c[2] if m[0] == "train_loss"] for c in sink.of("batch")]
    assert [s for s in sent if s] == [[1], [2], [3], [4], [5]]
    assert sink.of("end") and any("answers again" in line for line in said)
    assert len([line for line in said if "did not answer" in line]) == 1


def test_a_hanging_tracker_never_holds_up_a_step_and_the_end_waits_only_its_timeout():
    hang = threading.Event()
    sink = ScriptedSink(fail=lambda call: hang.wait() and None)  # every call waits for ever
    said = []
    tracker = start(tracked(flush_timeout_s=0.5), sink, said=said)
    started = time.perf_counter()
    for n in range(1, 1001):
        tracker.log_step(step(n))
    # A thousand step records with the tracker stuck for ever: well under a second (bounds loose
    # enough for a loaded 2-core machine; a call that waited on the sink would never return).
    assert time.perf_counter() - started < 3.0
    started = time.perf_counter()
    tracker.finish({})
    assert 0.5 <= time.perf_counter() - started < 5.0
    assert said[-1].startswith("[tracking] warning: http://127.0.0.1:1: 1003 record(s) not sent within 0.5 s")
    hang.set()


def test_a_full_buffer_drops_the_oldest_step_records_and_counts_them():
    down = threading.Event()
    down.set()
    sink, said = ScriptedSink(fail=lambda call: Down("refused") if down.is_set() else None), []
    tracker = start(tracked(buffer_records=4), sink, said=said)
    for n in range(1, 11):
        tracker.log_step(step(n))
    down.clear()
    tracker.finish({})
    steps = [m[3] for c in sink.of("batch") for m in c[2] if m[0] == "train_loss"]
    assert steps == [8, 9, 10] and tracker.dropped == 7
    assert sink.of("end") and "7 step record(s) dropped from the full buffer" in said[-1]


def test_a_refused_record_is_skipped_and_the_rest_still_sent():
    sink, said = ScriptedSink(fail=lambda call: Refused("INVALID_PARAMETER_VALUE: bad metric")
                              if call[0] == "batch" and any(m[3] == 2 for m in call[2]) else None), []
    tracker = start(tracked(), sink, said=said)
    for n in (1, 2, 3):
        tracker.log_step(step(n))
    tracker.finish({})
    steps = [m[3] for c in sink.of("batch") for m in c[2] if m[0] == "train_loss"]
    assert steps == [1, 3] and sink.of("end")
    assert any("refused the metrics record: INVALID_PARAMETER_VALUE: bad metric; skipped" in line for line in said)


def test_no_mlflow_where_rank_0_runs_turns_tracking_off_with_one_warning():
    said = []

    def missing():
        raise ModuleNotFoundError("No module named 'mlflow'")

    tracker = tracking.start(tracked(), rank=0, progress=Progress(step=0, data_position=0), world_size=1, nodes=1,
                             plan=PLAN, sink_factory=missing, environ={}, say=said.append)
    tracker.log_step(step(1))
    tracker.finish({})
    assert said == ["[tracking] warning: tracking is off: No module named 'mlflow' (install the `tracking` extra, "
                    "or on the cluster the job's runtime_env pip packages)"]


def test_annotating_an_ended_run_gives_up_after_its_timeout_without_raising():
    said = []
    assert tracking.annotate_run(TrackingConfig(uri="http://x:1"), run_id="r", tags={"model_location": "s3://b/m"},
                                 files=(Path("report.json"),), sink_factory=ScriptedSink, say=said.append)
    hang = threading.Event()
    slow = ScriptedSink(fail=lambda call: hang.wait() and None)
    assert not tracking.annotate_run(TrackingConfig(uri="http://x:1"), run_id="r", tags={"model_location": "m"},
                                     timeout_s=0.2, sink_factory=lambda: slow, say=said.append)
    assert said == ["[tracking] warning: could not add model_location to run r at http://x:1: no answer within "
                    "0.2 s"]
    hang.set()


@pytest.mark.parametrize("tags", [{"a": 1}, ["a"]])
def test_tags_must_be_a_mapping_of_strings(tags):
    with pytest.raises(ValueError, match="tracking.tags"):
        with_overrides(preset("demo-cpu"), [f"tracking.tags={json.dumps(tags)}"])


@pytest.mark.parametrize(("raised", "status"), [(RuntimeError("CUDA out of memory"), "FAILED"),
                                                (KeyboardInterrupt(), "KILLED"), (SystemExit(143), "KILLED")])
def test_a_loop_that_raises_ends_its_run_failed_and_an_interrupted_one_killed(raised, status):
    sink = ScriptedSink()
    with pytest.raises(type(raised)):
        with tracking.ends_with_the_run():
            tracker = start(tracked(), sink)
            tracker.log_step(step(1))
            raise raised
    assert sink.of("end") == [("end", "new-run", status)]
    assert [c[0] for c in sink.calls][-3:] == ["batch", "status", "end"]  # the step before it was sent first
    # A run that reached its summary is not ended again by a later failure of the same process.
    sink = ScriptedSink()
    with pytest.raises(RuntimeError):
        with tracking.ends_with_the_run():
            start(tracked(), sink).finish({})
            raise RuntimeError("after the run")
    assert sink.of("end") == [("end", "new-run", "FINISHED")]


def test_a_failure_does_not_overwrite_what_whoever_stopped_the_run_said():
    sink = ScriptedSink()
    with pytest.raises(RuntimeError):
        with tracking.ends_with_the_run():
            tracker = start(tracked(), sink)
            tracker.log_step(step(1))
            sink.statuses["new-run"] = "KILLED"  # the client stopped the job meanwhile
            raise RuntimeError("gloo: connection closed by peer")
    assert sink.of("end") == [] and sink.statuses["new-run"] == "KILLED"


def test_a_run_left_running_is_ended_afterwards_and_an_ended_one_is_left_alone():
    sink, said = ScriptedSink(runs={"demo-1": SimpleNamespace(info=SimpleNamespace(run_id="run-a"))}), []
    end = functools.partial(tracking.end_run, "http://127.0.0.1:1", sink_factory=lambda: sink, say=said.append)
    assert end(run_id="run-a", status="KILLED")
    assert not end(run_id="run-a", status="FAILED")  # KILLED already
    assert sink.of("end") == [("end", "run-a", "KILLED")]
    sink.statuses.clear()
    assert end(experiment="exp", run_name="demo-1", status="FAILED")  # found by its run name
    assert not end(experiment="exp", run_name="never-opened", status="FAILED")
    # Whoever stopped it ends it KILLED over the FAILED its ranks wrote as their peers went, not over FINISHED.
    assert end(run_id="run-a", status="KILLED", over=("RUNNING", "FAILED"))
    sink.statuses["run-a"] = "FINISHED"
    assert not end(run_id="run-a", status="KILLED", over=("RUNNING", "FAILED"))
    assert said == []
    hung = ScriptedSink(fail=lambda call: time.sleep(5))
    assert not tracking.end_run("http://127.0.0.1:1", run_id="run-b", status="KILLED", timeout_s=0.2,
                                sink_factory=lambda: hung, say=said.append)
    assert said == ["[tracking] warning: could not end run run-b at http://127.0.0.1:1 as KILLED: no answer "
                    "within 0.2 s"]
