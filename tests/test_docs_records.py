"""Figures quoted in docs/ come from records committed beside them (docs/gpu/, docs/cpu/): a
measured figure with no record behind it, or a transcript that read files that were not kept,
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
GPU_RECORDS = DOCS / "gpu"
NUMBER = re.compile(r"\d+\.\d+")


def _record_numbers(folder: Path) -> set[str]:
    return {n for p in folder.rglob("*") if p.is_file() for n in NUMBER.findall(p.read_text(errors="replace"))}


def _recorded(figure: str, numbers: set[str]) -> bool:
    """A figure is recorded when some recorded number, rounded to the figure's decimals, is it."""
    places = len(figure.split(".")[1])
    return any(len(n.split(".")[1]) >= places and f"{float(n):.{places}f}" == figure for n in numbers)


@pytest.mark.parametrize("doc", ["TRANSPORT.md", "PERFORMANCE.md"])
def test_every_bandwidth_figure_is_in_a_gpu_record(doc):
    figures = set(re.findall(r"(\d+\.\d+) GB/s", (DOCS / doc).read_text()))
    assert figures, f"no bandwidth figure found in {doc}"
    numbers = _record_numbers(GPU_RECORDS)
    assert sorted(f for f in figures if not _recorded(f, numbers)) == []


def test_every_nccl_log_a_gpu_transcript_names_is_committed():
    committed = {p.name for p in GPU_RECORDS.rglob("nccl.*.log")}
    named = {
        name
        for p in GPU_RECORDS.rglob("*.txt")
        for name in re.findall(r"nccl\.[\w-]+\.\d+\.log", p.read_text(errors="replace"))
    }
    assert named, "no transcript names an NCCL log"
    assert sorted(named - committed) == []
