"""Runs command lines (`python -m MODULE ARGS`) as forked children of one interpreter that imported
the heavy libraries once, so that a table of them does not pay torch's import in every row.

Each child is its own process, as `python -m` would make it: its own working directory, environment,
stdout and stderr (files), `sys.argv` and `__main__`; an uncaught exception prints its traceback and
exits 1, `sys.exit("text")` prints the text and exits 1, and the exit functions run before it exits.
What it cannot show is a mistake in importing the command line itself: each module's own imports
still run in the child, but the libraries below them were imported in the parent.

Used by tests/test_cli_bad_input.py: `python tests/cli_forks.py < rows.json > results.json`, each row
{"module", "args", "cwd", "env", "stdout", "stderr"}; each result {"returncode", "seconds"}; two rows
at a time (CLI_FORKS_AT_ONCE).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
import traceback

PRELOAD = ("torch", "torch.distributed.fsdp", "transformers", "transformers.modeling_utils",
           "transformers.models.qwen2.modeling_qwen2", "boto3", "botocore.session", "rich.console")
"""Third-party libraries imported once, before any fork: what most rows would import again (torch
alone is 1.5 s; FSDP2 and a transformers model as much again for the rows that check a fit)."""


def _child(row: dict) -> None:
    code = 1
    try:
        os.chdir(row["cwd"])
        os.environ.update(row["env"])
        for fd, path in ((1, row["stdout"]), (2, row["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = [row["module"], *row["args"]]
        try:
            runpy.run_module(row["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:  # as the interpreter reads it
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run(rows: list[dict], *, at_once: int) -> list[dict]:
    """Each row in a child of its own, `at_once` of them at a time; their results in row order."""
    results: list[dict] = [{} for _ in rows]
    running: dict[int, tuple[int, float]] = {}

    def reap() -> None:
        pid, status = os.wait()
        index, started = running.pop(pid)
        results[index] = {"returncode": os.waitstatus_to_exitcode(status),
                          "seconds": round(time.perf_counter() - started, 3)}

    for index, row in enumerate(rows):
        if len(running) >= at_once:
            reap()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(row)
        running[pid] = (index, time.perf_counter())
    while running:
        reap()
    return results


def main() -> int:
    rows = json.load(sys.stdin)
    for name in PRELOAD:
        __import__(name)
    json.dump(run(rows, at_once=int(os.environ.get("CLI_FORKS_AT_ONCE", "2"))), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
