"""`python -m workloads chat RUN`: talk to a trained model, one line a turn, with its chat template.

    python -m workloads chat RUN [--system TEXT] [--max-new-tokens N] [--trust-remote-code]

RUN is a local run's name (a folder of runs/), a run folder (its exported `model/` is used), or a
Hugging Face model folder (an `export --out` folder). Each line read is a user turn; the model's
answer follows, greedy, rendered with the model's own chat template over the whole conversation so
far (as training rendered its chats), `--system` as its system prompt. `/reset` starts a new
conversation, `/exit` or the end of input ends. The prompt `you>` is shown only on a terminal, so a
file or a pipe on standard input gives the answers alone, one line each. A folder's own Python code
(`auto_map` in its config) is never run unless --trust-remote-code says to.

Exit codes: 0 the input ended; 2 bad input (no such run, a run without an exported model).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterable, TextIO

from workloads.client.runs import RUNS_DIR, find_run
from workloads.client.usage import Parser, UsageError
from workloads.files import path_inside

EXIT_OK, EXIT_USAGE = 0, 2
RESET, EXIT = "/reset", "/exit"


def _arg_parser() -> Parser:
    parser = Parser(prog="python -m workloads chat", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a local run's name, a run folder, or a Hugging Face model folder")
    parser.add_argument("--system", default="", help="the conversation's system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the longest answer, in tokens")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help=f"where local runs are (default: {RUNS_DIR})")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (*.py named by auto_map in its config), "
                             "if it has some; off: it is never run")
    return parser


def model_folder(run: str, *, runs_dir: Path) -> Path:
    """The Hugging Face folder RUN names (module docstring); ValueError with what to do otherwise."""
    for candidate in (Path(run), find_run(runs_dir, run) or runs_dir / run):
        if (candidate / "config.json").is_file():
            return candidate
        model = path_inside(candidate, "model")  # a run folder's model/, never a link out of it
        if (model / "config.json").is_file():
            return model
        if (candidate / "checkpoints").is_dir():
            raise ValueError(f"run {str(candidate)!r} has no exported model/ (it did not finish): export a checkpoint "
                             f"with python -m workloads export {candidate}")
    raise ValueError(f"{run!r} is neither a run of {runs_dir}, a run folder, nor a model folder (config.json): "
                     "python -m workloads runs lists the local runs")


def converse(lines: Iterable[str], *, reply: Callable[[list[dict]], str], system: str = "",
             say: Callable[[str], None], prompt: Callable[[], None] = lambda: None) -> None:
    """Each line a user turn answered through `reply` (the conversation so far, the turn last)."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    prompt()
    for line in lines:
        text = line.strip()
        if text == EXIT:
            return
        if text == RESET:
            messages = list(opening)
            say("(a new conversation)")
        elif text:
            messages.append({"role": "user", "content": text})
            answer = reply(messages)
            messages.append({"role": "assistant", "content": answer})
            say(answer)
        prompt()


def chat(args, *, stdin: TextIO, stdout: TextIO) -> int:
    folder = model_folder(args.run, runs_dir=args.runs_dir)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    from workloads.model_io.export import ChatModel

    model = ChatModel(folder, trust_remote_code=args.trust_remote_code)
    interactive = stdin.isatty()
    if interactive:
        print(f"chatting with {folder} ({RESET} starts over, {EXIT} or Ctrl-D ends)", file=stdout)

    def say(text: str) -> None:
        print(text, file=stdout, flush=True)

    def prompt() -> None:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)

    converse(stdin, reply=lambda messages: model.reply(messages, max_new_tokens=args.max_new_tokens),
             system=args.system, say=say, prompt=prompt)
    return EXIT_OK


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser().parse_args(argv)
        return chat(args, stdin=sys.stdin, stdout=sys.stdout)
    except (UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
