"""The run report: step records read back from job logs, the summary, report.json and loss.png."""

from __future__ import annotations

import json

import pytest

from workloads.client import report


def _line(record: dict, *, prefix: str = report.TRAIN_PREFIX) -> str:
    return f"\x1b[36m(RayTrainWorker pid=9, ip=10.0.0.1)\x1b[0m {prefix}{json.dumps(record)}"


def test_records_are_read_once_per_step_in_step_order():
    lines = [
        _line({"step": 10, "loss": 2.0, "tokens_per_s_per_device": 900.0}),
        "unrelated line",
        _line({"step": 5, "loss": 3.0, "tokens_per_s_per_device": 100.0}),
        _line({"step": 10, "loss": 2.0, "tokens_per_s_per_device": 900.0}),
        "[train] {broken",
        _line({"loss": 1.0}),  # no step: not a step record
    ]
    assert [r["step"] for r in report.train_records(lines)] == [5, 10]


def test_the_summary_prefers_the_loops_own_figures():
    records = [{"step": 5, "loss": 3.0, "tokens_per_s_per_device": 100.0},
               {"step": 10, "loss": 2.0, "tokens_per_s_per_device": 900.0},
               {"step": 15, "loss": 1.5, "tokens_per_s_per_device": 1100.0}]
    from_records = report.summarize(records)
    assert (from_records.steps, from_records.first_loss, from_records.last_loss) == (15, 3.0, 1.5)
    assert from_records.tokens_per_s == 1000.0  # median after the start-up window
    final = report.loop_summary([_line({"first_loss": 6.2, "tokens_per_s_per_device": 950.0},
                                       prefix=report.SUMMARY_PREFIX)])
    with_loop = report.summarize(records, final=final)
    assert (with_loop.first_loss, with_loop.tokens_per_s) == (6.2, 950.0)
    assert "15 steps: loss 6.2000 -> 1.5000, 950 tokens/s per worker" == report.format_summary(with_loop)


def test_no_records_is_a_clear_error():
    with pytest.raises(ValueError, match="no \\[train\\] step records"):
        report.summarize([])


def test_the_report_files(tmp_path):
    records = [{"step": s, "loss": 5.0 / s, "tokens_per_s_per_device": 10.0} for s in (5, 10, 15)]
    summary = report.summarize(records)
    json_path, png_path = report.write_report(tmp_path / "run", records=records, summary=summary,
                                              meta={"title": "t", "job_id": "j"})
    data = json.loads(json_path.read_text())
    assert data["job_id"] == "j" and data["summary"]["last_loss"] == pytest.approx(1 / 3)
    assert [r["step"] for r in data["steps"]] == [5, 10, 15]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_held_out_loss_reaches_the_progress_line_the_summary_and_the_plot(tmp_path):
    records = [{"step": 5, "loss": 3.0}, {"step": 10, "loss": 2.0, "eval_loss": 2.5},
               {"step": 15, "loss": 1.5}, {"step": 20, "loss": 1.0, "eval_loss": 1.25}]
    assert report.format_record(records[1], total_steps=20).startswith("step     10/20  loss 2.0000  eval 2.5000")
    assert "eval" not in report.format_record(records[0])
    summary = report.summarize(records)
    assert summary.eval_loss == 1.25
    assert "20 steps: loss 3.0000 -> 1.0000 (eval 1.2500)" in report.format_summary(summary)
    assert report.summarize(records[:1]).eval_loss is None
    import matplotlib.pyplot as plt

    saved = []
    original = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: (saved.append(fig), original(fig, *a, **k))[1]
    try:
        report.write_report(tmp_path, records=records, summary=summary, meta={"title": "t"})
    finally:
        plt.Figure.savefig = original
    (ax,) = saved[0].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["eval (held out)"].get_xdata()) == [10, 20]
    assert list(lines["eval (held out)"].get_ydata()) == [2.5, 1.25]
