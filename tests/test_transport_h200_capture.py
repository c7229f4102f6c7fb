"""The offline verifier on NCCL logs captured on H200s (docs/gpu/): the in-band gate runs on 2x H200,
and the rehearsal's two emulated hosts (a Ray worker node each, its own NCCL_HOSTID).

The NVLink run's logs also say "Using network Socket" (NCCL initialises a net plugin even when no
traffic uses it): the verdict must come from the connections, so that run passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workloads.transport.verify import main

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNS = REPO_ROOT / "docs" / "gpu" / "2026-11-30-h200x2"


@pytest.mark.parametrize(("folder", "exit_code"), [("gate-nvlink-nccl", 0), ("gate-socket-nccl", 1)])
def test_captured_gate_logs(folder: str, exit_code: int, capsys: pytest.CaptureFixture[str]) -> None:
    logs = sorted(str(p) for p in (RUNS / folder).glob("nccl.*.log"))
    assert len(logs) == 2, logs
    assert "Using network Socket" in Path(logs[0]).read_text()
    assert main("verify-transport", [*logs, "--nodes", "1"]) == exit_code
    out = capsys.readouterr().out
    assert ("P2P/CUMEM" if exit_code == 0 else "NET/Socket within a node") in out


REHEARSAL = Path(__file__).resolve().parent.parent / "docs" / "gpu" / "2026-12-01-h200-rehearsal" / "a-any-nccl"


@pytest.mark.parametrize(("expect", "exit_code"), [("any", 0), ("efa", 1)])
def test_rehearsal_two_host_logs(expect: str, exit_code: int, capsys: pytest.CaptureFixture[str]) -> None:
    """One rank per emulated host, connected over sockets: two nodes as NCCL counts them, whose link
    is a network (fine under --expect any) and not EFA."""
    logs = sorted(str(p) for p in REHEARSAL.glob("nccl.*.log"))
    assert len(logs) == 2, logs
    assert main("verify-transport", [*logs, "--expect", expect, "--nodes", "2"]) == exit_code
    out = capsys.readouterr().out
    assert "2 link(s) between nodes over NET/Socket" in out and "on 2 node(s)" in out


def _documented_output(command: str) -> str:
    """The lines docs/TRANSPORT.md shows under `$ <command>`, up to the next command or block end."""
    doc = (REPO_ROOT / "docs" / "TRANSPORT.md").read_text()
    after = doc.split(f"$ {command}\n", 1)[1]
    return after.split("\n$ ", 1)[0].split("\n```", 1)[0] + "\n"


@pytest.mark.parametrize("folder", ["gate-nvlink-nccl", "gate-socket-nccl"])
def test_the_documented_verdicts_are_those_of_the_committed_logs(folder, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    rel = f"docs/gpu/2026-11-30-h200x2/{folder}"
    logs = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / rel).glob("*.log"))
    main("verify-transport", [*logs, "--nodes", "1"])
    assert capsys.readouterr().out == _documented_output(f"python -m workloads verify-transport {rel}/*.log --nodes 1")
