"""Pure parts of the benchmark: statistics, bus-bandwidth conventions, figures, comparisons,
the table, settings validation and out-of-memory detection."""

from __future__ import annotations

import json

import pytest
import torch

from workloads.transport.bandwidth import bus_bandwidth_gbps
from workloads.bench.nccl import gather_scatter_bandwidth_gbps, message_sizes, parse_size
from workloads.bench.report import (
    OK,
    OOM,
    RunResult,
    comparisons,
    format_table,
    median,
    percentile,
    run_figures,
    write_json,
)
from workloads.bench.runtime import is_out_of_memory
from workloads.bench.timing import StepClock
from workloads.bench.settings import BenchSettings, parse_args


def test_median_of_odd_and_even_counts():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_p90_interpolates_between_closest_ranks_like_numpy():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 50) == pytest.approx(median(values))
    assert percentile([7.0], 90) == 7.0
    assert percentile([5.0, 1.0], 100) == 5.0 and percentile([5.0, 1.0], 0) == 1.0


@pytest.mark.parametrize("bad", [[], None])
def test_statistics_of_nothing_is_an_error(bad):
    with pytest.raises(ValueError):
        percentile(bad or [], 90)
    with pytest.raises(ValueError):
        median(bad or [])


def test_percentile_outside_0_100_is_an_error():
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0], 101)


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_all_reduce_busbw_is_algbw_times_2_n_minus_1_over_n(n, factor):
    algbw, busbw = bus_bandwidth_gbps(size_bytes=2 * 10**9, seconds=0.5, world_size=n)
    assert algbw == pytest.approx(4.0)
    assert busbw == pytest.approx(4.0 * factor)


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 0.5), (4, 0.75), (8, 0.875)])
def test_gather_and_scatter_busbw_is_algbw_times_n_minus_1_over_n(n, factor):
    algbw, busbw = gather_scatter_bandwidth_gbps(size_bytes=2 * 10**9, seconds=0.5, world_size=n)
    assert algbw == pytest.approx(4.0)
    assert busbw == pytest.approx(4.0 * factor)


def test_busbw_rejects_non_positive_time_and_world():
    with pytest.raises(ValueError, match="positive"):
        gather_scatter_bandwidth_gbps(size_bytes=1, seconds=0.0, world_size=2)
    with pytest.raises(ValueError, match="world size"):
        gather_scatter_bandwidth_gbps(size_bytes=1, seconds=1.0, world_size=0)


def test_sizes_double_from_1mib_to_1gib():
    sizes = message_sizes(parse_size("1MiB"), parse_size("1G"))
    assert sizes[0] == 2**20 and sizes[-1] == 2**30 and len(sizes) == 11
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert parse_size("4096") == 4096 and parse_size("512k") == 512 * 1024


@pytest.mark.parametrize("text", ["", "1TB", "-1M", "one"])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_min_above_max_is_rejected():
    with pytest.raises(ValueError, match="min bytes <= max bytes"):
        message_sizes(2048, 1024)


def _run(strategy, micro_batch, seconds, *, status=OK, losses=None):
    return RunResult(
        strategy=strategy,
        micro_batch=micro_batch,
        status=status,
        tokens_per_step_per_gpu=micro_batch * 1000,
        step_seconds={step + 2: s for step, s in enumerate(seconds)},
        losses=losses or {1: 10.0, len(seconds) + 1: 5.0},
        peak_mem_gib=40.0,
    )


def test_figures_leave_out_warmup_steps_and_derive_rates_from_the_median():
    # steps 2..7; warmup 3 leaves steps 4..7 timed, whose times are 1, 1, 2, 9
    run = _run("tuned", 8, [50.0, 50.0, 1.0, 1.0, 2.0, 9.0])
    f = run_figures(run, warmup=3, flops_per_token=1e9, peak_flops=1e13, matmul_flops=5e12)
    assert f.timed_steps == 4
    assert f.step_s_median == 1.5
    assert f.step_s_p90 == pytest.approx(2.0 + 0.7 * 7.0)
    assert f.tokens_per_s_per_gpu == pytest.approx(8000 / 1.5)
    assert f.mfu_vs_peak == pytest.approx(8000 / 1.5 * 1e9 / 1e13)
    assert f.mfu_vs_matmul == pytest.approx(8000 / 1.5 * 1e9 / 5e12)
    assert (f.first_loss, f.final_loss, f.final_step) == (10.0, 5.0, 7)


def test_an_oom_run_has_no_figures():
    run = RunResult(strategy="reference", micro_batch=16, status=OOM, tokens_per_step_per_gpu=1, error="x")
    f = run_figures(run, warmup=1, flops_per_token=1.0, peak_flops=1.0, matmul_flops=None)
    assert f.status == OOM and f.tokens_per_s_per_gpu is None and f.mfu_vs_peak is None


def test_comparisons_same_micro_batch_and_largest_fit():
    figures = [
        run_figures(r, warmup=1, flops_per_token=1.0, peak_flops=1.0, matmul_flops=None)
        for r in [
            RunResult(strategy="reference", micro_batch=16, status=OOM, tokens_per_step_per_gpu=16_000),
            _run("tuned", 16, [1.0, 1.0, 1.0]),  # 16,000 tokens/s
            _run("reference", 8, [1.0, 1.0, 1.0]),  # 8,000
            _run("tuned", 8, [0.5, 0.5, 0.5]),  # 16,000
        ]
    ]
    comps = comparisons(figures, baseline="reference", candidate="tuned")
    assert [(c.label, c.reference_micro_batch, c.tuned_micro_batch) for c in comps] == [
        ("same micro-batch 8", 8, 8),
        ("largest micro-batch that fits", 8, 16),
    ]
    assert [c.ratio for c in comps] == pytest.approx([2.0, 2.0])
    table = format_table(figures, comps)
    assert "OOM" in table and "same micro-batch 8: 2.000x" in table
    assert "largest micro-batch that fits: 2.000x (reference mb 8, tuned mb 16)" in table


def test_no_comparison_when_one_strategy_never_fits():
    figures = [
        run_figures(_run("tuned", 8, [1.0, 1.0]), warmup=1, flops_per_token=1.0, peak_flops=1.0, matmul_flops=None),
        run_figures(
            RunResult(strategy="reference", micro_batch=8, status=OOM, tokens_per_step_per_gpu=8000),
            warmup=1, flops_per_token=1.0, peak_flops=1.0, matmul_flops=None,
        ),
    ]
    assert comparisons(figures, baseline="reference", candidate="tuned") == []


def test_json_is_replaced_whole(tmp_path):
    path = tmp_path / "out" / "bench.json"
    write_json(path, {"runs": [1]})
    write_json(path, {"runs": [1, 2]})
    assert json.loads(path.read_text()) == {"runs": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]


def test_clock_splits_a_mark_covering_several_steps_evenly():
    clock = StepClock(device=torch.device("cpu"))
    for step in (1, 2, 4):
        clock.mark(step)
    seconds = clock.step_seconds()
    assert sorted(seconds) == [2, 3, 4]
    assert seconds[3] == seconds[4] and all(s >= 0 for s in seconds.values())
    with pytest.raises(ValueError, match="increase"):
        clock.mark(4)


def test_out_of_memory_is_found_through_wrapping_exceptions():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.50 GiB")
    assert is_out_of_memory(oom)
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as outer:
        assert is_out_of_memory(outer)
    assert is_out_of_memory(RuntimeError("NCCL error: CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "5", "--warmup", "5"], "steps > warmup"),
        (["--warmup", "0"], "warmup >= 1"),
        (["--micro-batches", "16,x"], "comma-separated integers"),
        (["--micro-batches", "0"], "positive integers"),
        (["--strategies", "reference,fast"], "fast"),
        (["--preset", "qwen-1.5b"], "unknown preset"),
        (["--seq-len", "0"], "--seq-len"),
    ],
)
def test_bad_options_are_value_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_defaults_fit_the_h200_comparison():
    settings = parse_args([])
    assert settings == BenchSettings()
    assert (settings.preset, settings.seq_len, settings.micro_batches) == ("qwen2.5-1.5b-synthetic", 2048, (16, 8))
