"""What `make demo` adds around the job: its inputs made locally, and the model it gives back.

Before the job: a toy pretrained-format Qwen2 folder (random weights, save_pretrained) and its
tokenizer, and a small chat JSONL, all under runs/<stamp>/ (workloads/model_io/toy.py); the job
fine-tunes the one on the other (the JSONL travels with the job). With the user's own data
(`--set data.kind=jsonl --set data.path=FILE`) and no model, the toy model is made alone and trained
on that data: its tokenizer reads any text. After the job: the run's model is exported to
runs/<stamp>/model/, loaded back with from_pretrained, and asked a question: the demo's, or the
first user turn of the user's chats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

DEMO_PRESET = "demo-cpu"
CONVERSATIONS = 600


@dataclass(frozen=True, kw_only=True)
class DemoInputs:
    """What the demo makes under the run's folder before the job starts, and the overrides that
    point the config at it. Nothing is written until `write_demo_inputs`."""

    overrides: tuple[str, ...] = ()
    model: Optional[Path] = None
    """The toy model folder to write (model.name_or_path), or None."""
    chats: Optional[Path] = None
    """The toy chats to write (data.path), or None: the user's data, or no data."""

    @property
    def fields(self) -> frozenset[str]:
        """The config fields whose files the demo makes (not the user's to check beforehand)."""
        return frozenset({"model.name_or_path"} if self.model else set()) | frozenset(
            {"data.path"} if self.chats else set())


def plan_demo_inputs(run_dir: Path, *, preset_name: str, overrides: list[str]) -> DemoInputs:
    """The demo preset's inputs: the toy model and chats when --set chose neither model nor data; the
    toy model alone when it chose data but no model (a named architecture has no tokenizer to read
    the data with); nothing for another preset, or when --set chose the model."""
    if preset_name != DEMO_PRESET or any(o.startswith("model.") for o in overrides):
        return DemoInputs()
    model = run_dir / "base-model"
    if any(o.startswith("data.") for o in overrides):
        return DemoInputs(overrides=(f"model.name_or_path={model}",), model=model)
    chats = run_dir / "chat.jsonl"
    return DemoInputs(overrides=(f"model.name_or_path={model}", "data.kind=jsonl", f"data.path={chats}",
                                 "data.eval_fraction=0.1"), model=model, chats=chats)


def write_demo_inputs(inputs: DemoInputs) -> None:
    if inputs.model is None and inputs.chats is None:
        return
    from workloads.model_io.toy import toy_conversations, write_chat_jsonl, write_toy_model

    if inputs.model is not None:
        write_toy_model(inputs.model)
    if inputs.chats is not None:
        write_chat_jsonl(inputs.chats, toy_conversations(CONVERSATIONS))


def first_question(train: dict) -> Optional[str]:
    """The first user turn of the run's chat data (a local JSONL file), to ask the trained model; None
    for other data."""
    data = train["data"]
    if data.get("kind") != "jsonl" or "://" in str(data.get("path")):
        return None
    try:
        with open(data["path"], encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line) if line.strip() else None
                messages = record.get(data.get("messages_field") or "messages") if isinstance(record, dict) else None
                for message in messages if isinstance(messages, list) else ():
                    if isinstance(message, dict) and message.get("role") == "user":
                        return str(message.get("content", ""))
    except (OSError, ValueError):
        return None
    return None


def show_model(run_dir: Path, console: Console, *, prompt: Optional[str]) -> Optional[Path]:
    """Export the run's newest checkpoint to run_dir/model; with a `prompt`, print the reloaded
    model's greedy answer to it."""
    from workloads.model_io.export import export_run, greedy_generate

    try:
        result = export_run(str(run_dir / "checkpoints"), out=str(run_dir / "model"))
    except ValueError as exc:
        console.print(f"[bold]model[/]   not exported: {exc}")
        return None
    console.print(f"[bold]model[/]   {result.out} ({result.dtype}, {result.how} from {Path(result.checkpoint).name})")
    if prompt:
        answer = greedy_generate(result.local_folder, prompt)
        console.print(f"[bold]generate[/] {prompt} -> [bold green]{answer}[/]")
    return result.local_folder
