"""The pause points of fault-injection tests: inert unless WORKLOADS_PAUSE_PLAN is set, read in one
place, taken once per plan entry, loud about a malformed plan."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from fake_clock import FakeClock

from infra.config import load_stack_config
from infra.raycluster import build_raycluster

from workloads.client import submit
from workloads.launch.faults import PAUSE_PLAN_ENV, POINTS, Pause, pause_point, read_plan, write_plan

REPO = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, *pauses: dict) -> dict[str, str]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pauses": list(pauses)}))
    return {PAUSE_PLAN_ENV: str(plan)}


@pytest.mark.parametrize("point", POINTS)
def test_without_the_variable_a_point_does_nothing(point, tmp_path, monkeypatch):
    monkeypatch.delenv(PAUSE_PLAN_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    clock = FakeClock()
    assert pause_point(point, run="r", step=4, rank=1, sleep=clock.sleep, clock=clock) is None
    assert clock.sleeps == 0 and list(tmp_path.iterdir()) == []


def test_nothing_in_the_project_sets_the_variable_and_one_module_reads_it():
    """The job's runtime_env, the RayCluster's pods and the local cluster's nodes leave it unset."""
    for expect in ("efa", "any"):
        assert PAUSE_PLAN_ENV not in submit.runtime_env(working_dir="/w", expect=expect)["env_vars"]
    cfg = load_stack_config("us-west-2", REPO)
    manifest = json.dumps(build_raycluster(cfg))
    assert PAUSE_PLAN_ENV not in manifest
    readers = [path.relative_to(REPO).as_posix() for folder in ("workloads", "infra", "capacity", "policy")
               for path in (REPO / folder).rglob("*.py") if PAUSE_PLAN_ENV in path.read_text()]
    assert readers == ["workloads/launch/faults.py"]
    source = (REPO / "workloads/launch/faults.py").read_text()
    assert len(re.findall(r"environ\.get\(PAUSE_PLAN_ENV\)", source)) == 1


def test_a_listed_point_pauses_once_and_names_the_process_to_kill(tmp_path, capsys):
    env = _plan(tmp_path, {"point": "checkpoint-upload", "run": "r", "step": 4, "rank": 1, "max_s": 3})
    clock = FakeClock()
    marker = pause_point("checkpoint-upload", run="r", step=4, rank=1, environ=env, sleep=clock.sleep, clock=clock)
    assert marker == tmp_path / "paused-r-checkpoint-upload-step4-rank1.json"
    assert json.loads(marker.read_text())["pid"] == os.getpid()
    assert clock.now >= 3 and clock.sleeps >= 15  # it waited to be killed, in short sleeps
    assert "rank 1 of run r paused at checkpoint-upload of step 4" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["plan.json", marker.name])
    # The resumed run reaches the same point again: it goes through.
    again = FakeClock()
    assert pause_point("checkpoint-upload", run="r", step=4, rank=1, environ=env, sleep=again.sleep,
                       clock=again) is None
    assert again.sleeps == 0


@pytest.mark.parametrize("where", [dict(run="other", step=4, rank=1), dict(run="r", step=5, rank=1),
                                   dict(run="r", step=4, rank=0), dict(run="r", step=None, rank=1)])
def test_other_runs_steps_and_ranks_go_through(where, tmp_path):
    env = _plan(tmp_path, {"point": "after-report", "run": "r", "step": 4, "rank": 1})
    clock = FakeClock()
    assert pause_point("after-report", environ=env, sleep=clock.sleep, clock=clock, **where) is None
    assert pause_point("checkpoint-upload", run="r", step=4, rank=1, environ=env, sleep=clock.sleep,
                       clock=clock) is None
    assert clock.sleeps == 0


def test_a_missing_plan_file_pauses_nothing(tmp_path):
    env = {PAUSE_PLAN_ENV: str(tmp_path / "not-written-yet.json")}
    assert pause_point("after-report", run="r", step=1, rank=0, environ=env) is None


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a readable JSON plan"),
    (json.dumps({"pauses": [{"point": "after-report", "run": "r", "step": 1, "rank": 0, "when": "now"}]}),
     "unknown key"),
    (json.dumps({"pauses": [{"point": "mid-step", "run": "r", "step": 1, "rank": 0}]}),
     "point 'mid-step' is not one of checkpoint-upload, checkpoint-uploaded, after-report"),
])
def test_a_malformed_plan_is_an_error_naming_the_variable(text, message, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    with pytest.raises(ValueError, match=f"{PAUSE_PLAN_ENV}.*{message}"):
        pause_point("after-report", run="r", step=1, rank=0, environ={PAUSE_PLAN_ENV: str(plan)})


def test_a_plan_rewritten_while_ranks_read_it_is_never_read_half_written(tmp_path):
    """A soak rewrites its plan before each fault while every rank reads it at each point; a reader
    that met a truncated file once failed its rank ("not a readable JSON plan")."""
    import threading

    plan = tmp_path / "plan.json"
    plans = [[Pause(point="after-report", run="r", step=step, rank=0) for step in range(size)] for size in (400, 1)]
    write_plan(plan, plans[0])
    done = threading.Event()

    def rewrite() -> None:
        for i in range(300):
            write_plan(plan, plans[i % 2])
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = []
    while not done.is_set():
        reads.append(len(read_plan(plan)))  # raises ValueError on a half-written plan
    writer.join()
    assert set(reads) <= {400, 1} and len(reads) > 10
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no draft left beside it
