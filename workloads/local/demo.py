"""What `make demo` adds around the job: its inputs made locally, and the model it gives back.

Before the job: a toy pretrained-format Qwen2 folder (random weights, save_pretrained) and its
tokenizer, and a small chat JSONL, all under runs/<name>/ (workloads/model_io/toy.py); the job
fine-tunes the one on the other (the JSONL travels with the job). With the user's own data
(`--set data.kind=jsonl --set data.path=FILE`) and no model, the toy model is made alone and trained
on that data: its tokenizer reads any text. After the job: the run's model is exported to
runs/<name>/model/, loaded back with from_pretrained, and asked a question: the demo's, or one of
the user's chats (`closing_question`), a held-out one when the run held some out (one it trained on
says little: a model that memorized it answers it too). The question is asked as the model saw it
in training: the chat template over the record's conversation up to its first answer, its system
prompt and earlier turns included. Asked as a bare user turn, a model fine-tuned on chats that had a
system prompt answered its own training data wrong ("What colour is snow? -> Whg.", at a training
loss of 0.0012): the context it learned the answer in was not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from rich.console import Console

DEMO_PRESET = "demo-cpu"
DPO_DEMO_PRESET = "demo-cpu-dpo"
"""The demo's DPO variant: toy preference pairs instead of toy chats (`run --local --preset demo-cpu-dpo`)."""
CONVERSATIONS = 600
PAIRS = 400


@dataclass(frozen=True, kw_only=True)
class DemoInputs:
    """What the demo makes under the run's folder before the job starts, and the overrides that
    point the config at it. Nothing is written until `write_demo_inputs`."""

    overrides: tuple[str, ...] = ()
    model: Optional[Path] = None
    """The toy model folder to write (model.name_or_path), or None."""
    chats: Optional[Path] = None
    """The toy chats to write (data.path), or None: the user's data, or no data."""
    pairs: bool = False
    """`chats` holds toy preference pairs (the DPO demo's), whose chosen answer follows the rule."""

    @property
    def fields(self) -> frozenset[str]:
        """The config fields whose files the demo makes (not the user's to check beforehand)."""
        return frozenset({"model.name_or_path"} if self.model else set()) | frozenset(
            {"data.path"} if self.chats else set())


def plan_demo_inputs(run_dir: Path, *, preset_name: str, overrides: list[str]) -> DemoInputs:
    """The demo preset's inputs: the toy model and chats when --set chose neither model nor data; the
    toy model alone when it chose data but no model (a named architecture has no tokenizer to read
    the data with); nothing for another preset, or when --set chose the model."""
    if preset_name not in (DEMO_PRESET, DPO_DEMO_PRESET) or any(o.startswith("model.") for o in overrides):
        return DemoInputs()
    model = run_dir / "base-model"
    if any(o.startswith("data.") for o in overrides):
        return DemoInputs(overrides=(f"model.name_or_path={model}",), model=model)
    pairs = preset_name == DPO_DEMO_PRESET
    chats = run_dir / ("pairs.jsonl" if pairs else "chat.jsonl")
    return DemoInputs(overrides=(f"model.name_or_path={model}", "data.kind=jsonl", f"data.path={chats}",
                                 "data.eval_fraction=0.1"), model=model, chats=chats, pairs=pairs)


def write_demo_inputs(inputs: DemoInputs) -> None:
    if inputs.model is None and inputs.chats is None:
        return
    from workloads.model_io.toy import toy_conversations, toy_preference_pairs, write_chat_jsonl, write_toy_model

    if inputs.model is not None:
        write_toy_model(inputs.model)
    if inputs.chats is not None:
        records = toy_preference_pairs(PAIRS) if inputs.pairs else toy_conversations(CONVERSATIONS)
        write_chat_jsonl(inputs.chats, records)


@dataclass(frozen=True, kw_only=True)
class Question:
    """A chat record asked of the trained model as training showed it the record."""

    messages: list[dict]
    """The conversation up to the record's first answer: its system prompt, earlier turns and the
    user turn the answer follows."""
    answer: str
    """What the record answers there."""
    where: str
    """The record's file:line."""
    held_out: bool
    """The record was held out of training (for the eval loss)."""

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


def question_of(record, *, held_out: bool = False) -> Optional[Question]:
    """The record's first answer as a question (None for a text record, or a chat that opens with an
    answer: nothing asks for it)."""
    if not record.is_chat:
        return None
    first = next(i for i, message in enumerate(record.messages)
                 if message["role"] == "assistant" and i >= record.learned_from)
    if not first:
        return None
    return Question(messages=record.messages[:first], answer=record.messages[first]["content"], where=record.where,
                    held_out=held_out)


def closing_question(train: dict) -> Optional[Question]:
    """What to ask the model a run trained on a local file of chats: its first held-out chat (the
    records the loop held out, chosen the same way), else its first chat; None for other data."""
    from workloads.train.records import hold_out, read_records

    data = train["data"]
    if data.get("kind") != "jsonl" or "://" in str(data.get("path")):
        return None
    try:
        records = read_records([Path(data["path"])], text_field=data["text_field"],
                               messages_field=data["messages_field"], limit=int(data.get("max_examples") or 0),
                               data_format=data.get("format") or "auto")
    except (OSError, ValueError):
        return None
    held = hold_out(len(records), fraction=float(data["eval_fraction"]), seed=int(train["seed"]))
    for i in [*sorted(held), *(i for i in range(len(records)) if i not in held)]:
        if (question := question_of(records[i], held_out=i in held)) is not None:
            return question
    return None


def show_model(run_dir: Path, console: Console, *, question: Union[Question, str, None],
               checkpoint: Optional[str] = None) -> Optional[Path]:
    """Export the run's newest checkpoint (or `checkpoint`: "best" for the lowest eval loss's) to
    run_dir/model; with a `question`, print the reloaded model's greedy answer to it (a record's,
    beside the record's own answer)."""
    from workloads.client.run_record import submitted_base
    from workloads.model_io.export import export_run, greedy_generate

    try:
        result = export_run(str(run_dir / "checkpoints"), out=str(run_dir / "model"), checkpoint=checkpoint,
                            overwrite=True, submitted_base=submitted_base)
    except ValueError as exc:
        console.print(f"[bold]model[/]   not exported: {exc}")
        return None
    console.print(f"[bold]model[/]   {result.out} ({result.dtype}, {result.how} from {Path(result.checkpoint).name})")
    if isinstance(question, str):
        answer = greedy_generate(result.local_folder, question)
        console.print(f"[bold]generate[/] {question} -> [bold green]{answer}[/]")
    elif question is not None:
        answer = greedy_generate(result.local_folder, question.messages)
        which = "held-out" if question.held_out else "training"
        context = f", after its {len(question.messages) - 1} earlier message(s)" if len(question.messages) > 1 else ""
        style = "bold green" if answer == question.answer.strip() else "bold yellow"
        console.print(f"[bold]generate[/] {question.prompt} -> [{style}]{answer}[/] ({which} record "
                      f"{question.where}{context}; its answer: {question.answer})", highlight=False)
    return result.local_folder
