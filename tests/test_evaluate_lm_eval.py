"""The evaluation, run for real: lm-eval's Hugging Face backend scores the toy model fine-tuned on the
toy chats (the project's loop, one gloo rank in this process) and its base on the chats the run held
out, made into an lm-eval task from local files (datasets and hub offline). The trained model must
score above its base by more than noise, or the evaluation cannot tell them apart; the same for a
LoRA run evaluated as base + adapter (lm-eval's `peft=`) and as its merged export, which must agree."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workloads.context import TrainContext
from workloads.client import evaluate as cli
from workloads.train.evaluation_config import EXIT_GATE_FAILED
from workloads.model_io.toy import toy_conversations, write_chat_jsonl, write_toy_model
from workloads.train.config import TrainConfig, preset, with_overrides

SCORING = ["evaluate.max_new_tokens=6", "evaluate.limit=40", "evaluate.batch_size=40"]
"""The toy answers are two tokens and the end of turn; 40 of the 60 held-out chats."""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def train_in_process(cfg: TrainConfig, scratch: Path) -> dict:
    from workloads.train.loop import train

    ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       report=lambda metrics, checkpoint_dir=None: None, latest_checkpoint=lambda: None,
                       scratch_dir=scratch)
    scratch.mkdir(parents=True)
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'store'}", rank=0, world_size=1)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return train(cfg, ctx)
    finally:
        dist.destroy_process_group()


def local_run(root: Path, name: str, overrides: list[str], *, base: Path, chats: Path) -> Path:
    """A runs/<name> folder as `run --local` leaves it: run.json with the config, model/ the export."""
    cfg = with_overrides(preset("demo-cpu"), [f"model.name_or_path={base}", "data.kind=jsonl", f"data.path={chats}",
                                              "data.eval_fraction=0.1", "eval_every=0", "log_every=50",
                                              *SCORING, *overrides])
    run_dir = root / name
    train_in_process(cfg, run_dir / "scratch")
    final = max((run_dir / "scratch").glob("checkpoint-*"))
    (final / "model").rename(run_dir / "model")
    (run_dir / "run.json").write_text(json.dumps({"name": name, "train": cfg.to_dict(), "status": "succeeded"}))
    return run_dir


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The toy model's steps and generations are too small to share among threads: one thread runs
    them several times faster on two loaded cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    base = write_toy_model(root / "base-model")
    chats = write_chat_jsonl(root / "chat.jsonl", toy_conversations(600))
    torch.manual_seed(0)
    full = local_run(root, "full", ["steps=200", "checkpoint_every=200"], base=base, chats=chats)
    # LoRA on the fine-tuned model: a base that answers, so that the adapter's and the merged export's
    # scores agreeing says more than two zeros would.
    local_run(root, "lora", ["steps=30", "checkpoint_every=30", "method=lora", "lora.rank=8", "lora.alpha=16",
                             "lr=5e-3"], base=full / "model", chats=chats)
    return root


def evaluate(root: Path, name: str, *args: str, capsys) -> tuple[int, dict]:
    code = cli.main("evaluate", [name, "--runs-dir", str(root), "--device", "cpu", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out[out.index("{\n"):out.rindex("\n}") + 2])


def test_a_trained_model_scores_above_its_base_on_its_held_out_chats(runs, capsys):
    code, record = evaluate(runs, "full", "--set", "evaluate.gate=heldout:exact_match>=base+0.2", capsys=capsys)
    (row,) = record["rows"]
    assert (row["task"], row["metric"], row["samples"]) == ("heldout", "exact_match", 40)
    assert row["tuned"] - row["base"] > max(0.2, row["noise"]), row
    assert row["verdict"] == "better" and record["passed"] and code == 0
    assert {u["role"]: u["cached"] for u in record["units"]} == {"tuned": False, "base": False}
    assert (runs / "full" / "evaluation.png").stat().st_size > 0
    assert "| heldout | exact_match |" in (runs / "full" / "model" / "README.md").read_text()
    # The same base, task and settings again: the base's scores come from the cache.
    code, again = evaluate(runs, "full", capsys=capsys)
    assert {u["role"]: u["cached"] for u in again["units"]} == {"tuned": False, "base": True}
    assert again["rows"][0]["base"] == row["base"]


def test_a_gate_the_tuned_model_misses_exits_5_naming_the_task_and_by_how_much(runs, capsys):
    code, record = evaluate(runs, "full", "--set", "evaluate.gate=heldout:exact_match>=base+2", capsys=capsys)
    assert code == EXIT_GATE_FAILED
    (gate,) = record["gate"]
    assert not gate["passed"] and "heldout regressed" in gate["message"]
    assert f"{gate['bound'] - gate['tuned']:.4f} below the bound" in gate["message"]


def test_a_lora_run_scores_alike_as_base_plus_adapter_and_as_its_merged_export(runs, capsys):
    code, record = evaluate(runs, "lora", capsys=capsys)
    assert code == 0
    assert sorted(u["role"] for u in record["units"]) == ["adapter", "base", "tuned"]
    (versus,) = record["adapter_vs_merged"]
    assert versus["significant"] is False and record["adapter_agrees"], versus
    assert versus["tuned"] > 0.2, versus  # both answer: the agreement is not that of two zeros
