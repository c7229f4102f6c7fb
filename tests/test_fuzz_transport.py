"""The NCCL log check under hostile and shuffled input (hypothesis).

Built from the real NCCL 2.28.9 captures (shared fixtures) and the synthetic multi-node logs:
- no text makes `parse_nccl_log` / `decide` / `render` raise;
- the verdict is the same however the processes' output is interleaved, with Ray's
  "(RayTrainWorker pid=N, ip=A.B.C.D)" prefix (colored or not) on every line, and with unrelated
  output between the lines. A process's own lines keep their order, as in any real log: the parser
  gives a connection line to the last communicator its process created.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from workloads.transport.nccl_log import parse_nccl_log
from workloads.transport.verify import Verdict, decide, render, verify_transport

SYNTHETIC = Path(__file__).parent / "fixtures" / "nccl_synthetic"
REAL_LOGS = ("h200x2-forced-socket.log", "h200x2-single-node-p2p.log")
SYNTHETIC_LOGS = tuple(sorted(p.name for p in SYNTHETIC.glob("*.log")))
_PROCESS = re.compile(r"(?P<host>[\w.\-]+):(?P<pid>\d+):\d+ \[\d+\] NCCL (INFO|WARN|TRACE) ")
_ANSI_OR_RAY = re.compile(r"^(\x1b\[[0-9;]*m)?\([^()]*pid=\d+[^()]*\)(\x1b\[[0-9;]*m)?\s*")

EXAMPLES_PER_LOG = 40
"""Hypothesis examples per fixture log and per property."""
EXAMPLES_ARBITRARY = 400
"""Hypothesis examples of arbitrary text and of mixed real/garbage lines."""
_FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Log:
    name: str
    nodes: int
    """Node count the log was made on (the value `--nodes` is given)."""
    lines: tuple[str, ...]

    def streams(self) -> dict[str, list[str]]:
        """Lines grouped by the process that printed them, in order; "" holds unrelated lines."""
        out: dict[str, list[str]] = {}
        for line in self.lines:
            m = _PROCESS.search(line)
            out.setdefault(f"{m['host']}:{m['pid']}" if m else "", []).append(line)
        return out


def _load(path: Path, nodes: int) -> Log:
    return Log(name=path.name, nodes=nodes, lines=tuple(path.read_text().splitlines()))


@pytest.fixture(scope="module")
def logs(shared_dir: Path) -> dict[str, Log]:
    real = {name: _load(shared_dir / "fixtures" / "nccl" / name, 1) for name in REAL_LOGS}
    synthetic = {name: _load(SYNTHETIC / name, 2) for name in SYNTHETIC_LOGS}
    return {**real, **synthetic}


def verdict_key(verdict: Verdict) -> tuple:
    """Everything a verdict says, independent of the order lines were read in."""
    return (verdict.status, frozenset(verdict.problems), frozenset(verdict.gaps),
            frozenset(verdict.links), verdict.hosts)


def judge(log: Log, lines: list[str]) -> tuple:
    return verdict_key(verify_transport("\n".join(lines), nodes=log.nodes))


def interleave(streams: list[list[str]], rng: random.Random) -> list[str]:
    """One random interleaving that keeps each stream's own order."""
    queues = [list(reversed(s)) for s in streams if s]
    out: list[str] = []
    while queues:
        i = rng.randrange(len(queues))
        out.append(queues[i].pop())
        if not queues[i]:
            queues.pop(i)
    return out


def ray_prefixed(line: str, *, colored: bool, address: str) -> str:
    """The line as Ray's driver prints a worker's output; lines already prefixed keep theirs."""
    if _ANSI_OR_RAY.match(line):
        return line
    m = _PROCESS.search(line)
    pid = m["pid"] if m else "3301"
    actor = "RayTrainWorker" if m else "TrainController"
    prefix = f"({actor} pid={pid}, ip={address})"
    return f"\x1b[36m{prefix}\x1b[0m {line}" if colored else f"{prefix} {line}"


ALL_LOGS = REAL_LOGS + SYNTHETIC_LOGS
seeds = st.integers(min_value=0, max_value=2 ** 32 - 1)
unrelated_lines = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=120).filter(
        lambda s: "NCCL" not in s),
    st.sampled_from([
        "2026-11-30 05:10:02,118\tINFO worker.py:1942 -- Connected to Ray cluster.",
        "(autoscaler +12s) Tip: use `ray status` to view detailed cluster status.",
        "W1130 05:02:40.130000 690 torch/distributed/run.py:851] *****",
        "Training finished iteration 3 at 2026-11-30 05:11:09. Total running time: 1min 2s",
        "{'loss': 2.3025, 'tokens_per_s': 36989.0, 'step': 10}",
        "[repeated 7x across cluster]",
        "(RayTrainWorker pid=4100, ip=10.0.1.5) Setting up process group for: env://",
    ]))


@pytest.mark.parametrize("name", ALL_LOGS)
@settings(_FUZZ, max_examples=EXAMPLES_PER_LOG)
@given(seed=seeds)
def test_verdict_is_the_same_however_processes_interleave(logs, name, seed):
    log = logs[name]
    shuffled = interleave(list(log.streams().values()), random.Random(seed))
    assert sorted(shuffled) == sorted(log.lines)
    assert judge(log, shuffled) == judge(log, list(log.lines))


@pytest.mark.parametrize("name", ALL_LOGS)
@settings(_FUZZ, max_examples=EXAMPLES_PER_LOG)
@given(seed=seeds, colored=st.booleans(),
       address=st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t))))
def test_verdict_is_the_same_with_rays_prefix(logs, name, seed, colored, address):
    log = logs[name]
    shuffled = interleave(list(log.streams().values()), random.Random(seed))
    prefixed = [ray_prefixed(line, colored=colored, address=address) for line in shuffled]
    assert judge(log, prefixed) == judge(log, list(log.lines))


@pytest.mark.parametrize("name", ALL_LOGS)
@settings(_FUZZ, max_examples=EXAMPLES_PER_LOG)
@given(seed=seeds, other=st.lists(unrelated_lines, min_size=1, max_size=40))
def test_verdict_is_the_same_with_unrelated_output_between_lines(logs, name, seed, other):
    log = logs[name]
    streams = [*log.streams().values(), other]
    mixed = interleave(streams, random.Random(seed))
    assert judge(log, mixed) == judge(log, list(log.lines))


def _full_pipeline(text: str) -> None:
    parsed = parse_nccl_log(text)
    for expect in ("efa", "any"):
        for nodes in (None, 1, 2):
            verdict = decide(parsed, expect=expect, nodes=nodes)
            assert render(verdict).startswith(verdict.status.value.upper())
            json.dumps(verdict.to_json())


@settings(_FUZZ, max_examples=EXAMPLES_ARBITRARY)
@given(text=st.text())
def test_arbitrary_text_never_raises(text):
    _full_pipeline(text)


@st.composite
def mangled_real_lines(draw, *, pool: tuple[str, ...]) -> str:
    """A real NCCL line cut short, or with a span of it replaced by garbage."""
    line = draw(st.sampled_from(pool))
    start = draw(st.integers(0, len(line)))
    end = draw(st.integers(start, len(line)))
    return line[:start] + draw(st.text(max_size=8)) + line[end:]


def _connection_and_comm_lines() -> tuple[str, ...]:
    wanted = re.compile(r"NCCL (INFO|WARN) (Channel|.*comm 0x|NVLS comm|NET/OFI Selected)")
    return tuple(line for p in sorted(SYNTHETIC.glob("*.log"))
                 for line in p.read_text().splitlines() if wanted.search(line))


POOL = _connection_and_comm_lines()


@settings(_FUZZ, max_examples=EXAMPLES_ARBITRARY)
@given(lines=st.lists(st.one_of(st.sampled_from(POOL), mangled_real_lines(pool=POOL), st.text()),
                      max_size=60))
def test_real_line_shapes_mixed_with_garbage_never_raise(lines):
    assume(lines)
    _full_pipeline("\n".join(lines))


def test_the_fixtures_cover_every_verdict(logs):
    """The invariance properties above are not vacuous: the logs span pass, fail and inconclusive,
    and the interleaving has more than one process to shuffle in each."""
    statuses = {judge(log, list(log.lines))[0].value for log in logs.values()}
    assert statuses == {"pass", "fail", "inconclusive"}
    assert all(len([k for k in log.streams() if k]) >= 2 for log in logs.values())
