"""The benchmark harness end to end on CPU (gloo, the tiny Qwen2): one rank in process with an
injected out-of-memory, two ranks under torchrun through the real command line, and the NCCL
bandwidth command on two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workloads.bench.__main__ import main as bench_main
from workloads.bench.reference import train_reference
from workloads.bench.runtime import init_runtime
from workloads.bench.train_bench import BenchSettings, run_benchmark, train_tuned

REPO = Path(__file__).resolve().parent.parent
TINY = ["--allow-cpu", "--preset", "demo-cpu", "--seq-len", "32", "--steps", "4", "--warmup", "1",
        "--matmul-size", "64"]
FIRST_LOSS_RTOL = 1e-5
"""Both strategies compute the first loss in fp32 from the same weights and tokens; they differ
only in summation order (full-logit HF loss under FSDP1 vs chunked linear cross-entropy under
FSDP2), which moves a loss of ~6.25 by about 1e-6."""


@pytest.fixture
def one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert not dist.is_initialized()
    runtime = init_runtime()
    yield runtime
    dist.destroy_process_group()


def _oom_above(limit: int, strategy):
    def run(cfg, *, ctx, device):
        if cfg.micro_batch > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.50 GiB")
        return strategy(cfg, ctx=ctx, device=device)

    return run


def test_an_out_of_memory_is_recorded_and_the_sweep_goes_on(one_rank, tmp_path):
    settings = BenchSettings(
        preset="demo-cpu", seq_len=32, steps=3, warmup=1, micro_batches=(4, 2), matmul_size=0, out=tmp_path
    )
    strategies = {"reference": _oom_above(2, train_reference), "tuned": train_tuned}
    document = run_benchmark(
        settings, runtime=one_rank, scratch_dir=tmp_path, strategies=strategies, say=lambda line: None
    )
    written = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["strategy"], r["micro_batch"], r["status"]) for r in written["runs"]] == [
        ("reference", 4, "OOM"),
        ("tuned", 4, "ok"),
        ("reference", 2, "ok"),
        ("tuned", 2, "ok"),
    ]
    assert written["runs"][0]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert written["matmul"] is None and written["figures"][0]["tokens_per_s_per_gpu"] is None
    assert [(c["label"], c["reference_micro_batch"], c["tuned_micro_batch"]) for c in written["comparisons"]] == [
        ("same micro-batch 2", 2, 2),
        ("largest micro-batch that fits", 2, 4),
    ]
    assert "OOM" in document.table()


def test_generated_chats_run_beside_synthetic_tokens_and_count_only_example_tokens(one_rank, tmp_path):
    settings = BenchSettings(preset="demo-cpu", seq_len=512, steps=3, warmup=1, micro_batches=(2,), matmul_size=0,
                             out=tmp_path, data=("synthetic", "chats"), overrides=("grad_accum_steps=2",))
    lines: list[str] = []
    run_benchmark(settings, runtime=one_rank, scratch_dir=tmp_path, say=lines.append)
    written = json.loads((tmp_path / "bench.json").read_text())
    # The reference does not keep packed samples apart: it runs on synthetic tokens only.
    assert [(r["strategy"], r["micro_batch"], r["status"]) for r in written["runs"]] == [
        ("reference", 2, "ok"), ("tuned", 2, "ok"), ("tuned-chats", 2, "ok"),
    ]
    synthetic, chats = written["runs"][1], written["runs"][2]
    assert synthetic["tokens_per_step_per_gpu"] == 2 * 2 * 512  # micro-batch x micro-steps x seq_len
    chat_summary = chats["loop_metrics"][-1]["summary"]
    assert chat_summary["data"]["chats"] > 0 and 0 < chat_summary["padding_share"] < 0.2
    # Throughput counts the positions that hold examples, not the padding.
    assert chats["tokens_per_step_per_gpu"] == round(chat_summary["example_tokens_per_step"]) < 2 * 2 * 512
    labels = [c["label"] for c in written["comparisons"]]
    assert "chat vs synthetic, same micro-batch 2" in labels
    ratio = next(c["ratio"] for c in written["comparisons"] if c["label"].startswith("chat vs synthetic"))
    rates = [f["tokens_per_s_per_gpu"] for f in written["figures"]]
    assert ratio == pytest.approx(rates[2] / rates[1])
    assert written["chats"]["answer_share"] > 0.7 and any("generated chats" in line for line in lines)
    # Each run says when each of its first steps was queued, so a run that stalls shows where.
    progress = [line.split(" queued ")[0] for line in lines if " queued " in line]
    assert progress == [f"[bench] {name} step {step}" for name in ("reference", "tuned", "tuned-chats")
                        for step in (1, 2, 3)]


def test_chats_alone_on_a_hub_preset_with_another_model(one_rank, tmp_path):
    """The 24 GB cap run's shape: a preset whose own data is the hub's, trained only on the chats,
    with the model overridden (a named architecture has no tokenizer: the chats bring theirs)."""
    settings = BenchSettings(preset="qwen2.5-1.5b-24gb", seq_len=256, steps=2, warmup=1, micro_batches=(1,),
                             matmul_size=0, strategies=("tuned",), data=("chats",), allow_cpu=True,
                             overrides=("model.name_or_path=tiny-qwen2", "compile=false", "mixed_precision=false",
                                        "grad_accum_steps=2"))
    document = run_benchmark(settings, runtime=one_rank, scratch_dir=tmp_path, say=lambda line: None)
    assert [(r.strategy, r.micro_batch, r.status) for r in document.runs] == [("tuned-chats", 1, "ok")]
    summary = document.runs[0].loop_metrics[-1]["summary"]
    assert summary["grad_accum_steps"] == 2 and summary["data"]["chats"] > 0


def test_a_profiled_window_writes_each_runs_operators(one_rank, tmp_path):
    settings = BenchSettings(preset="demo-cpu", seq_len=32, steps=4, warmup=1, micro_batches=(2,),
                             matmul_size=0, out=tmp_path, profile_steps=(2, 3))
    run_benchmark(settings, runtime=one_rank, scratch_dir=tmp_path, say=lambda line: None)
    for strategy in ("reference", "tuned"):
        text = (tmp_path / f"profile-{strategy}-mb2.txt").read_text()
        assert text.startswith(f"steps 2..3 of {strategy}-mb2, sorted by cpu_time_total")
        assert "aten::mm" in text  # the profiler saw the step's matmuls


def test_an_error_that_is_not_out_of_memory_stops_the_benchmark(one_rank, tmp_path):
    def broken(cfg, *, ctx, device):
        raise RuntimeError("shape mismatch")

    settings = BenchSettings(preset="demo-cpu", seq_len=32, steps=2, warmup=1, micro_batches=(2,), matmul_size=0)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_benchmark(
            settings, runtime=one_rank, scratch_dir=tmp_path, strategies={"reference": broken}, say=lambda line: None
        )


def _torchrun(args: list[str], *, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_two_ranks_through_the_command_line(tmp_path):
    out = tmp_path / "bench"
    done = _torchrun(["workloads.bench", *TINY, "--micro-batches", "4,2", "--out", str(out)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[bench] reference micro-batch 4: 4 steps at seq 32" in done.stdout

    document = json.loads((out / "bench.json").read_text())
    assert document["environment"]["world_size"] == 2 and document["environment"]["backend"] == "gloo"
    assert set(document) >= {"settings", "environment", "flops_per_token", "peak_flops", "matmul", "runs", "figures",
                             "comparisons"}
    assert [(r["strategy"], r["micro_batch"], r["status"]) for r in document["runs"]] == [
        ("reference", 4, "ok"), ("tuned", 4, "ok"), ("reference", 2, "ok"), ("tuned", 2, "ok"),
    ]
    for run, figures in zip(document["runs"], document["figures"]):
        assert sorted(map(int, run["step_seconds"])) == [2, 3, 4]
        assert figures["timed_steps"] == 3 and figures["tokens_per_s_per_gpu"] > 0
        # A CPU has no bf16 peak (no H100's borrowed): MFU against the measured matmul rate only.
        assert figures["mfu_vs_peak"] is None and figures["mfu_vs_matmul"] > 0
        assert figures["step_s_p90"] >= figures["step_s_median"] and figures["final_step"] == 4
    assert [c["label"] for c in document["comparisons"]] == [
        "same micro-batch 4", "same micro-batch 2", "largest micro-batch that fits",
    ]
    table = (out / "table.txt").read_text()
    assert table.splitlines()[0].split()[:3] == ["strategy", "mb", "status"]
    assert table in done.stdout

    # Both strategies saw the same weights and the same tokens on each rank.
    by_key = {(r["strategy"], r["micro_batch"]): r for r in document["runs"]}
    for micro_batch in (4, 2):
        reference = by_key[("reference", micro_batch)]["losses"]["1"]
        tuned = by_key[("tuned", micro_batch)]
        assert tuned["losses"]["1"] == pytest.approx(reference, rel=FIRST_LOSS_RTOL)
        # the harness's FLOPs per token is the loop's own
        assert tuned["loop_metrics"][-1]["summary"]["flops_per_token"] == document["flops_per_token"]


@pytest.mark.slow
def test_nccl_command_on_two_ranks(tmp_path):
    out = tmp_path / "nccl"
    done = _torchrun(
        ["workloads.bench", "nccl", "--allow-cpu", "--min-bytes", "4K", "--max-bytes", "16K", "--iters", "2",
         "--warmup-iters", "1", "--out", str(out)]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((out / "nccl.json").read_text())
    assert document["world_size"] == 2
    rows = [(r["op"], r["size_bytes"]) for r in document["rows"]]
    sizes = [4096, 8192, 16384]
    assert rows == [(op, s) for op in ("all_reduce", "all_gather", "reduce_scatter") for s in sizes]
    for row in document["rows"]:
        factor = 1.0 if row["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
    assert "busbw GB/s" in (out / "nccl.txt").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "3", "--warmup", "3"], "error: --steps 3 --warmup 3"),
        (["--profile-steps", "5"], "error: --profile-steps '5': use FIRST:LAST"),
        (["--steps", "10", "--profile-steps", "9:12"], "error: --profile-steps 9:12: need 1 <= first"),
        (["--memory-steps", "3-4"], "error: --memory-steps '3-4': use FIRST:LAST"),
        (["--steps", "10", "--memory-steps", "0:2"], "error: --memory-steps 0:2: need 1 <= first"),
        (["--steps", "10", "--warmup", "3", "--memory-steps", "3:4"],
         "error: --memory-steps 3:4: the window starts after the 3 warm-up step(s)"),
        (["nccl", "--min-bytes", "1TB"], "error: not a size"),
        (["nccl", "--ops", "all_to_all"], "error: --ops all_to_all"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, message, capsys):
    assert bench_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1
    assert not dist.is_initialized()


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "error: no CUDA GPU is visible: the benchmarks measure GPUs"),
        (["nccl"], "error: no CUDA GPU is visible"),
        (["--allow-cpu"], "error: --allow-cpu runs only the tiny-qwen2 model (--preset demo-cpu, or --set "
                          "model.name_or_path=tiny-qwen2); this run builds qwen2.5-1.5b"),
        # The model the run builds, after --set: a preset's own is not what counts.
        (["--allow-cpu", "--preset", "demo-cpu", "--set", "model.name_or_path=qwen2.5-7b"],
         "error: --allow-cpu runs only the tiny-qwen2 model (--preset demo-cpu, or --set "
         "model.name_or_path=tiny-qwen2); this run builds qwen2.5-7b"),
        (["nccl", "--allow-cpu"], "error: bench nccl needs at least 2 ranks, got 1"),
    ],
)
def test_the_wrong_hardware_is_refused_before_anything_runs(argv, message, no_gpu, capsys):
    assert bench_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1
    assert not dist.is_initialized()


def test_one_gpu_rank_is_too_few_for_the_bandwidth_benchmark():
    from workloads.bench.__main__ import refusal

    assert "at least 2 ranks, got 1" in refusal(nccl=True, allow_cpu=False, cuda=True, world_size=1)
    assert refusal(nccl=True, allow_cpu=False, cuda=True, world_size=2) is None
    assert refusal(nccl=False, allow_cpu=False, cuda=True, world_size=1, model="qwen2.5-1.5b") is None
