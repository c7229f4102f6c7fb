"""Figures quoted in docs/ come from records committed beside them (docs/gpu/, docs/cpu/): a
measured figure with no record behind it, or a transcript that read files that were not kept,
fails here."""

from __future__ import annotations

import json
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


def _design_figures(text: str, design: str) -> set[str]:
    """Bandwidths a doc quotes from the shared design's measured facts, saying so: each on a line
    that names DESIGN.md and found in the design itself."""
    quoted = {f for line in text.splitlines() if "DESIGN.md" in line for f in re.findall(r"(\d+\.\d+) GB/s", line)}
    return {f for f in quoted if f"{f} GB/s" in design}


@pytest.mark.parametrize("doc", ["TRANSPORT.md", "PERFORMANCE.md"])
def test_every_bandwidth_figure_is_in_a_gpu_record(doc, shared_dir):
    text = (DOCS / doc).read_text()
    figures = set(re.findall(r"(\d+\.\d+) GB/s", text))
    assert figures, f"no bandwidth figure found in {doc}"
    numbers = _record_numbers(GPU_RECORDS)
    quoted = _design_figures(text, (shared_dir / "DESIGN.md").read_text())
    assert sorted(f for f in figures if not _recorded(f, numbers) and f not in quoted) == []


def test_a_design_figure_counts_only_where_the_line_cites_the_design():
    design = "sockets on loopback, 4.1 GB/s all-reduce busbw"
    assert _design_figures("network at 4.1 GB/s (../shared/DESIGN.md's loopback figure)", design) == {"4.1"}
    assert _design_figures("network at 4.1 GB/s (the loopback's figure)", design) == set()
    assert _design_figures("network at 4.2 GB/s (DESIGN.md)", design) == set()


def test_every_nccl_log_a_gpu_transcript_reads_is_committed():
    """The logs a recorded command was run on (its `$ ...` line) are committed; a log a job merely
    mentions (a rank's gate verdict names its log file) is not evidence of anything."""
    committed = {p.name for p in GPU_RECORDS.rglob("nccl.*.log")}
    named = {
        name
        for p in GPU_RECORDS.rglob("*.txt")
        for line in p.read_text(errors="replace").splitlines() if line.startswith("$ ")
        for name in re.findall(r"nccl\.[\w-]+\.\d+\.log", line)
    }
    assert named, "no transcript names an NCCL log"
    assert sorted(named - committed) == []


def _section(doc: str, start: str, end: str = "\n## ") -> str:
    """The text of docs/`doc` from `start` to the next `end`."""
    return (DOCS / doc).read_text().split(start, 1)[1].split(end, 1)[0]


def _table_rows(section: str, row: str) -> list[tuple[str, ...]]:
    """The cells of the Markdown table rows of `section` that match the regular expression `row`."""
    return [tuple(cell.strip() for cell in line.strip("|").split("|"))
            for line in section.splitlines() if re.match(row, line)]


WORKER_LOSS_RUN = re.compile(
    r"^fault injection: 1 worker SIGKILLed after step (\d+), resumed from step (\d+), (\d+) step\(s\) redone, "
    r"recovered and finished in ([\d.]+) s, wall ([\d.]+) s, .*\n(\d+) passed in ([\d.]+)s",
    re.MULTILINE,
)


def test_the_worker_loss_table_is_the_recorded_runs():
    record = (DOCS / "cpu" / "2026-12-01-worker-loss" / "runs.txt").read_text()
    assert "failed" not in record and "ERROR" not in record
    recorded = [
        (str(i), killed, resumed, redone, f"{kill_s} s", f"{wall_s} s", f"{pytest_s} s")
        for i, (killed, resumed, redone, kill_s, wall_s, _, pytest_s) in enumerate(
            WORKER_LOSS_RUN.findall(record), start=1)
    ]
    section = _section("RELIABILITY.md", "## 1. Worker loss")
    assert len(recorded) == 5 and _table_rows(section, r"\| \d+ \|") == recorded
    assert f"Faults injected: {len(recorded)} " in section
    assert f"Runs survived: {len(recorded)} of {len(recorded)}" in section


# One line per fault, as tests/test_cluster_faults.py prints it, and the table row it makes:
# (fault, resumed from step, steps redone, final step, data position, times, wall).
FAULT_LINES = {
    "save kill": (re.compile(
        r"save kill: .*, resumed from step (\d+), (\d+) steps redone, final step (\d+) at data position (\d+), "
        r"kill to end ([\d.]+) s, wall ([\d.]+) s"),
        lambda g: (g[0], g[1], g[2], g[3], f"kill to end {g[4]} s", f"{g[5]} s")),
    "node loss": (re.compile(
        r"node loss: node \d+ killed after step \d+, first wait message after ([\d.]+) s, node back ([\d.]+) s "
        r"after the kill, resumed from step (\d+), (\d+) step redone, final step (\d+) at data position (\d+), "
        r"end ([\d.]+) s after it was back, wall ([\d.]+) s"),
        lambda g: (g[2], g[3], g[4], g[5], f"wait said after {g[0]} s, back after {g[1]} s, end {g[6]} s later",
                   f"{g[7]} s")),
    "node gone": (re.compile(r"node gone: node \d+ killed after step \d+, job failed ([\d.]+) s later"),
                  lambda g: ("-", "-", "-", "-", f"failed {g[0]} s after the kill", "-")),
    "head loss": (re.compile(
        r"head loss: head restarted after step \d+ \(down ([\d.]+) s\), run resubmitted and resumed from step "
        r"(\d+), (\d+) step redone, final step (\d+) at data position (\d+), restart to end ([\d.]+) s, "
        r"wall ([\d.]+) s"),
        lambda g: (g[1], g[2], g[3], g[4], f"down {g[0]} s, restart to end {g[5]} s", f"{g[6]} s")),
}


def _fault_rows(record: str) -> list[tuple[str, ...]]:
    rows, run = [], None
    for line in record.splitlines():
        if re.fullmatch(r"run \d+:", line):
            run = line[4:-1]
        fault = line.split(":", 1)[0]
        if fault in FAULT_LINES:
            pattern, row = FAULT_LINES[fault]
            match = pattern.fullmatch(line)
            assert match, line
            rows.append((run, fault, *row(match.groups())))
    return rows


def test_the_fault_table_is_the_recorded_runs():
    record = (DOCS / "cpu" / "2026-12-02-cluster-faults" / "runs.txt").read_text()
    assert not re.search(r"\d+ failed|^(FAILED|ERROR) ", record, re.MULTILINE)
    runs = re.findall(r"^run \d+:$", record, re.MULTILINE)
    assert len(runs) == 3 and len(re.findall(r"^4 passed(, \d+ warnings)? in ", record, re.MULTILINE)) == len(runs)
    recorded = _fault_rows(record)
    assert len(recorded) == 4 * len(runs)
    section = _section("RELIABILITY.md", "## 2. ")
    assert _table_rows(section, r"\| \d+ \| [a-z]+ [a-z]+ \|") == recorded
    assert f"Runs that ended as they should: {len(runs)} of {len(runs)}" in section


def test_a_fault_line_that_changed_its_wording_is_not_skipped():
    with pytest.raises(AssertionError, match="node loss: node 2 killed"):
        _fault_rows("run 1:\nnode loss: node 2 killed after step 5, and then something else")


def test_the_one_h200_topology_table_is_the_recorded_bench():
    bench = json.loads((GPU_RECORDS / "2026-12-01-h200-topology" / "topology" / "bench.json").read_text())
    runs = {r["label"]: r for r in bench["figures"] if r["phase"] == "emulated"}
    predicted = {p["label"]: p for p in bench["model"]["predictions"]}
    recorded = [
        (f"`{label}`", f"{runs[label]['step_s']:.3f}", f"{runs[label]['tokens_per_s_per_gpu']:,.0f}",
         f"{runs[label]['communication']['exposed_s']:.3f}",
         f"{predicted[label]['predicted_step_s']:.3f} ({predicted[label]['error']:+.0%})")
        for label in ("auto", "flat", "hsdp-fp32")
    ]
    section = _section("PERFORMANCE.md", "**Recorded on one H200", "\n### ")
    assert [(row[0].split()[0], *row[1:]) for row in _table_rows(section, r"\| `")] == recorded
    (ratio,) = [c["ratio"] for c in bench["comparisons"] if c["label"].startswith("auto vs flat")]
    assert f"`auto` vs `flat` {ratio:.2f}x" in section


def _verdicts(name: str) -> dict[str, str]:
    """Mutant name -> mutmut's verdict symbol, from one recorded run."""
    lines = (DOCS / "cpu" / "2026-12-01-mutmut" / name).read_text().splitlines()
    return {mutant: verdict for verdict, mutant in (line.split() for line in lines if line[:1] in "🎉🙁⏰🫥")}


def test_the_mutation_table_is_the_recorded_runs():
    first = _verdicts("3-optim-metrics-raycluster.txt")
    now = {**_verdicts("6-optim-rerun.txt"), **_verdicts("5-raycluster-after-tests.txt")}
    rows = {}
    for line in (DOCS / "MUTATION.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| workloads/") or line.startswith("| infra/"):
            rows[cells[0]] = [int(re.match(r"\d+", c).group()) for c in cells[1:]]
    assert set(rows) == {"workloads/train/metrics.py", "workloads/train/optim.py", "infra/raycluster.py"}
    for path, (total, killed, survived, survived_now, untested) in rows.items():
        prefix = path.removesuffix(".py").replace("/", ".") + ".x"
        mine = {m: v for m, v in first.items() if m.startswith(prefix)}
        counts = {verdict: sum(v == verdict for v in mine.values()) for verdict in "🎉🙁🫥"}
        assert (total, killed, survived, untested) == (len(mine), counts["🎉"], counts["🙁"], counts["🫥"]), path
        assert survived_now == sum(v == "🙁" for m, v in now.items() if m.startswith(prefix)), path


CHATS_RECORD = GPU_RECORDS / "2026-12-02-h200-chats"


def test_the_packed_chats_table_is_the_recorded_runs():
    """PERFORMANCE.md's table of the job users run, row by row, against the bench.json files."""
    section = _section("PERFORMANCE.md", "## The job users run: packed chats")
    recorded = []
    for run, strategy in (("bench", "tuned"), ("bench", "tuned-chats"), ("synthetic-50", "tuned"),
                          ("bench-50", "tuned"), ("bench-50", "tuned-chats"),
                          ("bench-sdpa", "tuned-chats"), ("bench-flex_attention", "tuned-chats")):
        bench = json.loads((CHATS_RECORD / run / "bench.json").read_text())
        (figures,) = [f for f in bench["figures"] if f["strategy"] == strategy]
        recorded.append((f"{figures['tokens_per_s_per_gpu']:,.0f}", f"{figures['mfu_vs_peak']:.1%}",
                         f"{figures['step_s_median']:.4f}", f"{figures['peak_mem_gib']:.1f}"))
    rows = _table_rows(section, r"\| [\w-]+/ \(")
    assert [row[0].split()[0] for row in rows] == ["bench/", "bench/", "synthetic-50/", "bench-50/", "bench-50/",
                                                   "bench-sdpa/", "bench-flex_attention/"]
    assert [row[3:] for row in rows] == recorded
    ratios = []
    for run in ("bench", "bench-50"):
        document = json.loads((CHATS_RECORD / run / "bench.json").read_text())
        ratios += [c["ratio"] for c in document["comparisons"] if "chat vs synthetic" in c["label"]]
    assert (f"Chats against synthetic tokens in the same call: {ratios[0]:.3f}x at 30 steps" in section
            and f"and {ratios[1]:.3f}x at 50" in section)
    bench = json.loads((CHATS_RECORD / "bench" / "bench.json").read_text())
    chats = bench["chats"]
    assert f"{chats['mean_tokens']:,.0f} tokens a conversation" in section
    assert f"{chats['answer_share']:.1%} of them" in section


def test_the_kernel_and_cap_figures_are_the_recorded_ones():
    section = _section("PERFORMANCE.md", "## The job users run: packed chats")
    kernels = json.loads((CHATS_RECORD / "kernels" / "kernels.json").read_text())
    loss = kernels["loss"]
    assert f"costs\n  {loss['fp32_accumulation_cost_ms']:.1f} ms per micro-step" in section
    assert f"{loss['liger_fp32_accumulation_fwd_bwd_ms']:.1f} ms forward and backward" in section
    assert f"{kernels['attention']['packed_varlen_fwd_bwd_ms']:.2f} ms forward and backward" in section
    cap = json.loads((CHATS_RECORD / "cap24" / "bench.json").read_text())
    peak = cap["runs"][0]["peak_mem_gib"]
    assert cap["settings"]["memory_cap_gib"] == 22 and peak < 22
    assert f"peak {peak:.1f} GiB per rank" in section


def test_the_idle_to_zero_figures_are_the_recorded_run():
    folder = DOCS / "cpu" / "2026-12-02-idle-to-zero"
    record = (folder / "run.txt").read_text()
    summary = json.loads((folder / "summary.json").read_text())
    assert record.rstrip().endswith("exit 0")
    section = _section("RELIABILITY.md", "## 7. Idle to zero")
    block = section.split("```\n", 1)[1].split("```", 1)[0]
    assert record.startswith(block.splitlines()[0])  # the command, as it was run
    assert "today `python -m workloads.rehearse.idle_rehearsal`" in section
    for line in block.splitlines()[1:]:
        assert line in record.splitlines(), line
    for at, what in summary["events"]:
        assert f"{at:7.1f} s  {what}" in block
    measured = _table_rows(section, r"\| (idle to training|training to idle) \|")
    rows = {what: seconds for what, seconds, _ in measured}
    assert rows == {"idle to training": str(summary["idle_to_training_s"]),
                    "training to idle": str(summary["training_to_idle_s"])}
    assert (summary["workers_at_start"], summary["most_workers"], summary["workers_at_end"]) == (0, 2, 0)


MEMORY_RECORD = GPU_RECORDS / "2026-12-04-h200-memory"
PEERS_RECORD = GPU_RECORDS / "2026-12-04-h200-peers"
RECORDED_LIGER_CHUNKING = {"run-1": 1, "run-2": 1, "run-3": 8}
"""The loss's chunking each memory run had (workloads/train/loss_chunks.py): the first two ran liger's
default, before the loop set its own; their memory.json files predate the field that says so."""


def test_the_memory_table_is_the_recorded_peaks_against_the_model_as_committed():
    """Each row's measured peak and cap are its newest run's; its prediction and error are today's
    model's, for the loss chunking that run had and its loop (which held a one-rank frozen base in
    FSDP2: every run here predates 2026-12-05)."""
    from workloads.bench.memory_check import POINTS, prediction

    measured = {}
    for run, chunking in RECORDED_LIGER_CHUNKING.items():
        for row in json.loads((MEMORY_RECORD / run / "memory.json").read_text()):
            assert row.get("liger_chunk_mem_const", chunking) == chunking
            if row["measured_gib"] is not None:
                measured[row["point"]] = (row, run)
    section = _section("PERFORMANCE.md", "## Memory: the model against measured peaks")
    rows = _table_rows(section, r"\| `")
    assert [row[0].split("`")[1] for row in rows] == list(POINTS)
    for row in rows:
        name = row[0].split("`")[1]
        record, run = measured[name]
        predicted = prediction(POINTS[name], liger_chunk_mem_const=RECORDED_LIGER_CHUNKING[run],
                               frozen_in_fsdp=True).peak_gib
        error = predicted / record["measured_gib"] - 1
        assert row[1:] == (f"{predicted:.2f}", f"{record['measured_gib']:.2f}", f"{error:+.1%}",
                           f"{record['cap_gib']:.2f}", run)
        assert abs(error) <= 0.10, name  # the bound on the model, at every measured point
        assert record["status"] == "ok" and record["measured_gib"] <= record["cap_gib"]


def test_the_trainer_comparison_is_the_recorded_bench():
    bench = json.loads((PEERS_RECORD / "bench-1.5b" / "bench.json").read_text())
    figures = {f["strategy"]: f for f in bench["figures"]}
    section = _section("PERFORMANCE.md", "## Against Hugging Face's Trainer")
    rows = _table_rows(section, r"\| `")
    for row in rows:
        strategy = row[0].split("`")[1]
        if figures[strategy]["status"] == "ok":
            f = figures[strategy]
            assert row[1:] == (f"{f['tokens_per_s_per_gpu']:,.0f}", f"{f['mfu_vs_peak']:.1%}",
                               f"{f['peak_mem_gib']:.1f}")
        else:
            assert row[1].startswith("out of memory")
    (comparison,) = bench["comparisons"]
    assert f"{comparison['label'].split(', same')[0]}: {comparison['ratio']:.3f}x" in section


def test_the_7b_lora_figure_is_the_recorded_run():
    bench = json.loads((PEERS_RECORD / "bench-7b-lora" / "bench.json").read_text())
    (figures,) = bench["figures"]
    section = _section("PERFORMANCE.md", "## Against Hugging Face's Trainer")
    assert figures["strategy"] == "tuned-chats" and figures["micro_batch"] == 8
    assert (f"the loop trained {figures['tokens_per_s_per_gpu']:,.0f}\ntokens/s ({figures['mfu_vs_peak']:.1%} MFU"
            in section)
    assert f"peak {figures['peak_mem_gib']:.1f} GiB" in section


SOAK_RECORD = DOCS / "cpu" / "2026-12-04-soak"


def soak_fault_rows(summary: dict) -> list[tuple[str, ...]]:
    """Section 8's fault table as the soak recorded it: (#, fault, after step, resumed from, steps
    lost, allowance, training again after)."""
    return [(str(i), r["kind"], str(r["step"]), "-" if r["resumed_from"] is None else str(r["resumed_from"]),
             str(r["lost"]), r["allowance"], "-" if r["recovery_s"] is None else f"{r['recovery_s']} s")
            for i, r in enumerate(summary["fault_table"], start=1)]


def soak_memory_rows(summary: dict) -> list[tuple[str, ...]]:
    """Section 8's memory table: (role, processes, judged, the longest-lived judged one's pid and
    life, its RSS after warm-up and at the end, the largest growth of any, the peak of any)."""
    rows = []
    for role, entry in summary["checks"]["memory"]["roles"].items():
        longest = entry["longest"]
        rows.append((role, str(entry["processes"]), str(entry["judged"]),
                     "-" if longest is None else f"{longest['pid']}, {longest['lived_s'] / 60:.1f} min",
                     "-" if longest is None else f"{longest['start_mib']} → {longest['end_mib']}",
                     "-" if entry["max_growth_mib"] is None else str(entry["max_growth_mib"]),
                     str(entry["peak_rss_mib"])))
    return rows


def test_the_soak_tables_are_the_recorded_run():
    transcript = (SOAK_RECORD / "run.txt").read_text()
    summary = json.loads((SOAK_RECORD / "summary.json").read_text())
    section = _section("RELIABILITY.md", "## 8. ")
    command = transcript.splitlines()[0]
    # Recorded when the soak was workloads/bench/soak.py; the section names the command as it is now.
    assert command.startswith("$ nice -n 10 .venv/bin/python -m workloads.bench.soak --minutes ") and command in section
    assert "today `python -m workloads.rehearse.soak`" in section
    assert f"seed {summary['seed']}" in section and f"--seed {summary['seed']}" in transcript
    assert transcript.rstrip().endswith("exit 0" if summary["passed"] else "exit 1")
    assert _table_rows(section, r"\| \d+ \| [a-z]+-[a-z]+ \|") == soak_fault_rows(summary)
    assert _table_rows(section, r"\| (driver|controller|train worker|head|worker node) \|") == soak_memory_rows(summary)
    checks = summary["checks"]
    retention, mlflow, losses = checks["retention"], checks["mlflow"], checks["losses_match_uninterrupted"]
    for figure in (f"{retention['max_bytes']:,} bytes", f"{retention['bound_bytes']:,} bytes",
                   f"{losses['steps_compared']:,} steps", f"largest relative gap {losses['max_relative_gap']}",
                   f"{mlflow['steps_logged']:,} steps", f"{mlflow['values']:,} values", mlflow["status"],
                   f"{summary['skipped_checkpoints']} checkpoint(s) skipped", f"{summary['wall_s'] / 60:.1f} minutes"):
        assert figure in " ".join(section.split()), figure  # the prose wraps lines anywhere
    assert (SOAK_RECORD / "soak.png").stat().st_size > 10_000
