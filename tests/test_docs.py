"""The documentation's references: every relative Markdown link reaches a file of the repository,
every mention of a document outside code is such a link, and every module a document runs and
source file it names exists (a module moved leaves no stale name behind)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")
PLAIN_DOC = re.compile(r"(?<![\[`/\w])(?<!\]\()docs/[A-Z_]+\.md(?![\]`\w])")


def documents(repo_root: Path) -> list[Path]:
    return [repo_root / "README.md", *sorted((repo_root / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.fixture(params=["README.md", "docs"], ids=str)
def docs(request, repo_root: Path) -> list[Path]:
    return [p for p in documents(repo_root) if (p.name == "README.md") == (request.param == "README.md")]


def test_relative_links_reach_files(docs):
    for doc in docs:
        for target in LINK.findall(prose(doc.read_text())):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: link to {target} reaches nothing"


def test_documents_are_named_by_links(docs):
    for doc in docs:
        assert PLAIN_DOC.findall(prose(doc.read_text())) == [], doc.name


def test_no_document_shows_a_path_of_the_machine_it_was_written_on(repo_root):
    for doc in documents(repo_root):
        assert not re.search(r"/(work|home|root)/\w", doc.read_text()), doc.name


def test_nothing_says_flash_attention_2_needs_a_micro_batch_of_one_row(repo_root):
    # transformers' flash_attention_2 runs its varlen kernel on the cu_seq_lens the batch passes, at
    # any micro-batch (modeling_flash_attention_utils._flash_attention_forward).
    sources = [*documents(repo_root), *sorted((repo_root / "workloads").rglob("*.py"))]
    claim = re.compile(r"flash_attention_2[^.;]*(micro[-_ ]batch(=| of )(1|one)|batch size 1)", re.I | re.S)
    for path in sources:
        assert not claim.search(path.read_text()), path.name


MODULE_RUN = re.compile(r"(?:python3?|torchrun)\b[^`\n]*? -m ((?:workloads|capacity|infra)(?:\.\w+)*)")
SOURCE_PATH = re.compile(r"(?<![\w/.])((?:workloads|capacity|infra|policy)/[\w/]*\w\.py)\b")


def outside_transcripts(text: str) -> str:
    """The text outside fenced code blocks: those quote commands as they were run when recorded."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_every_module_a_document_runs_is_one_of_the_project(repo_root):
    import importlib.util

    sources = [*documents(repo_root), repo_root / "docs" / "gpu" / "record.sh"]
    named = {(path.name, module) for path in sources
             for module in MODULE_RUN.findall(outside_transcripts(path.read_text()))}
    assert len(named) > 10, named
    missing = sorted((doc, module) for doc, module in named if importlib.util.find_spec(module) is None)
    assert not missing, f"documents run modules that do not exist: {missing}"


def test_every_source_file_a_document_names_exists(repo_root):
    named = {(doc.name, path) for doc in documents(repo_root) for path in SOURCE_PATH.findall(doc.read_text())}
    assert len(named) > 20, named
    missing = sorted((doc, path) for doc, path in named if not (repo_root / path).is_file())
    assert not missing, f"documents name files that do not exist: {missing}"
