"""The GPU rehearsal hands the Ray token to the user's `submit` command by its environment: a command
line is every account's to read (`ps`, /proc/PID/cmdline), and the rehearsal logs each one it runs
(issue 50). The cluster and the commands it runs are stand-ins here: what is checked is what the
rehearsal gives them and writes."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

from workloads.rehearse import rehearsal
from workloads.local import run as local

TOKEN = "7" * 64


class _Command:
    """subprocess.Popen for the commands the rehearsal runs: keeps each one's argv and environment,
    and prints a line as if it had run."""

    started: list[SimpleNamespace] = []

    def __init__(self, argv, **kwargs):
        self.started.append(SimpleNamespace(argv=list(argv), env=dict(kwargs.get("env") or os.environ)))
        self.stdout = iter(["train step 1/1\n"])

    def wait(self) -> int:
        return 0


def test_the_token_reaches_submit_by_its_environment_never_by_a_command_line_or_a_logged_line(
        tmp_path, monkeypatch, capsys):
    @contextlib.contextmanager
    def cluster(spec, *, log_dir):
        yield SimpleNamespace(address="http://127.0.0.1:8265", token=TOKEN, nodes=None)

    monkeypatch.setattr(local, "local_ray_cluster", cluster)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the rehearsal sets stays in this test
    monkeypatch.setattr(_Command, "started", [])
    monkeypatch.setattr(rehearsal.subprocess, "Popen", _Command)
    out = tmp_path / "out"
    assert rehearsal.main(["--out", str(out), "--cpus-only", "--cases", "a-any", "--steps", "1"]) == 0

    submits = [run for run in _Command.started if run.argv[1:4] == ["-m", "workloads", "submit"]]
    assert len(submits) == 1 and len(_Command.started) == 3  # submit, then verify-transport twice
    assert not [run.argv for run in _Command.started if any(TOKEN in arg for arg in run.argv)]
    logged = {path.name: path.read_text() for path in out.rglob("*") if path.is_file()}
    assert "a-any.txt" in logged and logged["a-any.txt"].startswith("$ ")
    assert not [name for name, text in logged.items() if TOKEN in text]
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err
    assert submits[0].env["RAY_AUTH_TOKEN"] == TOKEN
