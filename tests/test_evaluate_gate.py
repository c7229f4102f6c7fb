"""The evaluation's settings, comparison and gate as data, and every bad input refused in one line
before any training: gates that do not parse, unknown tasks (with the close ones, from lm-eval's own
task index), a metric the task does not have, a hub task without a network, a base that cannot be
loaded. And what a gate decides: the exit code, the `runs` column, the best checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workloads.client.outcome import EXIT_EVALUATION_GATE, EXIT_FAILED, EXIT_OK, JobOutcome, evaluation_check
from workloads.evaluate.compare import Row, Score, compare, judge
from workloads.train.evaluation_config import EvaluateConfig, parse_gate
from workloads.evaluate.report import EVALUATE_PREFIX
from workloads.evaluate.stage import check_before_training, failed_record, tasks_for
from workloads.train.config import preset, with_overrides


def chats_config(tmp_path: Path, *overrides: str) -> dict:
    from workloads.model_io.toy import toy_conversations, write_chat_jsonl

    chats = write_chat_jsonl(tmp_path / "chat.jsonl", toy_conversations(20))
    return with_overrides(preset("demo-cpu"), ["data.kind=jsonl", f"data.path={chats}", "data.tokenizer=gpt2",
                                               *overrides]).to_dict()


def test_gate_rules_parse_relative_absolute_and_lower_is_better():
    a, b, c = parse_gate("heldout:exact_match>=base-0.01, gsm8k:exact_match,strict-match>=0.4,heldout:ppl<=base+1e-3")
    assert (a.task, a.metric, a.op, a.relative, a.offset) == ("heldout", "exact_match", ">=", True, -0.01)
    assert a.passes(0.495, 0.5) and not a.passes(0.489, 0.5)
    assert (b.metric, b.relative, b.bound(None)) == ("exact_match,strict-match", False, 0.4)
    assert c.op == "<=" and c.passes(2.0, 2.0) and not c.passes(2.01, 2.0)


@pytest.mark.parametrize("text", ["heldout>=base", "heldout:exact_match=>base", "heldout:exact_match>=bse-1",
                                  ":exact_match>=base", "heldout:exact_match>=base-"])
def test_a_gate_that_does_not_parse_is_one_line_naming_the_rule(text):
    with pytest.raises(ValueError, match=r"evaluate.gate rule .* does not parse: write TASK:METRIC>=base-0.01") as e:
        parse_gate(text)
    assert "\n" not in str(e.value)


def test_settings_refuse_a_gate_on_a_task_not_run_and_a_metric_the_heldout_task_does_not_score():
    with pytest.raises(ValueError, match="names task 'gsm8k', which evaluate.tasks"):
        EvaluateConfig(tasks="heldout", gate="gsm8k:exact_match>=base")
    with pytest.raises(ValueError, match="the heldout task scores exact_match .*not 'rougeL'"):
        EvaluateConfig(gate="heldout:rougeL>=base")
    with pytest.raises(ValueError, match="evaluate.metric is 'bleu'"):
        with_overrides(preset("demo-cpu"), ["evaluate.metric=bleu"])


def test_a_difference_is_called_real_only_beyond_two_combined_standard_errors():
    tuned = {"t": {"m": Score(value=0.60, stderr=0.03)}}
    rows = compare(tuned, {"t": {"m": Score(value=0.50, stderr=0.04)}})
    assert rows[0].noise == pytest.approx(2 * 0.05)  # sqrt(0.03^2 + 0.04^2) = 0.05
    assert rows[0].difference == pytest.approx(0.10) and rows[0].verdict == "within noise"
    rows = compare(tuned, {"t": {"m": Score(value=0.45, stderr=0.04)}})
    assert rows[0].verdict == "better"
    worse = compare(tuned, {"t": {"m": Score(value=0.45, stderr=0.04)}}, higher_is_better={"t": {"m": False}})
    assert worse[0].verdict == "worse"


def test_the_gate_names_the_task_that_regressed_and_by_how_much():
    rows = [Row(task="heldout", metric="exact_match", tuned=0.70, tuned_stderr=0.05, base=0.75, base_stderr=0.05,
                samples=60)]
    (result,) = judge(parse_gate("heldout:exact_match>=base-0.01"), rows)
    assert not result.passed and result.bound == pytest.approx(0.74)
    assert "heldout regressed: heldout:exact_match 0.7000 vs base 0.7500, 0.0400 below the bound 0.7400" in \
        result.message
    (missing,) = judge(parse_gate("gsm8k:exact_match>=base"), rows)
    assert not missing.passed and "no score for gsm8k:exact_match" in missing.message


def job(record: dict, *, status: str = "SUCCEEDED") -> JobOutcome:
    logs = "step lines\n(driver) " + EVALUATE_PREFIX + json.dumps(record) + "\n"
    return JobOutcome(job_id="j", status=status, logs=logs, checks=(evaluation_check(logs),))


def test_a_run_whose_model_missed_its_gate_exits_5_and_one_that_passed_or_had_none_exits_0():
    failed = {"event": "evaluation", "rows": [], "passed": False,
              "gate": [{"rule": "r", "passed": False, "message": "r: heldout regressed: ..."}]}
    outcome = job(failed)
    assert outcome.exit_code == EXIT_EVALUATION_GATE == 5
    assert "evaluation gate failed: r: heldout regressed" in outcome.checks[0].message
    assert job({**failed, "passed": True, "gate": []}).exit_code == EXIT_OK
    assert job(failed, status="FAILED").exit_code == EXIT_FAILED
    # An evaluation that could not run: with a gate the gate fails, without one the run's outcome stands.
    settings = EvaluateConfig(gate="heldout:exact_match>=base")
    assert job(failed_record("RuntimeError: boom", settings=settings, seconds=1)).exit_code == EXIT_EVALUATION_GATE
    assert job(failed_record("RuntimeError: boom", settings=EvaluateConfig(), seconds=1)).exit_code == EXIT_OK


def test_a_run_on_synthetic_tokens_has_no_heldout_task_and_a_gate_on_it_is_refused():
    assert tasks_for(preset("demo-cpu").to_dict()) == ((), ["no heldout task: the run trains on synthetic tokens"])
    gated = with_overrides(preset("demo-cpu"), ["evaluate.gate=heldout:exact_match>=base"]).to_dict()
    with pytest.raises(ValueError, match="evaluate.gate names the heldout task, and the run trains on synthetic"):
        check_before_training(gated)


def test_a_base_that_cannot_be_loaded_is_refused_before_training(tmp_path):
    (tmp_path / "empty").mkdir()
    for base, message in ((str(tmp_path / "empty"), "evaluate.base .* has no config.json"),
                          ("not a model!", "evaluate.base 'not a model!' is neither")):
        with pytest.raises(ValueError, match=message):
            check_before_training(chats_config(tmp_path, f"evaluate.base={base}"))
    # Random weights have no base to compare with: a relative gate says so.
    with pytest.raises(ValueError, match="compares with the base, and the run starts from random weights"):
        check_before_training(chats_config(tmp_path, "evaluate.gate=heldout:exact_match>=base"))


@pytest.fixture(scope="module")
def lm_eval_tasks():
    from workloads.evaluate.tasks import task_manager

    return task_manager()  # lm-eval's own index of its built-in task configs (no network)


def test_unknown_tasks_list_the_close_ones_and_a_metric_the_task_lacks_lists_its_metrics(tmp_path, lm_eval_tasks):
    from workloads.evaluate.tasks import check_tasks

    with pytest.raises(ValueError, match=r"unknown task 'gsm8kk'; close: gsm8k\b"):
        check_tasks(EvaluateConfig(tasks="heldout,gsm8kk"), network=True, manager=lm_eval_tasks)
    with pytest.raises(ValueError, match=r"task hellaswag has no metric 'exact_match' \(it has acc, acc_norm\)"):
        check_tasks(EvaluateConfig(tasks="hellaswag", gate="hellaswag:exact_match>=base"), network=True,
                    manager=lm_eval_tasks)
    with pytest.raises(ValueError, match="lm-eval reads these datasets from the Hugging Face hub, which cannot be"):
        check_tasks(EvaluateConfig(tasks="heldout,hellaswag", gate="hellaswag:acc_norm>=base-0.01"), network=False,
                    manager=lm_eval_tasks)
    check_tasks(EvaluateConfig(tasks="heldout,hellaswag", gate="hellaswag:acc_norm>=base-0.01"), network=True,
                manager=lm_eval_tasks)


def test_runs_shows_the_headline_score_and_best_never_picks_a_checkpoint_that_missed_its_gate(tmp_path):
    from workloads.client.runs import describe, format_runs
    from workloads.model_io.export import best_checkpoint
    from workloads.model_io.storage import locate

    run = tmp_path / "r"
    record = {"rows": [Row(task="heldout", metric="exact_match", tuned=0.9, tuned_stderr=0.03, base=0.1,
                           base_stderr=0.03, samples=60).to_dict()], "passed": True, "gate": []}
    run.mkdir()
    (run / "report.json").write_text(json.dumps({"status": "SUCCEEDED", "evaluation": record}))
    listed = format_runs([describe(run)], cwd=tmp_path)
    assert "SCORE" in listed and "heldout:exact_match 0.900 (base 0.100, better)" in listed
    for name, loss, passed in (("checkpoint-1", 0.5, True), ("checkpoint-2", 0.4, False)):
        (run / name).mkdir()
        (run / name / "progress.json").write_text(json.dumps({"eval_loss": loss}))
        (run / name / "evaluation.json").write_text(json.dumps({"passed": passed}))
    assert best_checkpoint(locate(str(run)), ["checkpoint-1", "checkpoint-2"]) == "checkpoint-1"


def test_a_gpu_job_that_is_evaluated_installs_lm_eval_at_the_pins_of_the_evaluate_extra():
    import tomllib

    from workloads.client import submission

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert list(submission.EVALUATE_PACKAGES) == pyproject["project"]["optional-dependencies"]["evaluate"]
    assert set(submission.EVALUATE_PACKAGES) <= set(pyproject["project"]["optional-dependencies"]["dev"])

    def packages(train: dict, expect: str) -> list[str]:
        sub = submission.build_submission(train=train, run_name="r", storage_path="s3://b/r", max_failures=1,
                                          working_dir="/w", expect=expect)
        return (sub.runtime_env.get("pip") or {}).get("packages", [])

    evaluated = preset("qwen2.5-1.5b").to_dict()
    assert set(submission.EVALUATE_PACKAGES) <= set(packages(evaluated, "efa"))
    off = with_overrides(preset("qwen2.5-1.5b"), ["evaluate.tasks="]).to_dict()
    assert not set(submission.EVALUATE_PACKAGES) & set(packages(off, "efa"))
    assert packages(evaluated, "any") == []  # a CPU cluster installs nothing at job start


def test_export_carries_the_evaluation_into_the_model_card_of_the_folder_it_writes(tmp_path):
    from workloads.evaluate.report import carry_model_card

    checkpoint, out = tmp_path / "checkpoint-0000200", tmp_path / "exported"
    checkpoint.mkdir()
    out.mkdir()
    record = {"rows": [Row(task="heldout", metric="exact_match", tuned=0.9, tuned_stderr=0.03, base=0.1,
                           base_stderr=0.03, samples=60).to_dict()], "passed": True,
              "gate": [{"rule": "heldout:exact_match>=base", "passed": True, "message": "m"}],
              "base": "Qwen/Qwen2.5-1.5B@abc", "lm_eval": "0.4.13"}
    assert not carry_model_card(checkpoint_uri=str(checkpoint), out_uri=str(out))  # nothing evaluated
    (checkpoint / "evaluation.json").write_text(json.dumps(record))
    assert carry_model_card(checkpoint_uri=str(checkpoint), out_uri=str(out))
    card = (out / "README.md").read_text()
    assert "| heldout | exact_match | 0.9000 ± 0.0300 | 0.1000 ± 0.0300 | +0.8000 | better |" in card
    assert "Gate `heldout:exact_match>=base`: passed." in card and "`Qwen/Qwen2.5-1.5B@abc`" in card
    assert not carry_model_card(checkpoint_uri=str(checkpoint), out_uri=str(out))  # a card is there: kept


def test_plan_adds_the_evaluations_time_to_the_runs_time_and_cost():
    from workloads.client.plan import format_plan, make_plan

    def planned(*overrides: str) -> dict:
        cfg = with_overrides(preset("qwen2.5-1.5b"), list(overrides))
        return make_plan(cfg, preset_name="qwen2.5-1.5b", instance_type="p5.48xlarge", nodes=1, cwd=Path.cwd())

    plan = planned()
    run = plan["run"]
    # 20,000 conversations, 2% held out: 400 records; the tuned model and the base on 8 GPUs at once.
    assert run["evaluation"]["examples_per_task"] == {"heldout": 400} and run["evaluation"]["units"] == 2
    assert run["total_s"] == pytest.approx(run["training_s"] + run["evaluation"]["seconds"], abs=0.11)
    assert run["usd"] == pytest.approx(run["total_s"] / 3600 * plan["usd_per_hour"], abs=0.01)
    longer = planned("evaluate.max_new_tokens=256")["run"]["evaluation"]["seconds"]
    assert longer > run["evaluation"]["seconds"]  # the decode steps are the time
    assert "min of evaluation (2 lm-eval units of heldout 400 examples" in format_plan(plan)
    off = planned("evaluate.tasks=")["run"]
    assert off["evaluation"] is None and off["total_s"] == off["training_s"]


def test_the_evaluate_command_refuses_what_it_cannot_evaluate_in_one_line(tmp_path, capsys):
    from workloads.client import evaluate as cli

    (tmp_path / "runs" / "no-model").mkdir(parents=True)
    (tmp_path / "runs" / "no-model" / "run.json").write_text(json.dumps({"name": "no-model", "train": {}}))
    (tmp_path / "folder").mkdir()
    for args, message in ((["no-model"], "run no-model has no exported model"),
                          (["nothing-here"], "'nothing-here' is neither a run in"),
                          ([str(tmp_path / "folder")], "a model outside a run needs --base"),
                          ([str(tmp_path / "folder"), "--base", "org/base", "--set",
                            "evaluate.gate=heldout:exact_match=>base"], "does not parse")):
        assert cli.main("evaluate", [*args, "--runs-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("evaluate: error: ") and message in err and err.count("\n") == 1, err


def test_a_relative_gate_on_the_model_the_demo_makes_before_the_job_is_not_taken_for_random_weights(tmp_path):
    train = chats_config(tmp_path, f"model.name_or_path={tmp_path / 'base-model'}",
                         "evaluate.gate=heldout:exact_match>=base")
    assert check_before_training(train, base_made_later=True) == []
    with pytest.raises(ValueError, match="evaluate.base .*base-model' is not a folder"):
        check_before_training(train)  # not made: refused before anything starts


def test_the_driver_preloads_every_module_the_evaluation_imports_late(repo_root):
    """A module of the project the evaluation imports inside a function must be imported by preload()
    (the driver's, before the job's working_dir can go) or by the stage module itself. (Importing the
    stage, as the command line does to check a run, brings no torch: test_submit.py's refused
    arguments.)"""
    import ast
    import importlib.util

    from workloads.evaluate.stage import STAGE_MODULES

    def imported(tree, *, late: bool) -> set[str]:
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes = [m for f in functions for m in ast.walk(f)] if late else tree.body
        out = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workloads"):
                package = (repo_root / node.module.replace(".", "/")).is_dir()
                out |= {f"{node.module}.{a.name}" for a in node.names} if package else {node.module}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("workloads")}
        return out

    late = set()
    for path in sorted((repo_root / "workloads" / "evaluate").glob("*.py")):
        late |= imported(ast.parse(path.read_text()), late=True)
    assert "workloads.train.checkpoint" in late
    at_import = imported(ast.parse((repo_root / "workloads" / "evaluate" / "stage.py").read_text()), late=False)
    assert late <= set(STAGE_MODULES) | at_import, late - set(STAGE_MODULES) - at_import
    assert all(importlib.util.find_spec(name) for name in STAGE_MODULES)
