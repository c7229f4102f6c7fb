"""A model fine-tuned on a user's own chats, asked as it was trained (and talked to: `chat`): the
closing question of a run is a record's conversation up to its answer (its system prompt and earlier
turns included), a held-out record where the run held some out; the eval loss warns when it rises or
is over too few records.

The fine-tune here is the loop itself on one gloo rank (seconds on a CPU), from a fresh toy model, on
chats whose answer depends on their system prompt or on an earlier turn: asked as a bare user turn
(what a local run did), the two "What colour is snow?" records cannot both be answered right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from workloads.local import demo
from workloads.client.chat import converse
from workloads.client.report import eval_warnings
from workloads.context import TrainContext
from workloads.model_io.export import export_run, greedy_generate
from workloads.model_io.toy import write_chat_jsonl, write_toy_model
from workloads.train.config import preset, with_overrides
from workloads.train.records import hold_out, read_records

ENGLISH, FRENCH = "Answer in English.", "Answer in French."


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


CHATS = [
    chat(("system", ENGLISH), ("user", "What colour is snow?"), ("assistant", "White.")),
    chat(("system", FRENCH), ("user", "What colour is snow?"), ("assistant", "Blanc.")),
    chat(("system", ENGLISH), ("user", "What colour is coal?"), ("assistant", "Black.")),
    chat(("system", FRENCH), ("user", "What colour is coal?"), ("assistant", "Noir.")),
    chat(("user", "What colour is grass?"), ("assistant", "Green."), ("user", "And snow?"), ("assistant", "White.")),
]


def fine_tune(root: Path, *, chats: Path, steps: int, overrides: tuple[str, ...] = ()) -> Path:
    """The loop on one gloo rank from a fresh toy model; returns the run's checkpoint folder."""
    from workloads.train.loop import train

    base = write_toy_model(root / "base")
    cfg = with_overrides(preset("demo-cpu"), [
        f"model.name_or_path={base}", "data.kind=jsonl", f"data.path={chats}", "data.eval_fraction=0",
        "eval_every=0", f"steps={steps}", f"checkpoint_every={steps}", "seq_len=64", "micro_batch=4",
        "log_every=1000", "transport.expect=any", *overrides])
    out = root / "checkpoints"
    ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       report=lambda metrics, checkpoint_dir=None: None, latest_checkpoint=lambda: None,
                       scratch_dir=out)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> tuple[Path, Path]:
    """(the exported model folder, the chats it was trained on)."""
    root = tmp_path_factory.mktemp("own-chats")
    chats = write_chat_jsonl(root / "chats.jsonl", CHATS)
    out = fine_tune(root, chats=chats, steps=60)
    return export_run(str(out), out=str(root / "model")).local_folder, chats


def test_the_fine_tuned_model_answers_its_own_chats_asked_as_it_learned_them(fine_tuned):
    model, chats = fine_tuned
    questions = [demo.question_of(record) for record in read_records([chats])]
    answers = [greedy_generate(model, question.messages) for question in questions]
    assert answers == [question.answer for question in questions]
    # The system prompt is what tells the two snow records apart: asked without it, one must be wrong.
    assert questions[0].prompt == questions[1].prompt and answers[0] != answers[1]
    assert [m["role"] for m in questions[4].messages] == ["user"]  # the first answer follows the first user turn


def test_the_closing_question_is_a_held_out_record_when_there_are_any(tmp_path):
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", CHATS * 4)
    train = with_overrides(preset("demo-cpu"), ["data.kind=jsonl", f"data.path={chats}", "data.eval_fraction=0.1",
                                                "data.tokenizer=unused"]).to_dict()
    (first_held, *_) = sorted(hold_out(len(CHATS) * 4, fraction=0.1, seed=train["seed"]))
    question = demo.closing_question(train)
    assert question.held_out and question.where == f"{chats}:{first_held + 1}"
    record = CHATS[first_held % len(CHATS)]["messages"]
    assert question.messages == record[:2 if record[0]["role"] == "system" else 1]
    nothing_held = with_overrides(preset("demo-cpu"), [
        "data.kind=jsonl", f"data.path={chats}", "data.eval_fraction=0", "eval_every=0", "data.tokenizer=unused"])
    nothing_held = nothing_held.to_dict()
    question = demo.closing_question(nothing_held)
    assert not question.held_out and question.where == f"{chats}:1" and question.answer == "White."


def _records(*evals: float, loss: float = 0.0012) -> list[dict]:
    return [{"step": 50 * (i + 1), "loss": loss, "eval_loss": value} for i, value in enumerate(evals)]


def test_a_rising_eval_loss_and_a_tiny_held_out_set_are_said():
    """17 records, one held out, the eval loss 9.04 -> 11.24: the run said nothing."""
    (rising, tiny) = eval_warnings(_records(9.04, 9.9, 10.5, 11.24), data={"held_out": 1})
    assert rising.startswith("the eval loss rose at each of the last 3 evaluations, 9.0400 at step 50 to 11.2400 at "
                             "step 200, while the training loss went to 0.0012: the model is memorizing")
    assert "checkpoint.keep_best=true" in rising
    assert tiny.startswith("the eval loss is over 1 held-out record(s): too few")
    assert eval_warnings(_records(3.0, 2.0, 2.1), data={"held_out": 60}) == []  # one rise is noise
    assert eval_warnings(_records(3.0, 2.0, 1.5), data={"held_out": 60}) == []
    assert eval_warnings([{"step": 5, "loss": 1.0}], data={"kind": "synthetic"}) == []


def test_generation_takes_a_conversation_through_the_chat_template(fine_tuned):
    model, _ = fine_tuned
    assert greedy_generate(model, [{"role": "user", "content": "What colour is grass?"}]) == "Green."
    assert greedy_generate(model, "What colour is grass?") == "Green."  # a string is one user turn


def test_chat_answers_each_line_from_stdin_with_its_system_prompt(fine_tuned):
    model, _ = fine_tuned
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "workloads", "chat", str(model), "--system", FRENCH],
        input="What colour is snow?\n/reset\n\nWhat colour is coal?\n/exit\nWhat colour is snow?\n",
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Blanc.", "(a new conversation)", "Noir."]  # nothing after /exit


def test_a_conversation_carries_its_earlier_turns_until_reset():
    seen: list[list[dict]] = []
    said: list[str] = []

    def reply(messages: list[dict]) -> str:
        seen.append([dict(m) for m in messages])
        return f"answer {len(seen)}"

    converse(["hi\n", "and then?\n", "/reset\n", "again\n"], reply=reply, system="Be brief.", say=said.append)
    assert said == ["answer 1", "answer 2", "(a new conversation)", "answer 3"]
    assert [m["content"] for m in seen[1]] == ["Be brief.", "hi", "answer 1", "and then?"]
    assert [m["content"] for m in seen[2]] == ["Be brief.", "again"]


def test_keep_best_keeps_the_model_of_the_lowest_eval_loss(tmp_path):
    """checkpoint.keep_best: every evaluation saves a checkpoint scored by its eval loss, the best so far
    carries the exported model, and `export --checkpoint best` takes the lowest one's."""
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", CHATS * 4)
    out = fine_tune(tmp_path, chats=chats, steps=9, overrides=(
        "data.eval_fraction=0.2", "eval_every=3", "eval_batches=1", "checkpoint_every=0", "checkpoint.keep_best=true"))
    saved = {p.parent.name: json.loads(p.read_text())["eval_loss"] for p in out.glob("checkpoint-*/progress.json")}
    assert sorted(saved) == ["checkpoint-0000003", "checkpoint-0000006", "checkpoint-0000009"]
    best = min(saved, key=saved.get)
    exported = {p.parent.parent.name for p in out.glob("checkpoint-*/model/model.safetensors")}
    assert best in exported and "checkpoint-0000009" in exported  # the best so far at each step, and the last
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "workloads", "export", str(out), "--checkpoint", "best", "--out",
                           str(tmp_path / "best-model")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    assert f"copied from {out / best}" in done.stdout
    with pytest.raises(ValueError, match="checkpoint.keep_best keeps the checkpoint of the lowest eval loss, and "
                                         "eval_every is 0"):
        with_overrides(preset("demo-cpu"), ["eval_every=0", "checkpoint.keep_best=true"])
