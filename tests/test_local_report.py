"""The run report: step records read back from job logs, the summary, report.json and loss.png."""

from __future__ import annotations

import io
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


def test_attempts_are_told_apart_by_their_rank_0_process_and_the_last_one_completes_each_step():
    def by(pid: int, step: int, loss: float) -> str:
        return _line({"step": step, "loss": loss}).replace("pid=9", f"pid={pid}")

    lines = [by(7, 1, 3.0), by(7, 2, 2.5), by(7, 3, 2.25), by(7, 2, 2.5),  # Ray forwards a line twice
             "(RayTrainWorker pid=8) unrelated", by(8, 3, 2.2), by(8, 4, 2.0), by(7, 3, 2.25),  # late repeat
             f"{report.TRAIN_PREFIX}" + json.dumps({"step": 9, "loss": 1.0})]  # no process: no attempt's
    assert [[r["step"] for r in attempt] for attempt in report.attempts(lines)] == [[1, 2, 3], [3, 4]]
    # Step 3 as the second attempt redid it, the first attempt's late repeat notwithstanding.
    assert report.completed_losses(lines) == {1: 3.0, 2: 2.5, 3: 2.2, 4: 2.0}


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


def test_the_clean_log_has_no_colour_codes_and_each_worker_line_once():
    w0 = "\x1b[36m(RayTrainWorker pid=9, ip=10.0.0.1)\x1b[0m "
    w1 = "\x1b[36m(RayTrainWorker pid=8, ip=10.0.0.2)\x1b[0m "
    raw = "".join(line + "\n" for line in [
        "2026-12-01 01:14:50,790\tINFO worker.py:2015 -- dashboard at "
        "\x1b[1m\x1b[32mhttp://127.0.0.1:35303 \x1b[39m\x1b[22m",
        w0 + '[train] {"step":5,"loss":5.7}',
        w1 + "Reporting training result 1 from rank 1",  # the other worker's line in between
        w0 + "Reporting training result 1 from rank 0",  # and a logged line of the same worker
        w0 + '[train] {"step":5,"loss":5.7}',          # Ray's second copy: dropped
        w1 + '[train] {"step":5,"loss":5.7}',          # the same text from another worker: kept
        *[w0 + f"line {i}" for i in range(report.REPEAT_WINDOW)],
        w0 + '[train] {"step":5,"loss":5.7}',          # printed again much later: kept
        "driver line",
        "driver line",                                 # the driver's own lines are kept as printed
    ])
    p0, p1 = "(RayTrainWorker pid=9, ip=10.0.0.1) ", "(RayTrainWorker pid=8, ip=10.0.0.2) "
    assert report.clean_log(raw).splitlines() == [
        "2026-12-01 01:14:50,790\tINFO worker.py:2015 -- dashboard at http://127.0.0.1:35303 ",
        p0 + '[train] {"step":5,"loss":5.7}',
        p1 + "Reporting training result 1 from rank 1",
        p0 + "Reporting training result 1 from rank 0",
        p1 + '[train] {"step":5,"loss":5.7}',
        *[p0 + f"line {i}" for i in range(report.REPEAT_WINDOW)],
        p0 + '[train] {"step":5,"loss":5.7}',
        "driver line",
        "driver line",
    ]
    # The records read from the clean log are those of the raw one.
    assert report.train_records(report.clean_log(raw).splitlines()) == report.train_records(raw.splitlines())


def test_the_plot_starts_at_the_runs_first_step_with_eval_loss_and_lr():
    records = [{"step": 5, "loss": 3.0, "lr": 0.01}, {"step": 10, "loss": 2.0, "lr": 0.009, "eval_loss": 2.4},
               {"step": 15, "loss": 1.5, "lr": 0.005, "eval_loss": 2.1}]
    series = report.curves(records, final={"first_loss": 6.2, "resumed_from_step": 0})
    assert series.loss == [(1, 6.2), (5, 3.0), (10, 2.0), (15, 1.5)]
    assert series.eval_loss == [(10, 2.4), (15, 2.1)]
    assert series.lr == [(5, 0.01), (10, 0.009), (15, 0.005)]
    resumed = report.curves(records[1:], final={"first_loss": 2.5, "resumed_from_step": 7})
    assert resumed.loss[0] == (8, 2.5)
    logged_every_step = [{"step": 1, "loss": 6.2}, {"step": 2, "loss": 5.0}]
    assert report.curves(logged_every_step, final={"first_loss": 6.2}).loss == [(1, 6.2), (2, 5.0)]
    assert report.curves(records).loss[0] == (5, 3.0) and report.curves(records[:1]).eval_loss == []


def test_the_loss_axis_is_logarithmic_and_the_warm_up_is_shaded(tmp_path):
    """On a linear axis the first steps' loss (6.2, a uniform guess) flattened every later step."""
    records = [{"step": 5, "loss": 3.0, "lr": 0.01}, {"step": 10, "loss": 0.5, "lr": 0.009, "eval_loss": 0.6},
               {"step": 15, "loss": 0.05, "lr": 0.005}]
    series = report.curves(records, final={"first_loss": 6.2}, warmup_steps=5)
    assert series.warmup == (1, 5)
    fig = report.draw_curves(series, title="t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    (span,) = [p for p in ax.patches if p.get_label().startswith("warm-up")]
    (x0, _), (x1, _) = span.get_extents().transformed(ax.transData.inverted()).get_points()
    assert (round(x0), round(x1)) == (1, 5)
    assert "warm-up (steps 1-5)" in [t.get_text() for t in fig.legends[0].get_texts()]
    # A run resumed after its warm-up has none to shade; one without warm-up neither.
    assert report.curves(records, final={"resumed_from_step": 7}, warmup_steps=5).warmup is None
    assert report.curves(records).warmup is None
    report.write_report(tmp_path, records=records, summary=report.summarize(records),
                        meta={"config": {"warmup_steps": 5}}, final={"first_loss": 6.2})
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _overlapping(boxes) -> list[tuple[int, int]]:
    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]


@pytest.mark.parametrize("losses", [
    [6.2, 3.1, 0.9, 0.2, 0.04, 0.009, 0.0015],  # several decades: the minor labels overlapped
    [0.95, 0.9, 0.8, 0.7, 0.65, 0.6],  # within one decade: no decade shows, the minor ticks are labelled
    [0.0011, 0.00095, 0.0009, 0.00088],  # around 0.001: "0.0009" sat on "0.001"
], ids=["decades", "one-decade", "near-a-decade"])
def test_the_plot_is_readable(losses):
    """Tick labels of the loss axis do not overlap, and the legend does not cover the curves."""
    records = [{"step": 10 * (i + 1), "loss": loss, "lr": 0.01, "eval_loss": loss * 1.1}
               for i, loss in enumerate(losses)]
    fig = report.draw_curves(report.curves(records, warmup_steps=5), title="my-ft: toy model on mychats.jsonl")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [t for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)
              if t.get_text() and t.get_visible()]
    low, high = ax.get_ylim()
    shown = [t for t in labels if low <= t.get_position()[1] <= high]
    assert len(shown) >= 2  # the axis says what it measures
    assert _overlapping([t.get_window_extent(renderer) for t in shown]) == []
    legend = fig.legends[0].get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_report_plots_the_curves(tmp_path, monkeypatch):
    plotted = {}
    monkeypatch.setattr(report, "plot_curves", lambda series, *, title, path: plotted.update(series=series))
    records = [{"step": 5, "loss": 3.0, "lr": 0.01}]
    report.write_report(tmp_path, records=records, summary=report.summarize(records), meta={},
                        final={"first_loss": 6.0})
    assert plotted["series"].loss == [(1, 6.0), (5, 3.0)]


def test_an_interrupted_local_run_keeps_the_jobs_log(tmp_path, monkeypatch):
    from rich.console import Console

    from workloads.client import submit
    from workloads.local import run as local

    class Client:
        def get_job_logs(self, job_id):
            assert job_id == "raysubmit_1"
            return "\x1b[36m(RayTrainWorker pid=9)\x1b[0m a\n\x1b[36m(RayTrainWorker pid=9)\x1b[0m a\n"

    monkeypatch.setattr(submit, "job_client", lambda conn: Client())
    console = Console(file=io.StringIO(), width=400)
    path = tmp_path / "job.log"
    with pytest.raises(KeyboardInterrupt):
        with local.log_kept_on_interrupt(object(), ["raysubmit_1"], path=path, console=console):
            raise KeyboardInterrupt
    assert path.read_text() == "(RayTrainWorker pid=9) a\n"
    assert f"the job's log so far is in {path}" in console.file.getvalue()
    with pytest.raises(KeyboardInterrupt):  # interrupted before a job existed: nothing to keep
        with local.log_kept_on_interrupt(object(), [], path=tmp_path / "none.log", console=console):
            raise KeyboardInterrupt
    assert not (tmp_path / "none.log").exists()


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
    lines = {line.get_label(): line for ax in saved[0].axes for line in ax.get_lines()}
    assert list(lines["eval loss"].get_xdata()) == [10, 20]
    assert list(lines["eval loss"].get_ydata()) == [2.5, 1.25]
