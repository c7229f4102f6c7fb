"""What `make demo` adds around the job: its inputs made locally, and the model it gives back.

Before the job: a toy pretrained-format Qwen2 folder (random weights, save_pretrained) and its
tokenizer, and a small chat JSONL, all under runs/<stamp>/ (workloads/model_io/toy.py); the job
fine-tunes the one on the other (the JSONL travels with the job). After it: the run's model is
exported to runs/<stamp>/model/, loaded back with from_pretrained, and asked a question.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console

DEMO_PRESET = "demo-cpu"
CONVERSATIONS = 600


def demo_inputs(run_dir: Path, *, preset_name: str, overrides: list[str]) -> list[str]:
    """The overrides that point the demo preset at a toy model and chat data made in run_dir; none
    for another preset, or when --set already chose the model or the data."""
    if preset_name != DEMO_PRESET or any(o.startswith(("model.", "data.")) for o in overrides):
        return []
    from workloads.model_io.toy import toy_conversations, write_chat_jsonl, write_toy_model

    base = write_toy_model(run_dir / "base-model")
    chats = write_chat_jsonl(run_dir / "chat.jsonl", toy_conversations(CONVERSATIONS))
    return [f"model.name_or_path={base}", "data.kind=jsonl", f"data.path={chats}", "data.eval_fraction=0.1"]


def show_model(run_dir: Path, console: Console, *, ask: bool) -> Optional[Path]:
    """Export the run's newest checkpoint to run_dir/model; with `ask`, print the reloaded model's
    greedy answer to the demo question."""
    from workloads.model_io.export import export_run, greedy_generate
    from workloads.model_io.toy import DEMO_PROMPT

    try:
        result = export_run(str(run_dir / "checkpoints"), out=str(run_dir / "model"))
    except ValueError as exc:
        console.print(f"[bold]model[/]   not exported: {exc}")
        return None
    console.print(f"[bold]model[/]   {result.out} ({result.dtype}, {result.how} from {Path(result.checkpoint).name})")
    if ask:
        answer = greedy_generate(result.local_folder, DEMO_PROMPT)
        console.print(f"[bold]generate[/] {DEMO_PROMPT} -> [bold green]{answer}[/]")
    return result.local_folder
