"""`python -m workloads <command>`: each command is its own module with a `main(argv) -> int`."""

from __future__ import annotations

import importlib
import sys

from workloads.venv_hint import dependencies_of

COMMANDS = {
    "run": ("workloads.local.run", "train on a Ray cluster started on this machine (--local)"),
    "submit": ("workloads.client.submit", "submit the fine-tune to a stack's RayCluster and follow it"),
    "logs": ("workloads.client.submit", "print or follow a submitted job's logs"),
    "stop": ("workloads.client.submit", "stop a submitted job"),
    "list": ("workloads.client.submit", "list the jobs of a RayCluster"),
    "plan": ("workloads.client.plan", "memory per GPU, tokens/s and cost of a run, without a cluster"),
    "verify-transport": ("workloads.transport.verify", "check NCCL logs: did ranks talk over EFA?"),
    "export": ("workloads.client.export", "a run's checkpoint as a Hugging Face folder (local or s3://)"),
    "runs": ("workloads.client.runs", "list the local runs: status, steps, losses, model"),
    "chat": ("workloads.client.chat", "talk to a trained model, one line a turn, with its chat template"),
    "evaluate": ("workloads.client.evaluate", "score a run's model against its base with lm-eval, with a gate"),
}


def usage() -> str:
    lines = ["usage: python -m workloads <command> [options]", "", "commands:"]
    lines += [f"  {name:<17} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`python -m workloads <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    with dependencies_of("workloads"):
        module = importlib.import_module(COMMANDS[command][0])
        return module.main(command, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
