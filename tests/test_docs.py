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


NODE_ID = re.compile(r"`((?:tests/)?test_\w+\.py)?::(test_\w+)")
"""A test named in a document: `tests/test_x.py::test_y`, `test_x.py::test_y`, or `::test_y` for
another test of the file named last."""


def test_every_test_a_document_names_exists(repo_root):
    """A threat model or policy table that names a test which no longer exists proves nothing."""
    missing = []
    for doc in documents(repo_root):
        named_last = None
        for match in NODE_ID.finditer(doc.read_text()):
            if match.group(1):
                named_last = match.group(1).removeprefix("tests/")
            path = repo_root / "tests" / (named_last or "")
            if not (named_last and path.is_file()
                    and re.search(rf"^def {match.group(2)}\(", path.read_text(), re.M)):
                missing.append(f"{doc.name}: {named_last}::{match.group(2)}")
    assert missing == []


def _readme(repo_root: Path) -> str:
    return " ".join((repo_root / "README.md").read_text().split())


DEMO_FIGURES = re.compile(r"the demo preset trains (\d+) steps of (\d+) rows \((\d+) per worker on its (\d+) "
                          r"workers\) of (\d+) tokens")


def test_the_readme_says_what_the_demo_trains(repo_root):
    """README said 8 rows a step where the console said 16 (8 per worker, 2 workers)."""
    from workloads.local import run as local
    from workloads.train.config import preset

    cfg, run = preset("demo-cpu"), local._arg_parser().parse_args([])
    found = DEMO_FIGURES.search(_readme(repo_root))
    assert found, "README no longer says what the demo trains in the form this test reads"
    steps, rows, per_worker, workers, seq_len = map(int, found.groups())
    assert (steps, per_worker, workers, seq_len) == (cfg.steps, cfg.samples_per_rank_per_step,
                                                     run.nodes * run.cpus_per_node, cfg.seq_len)
    assert rows == per_worker * workers


TEST_COUNTS = re.compile(r"skips the ([\d,]+) tests that start local Ray clusters or multi-process training \(([\d,]+) "
                         r"tests in")
COUNT_TOLERANCE = 0.05
"""How far the suite may grow or shrink from README's counts before they are to be written again."""


def test_the_readme_counts_the_tests_of_the_suite(request, repo_root):
    """Run with the whole suite (`make test`) or the fast one (`make test-fast`): README's counts of the
    fast and the slow tests are the collected ones, within COUNT_TOLERANCE."""
    config = request.config
    given = [Path(arg).resolve() for arg in config.args]
    if config.option.keyword or any(path != repo_root / "tests" for path in given):
        pytest.skip("counts only when the whole suite is collected")
    items = request.session.items
    slow = sum(1 for item in items if item.get_closest_marker("slow"))
    found = TEST_COUNTS.search(_readme(repo_root))
    assert found, "README no longer counts the tests in the form this test reads"
    said_slow, said_fast = (int(figure.replace(",", "")) for figure in found.groups())
    if config.option.markexpr == "not slow":
        assert abs(len(items) - said_fast) <= COUNT_TOLERANCE * said_fast, f"{len(items)} fast tests"
    elif not config.option.markexpr:
        assert abs(slow - said_slow) <= COUNT_TOLERANCE * said_slow, f"{slow} slow tests"
        assert abs(len(items) - slow - said_fast) <= COUNT_TOLERANCE * said_fast, f"{len(items) - slow} fast tests"
    else:
        pytest.skip("counts only the whole or the fast suite")


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
