"""`python -m workloads.bench`: the reference strategy and the project's loop, side by side.

Both run in one process-group run, one after the other, at each micro-batch of a sweep, on the same
model shape, initial weights, data, sequence length and step count. With `--data synthetic,chats`
the loop also trains on generated chats (workloads/bench/chats.py: the job users run, packed rows
with labels on the answers only) at each micro-batch, as run "tuned-chats"; its tokens/s count
example tokens, not padding, and a "chat vs synthetic" comparison gives its ratio to "tuned". The
reference does not keep packed samples apart, so it runs on synthetic tokens only. The harness times both the
same way from outside: a global optimizer step hook records a CUDA event after every
`optimizer.step()`, so nothing in either strategy waits for the host to measure it. A device
out-of-memory is caught per run and recorded as "OOM".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
import transformers
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import AutoConfig, AutoModelForCausalLM

from workloads.train import metrics
from workloads.bench.chats import describe, write_chat_data
from workloads.bench.matmul import MatmulRate, measure_matmul
from workloads.bench.reference import train_reference
from workloads.bench.report import (
    OK,
    OOM,
    RunFigures,
    RunResult,
    chat_comparisons,
    comparisons,
    peer_comparisons,
    format_table,
    run_figures,
    write_json,
)
from workloads.bench.runtime import (
    Runtime,
    any_rank,
    init_runtime,
    is_out_of_memory,
    max_over_ranks,
    nccl_version,
    release_memory,
)
from workloads.bench.strategy import Strategy, StrategyResult
from workloads.bench.memory_window import MemoryWindow
from workloads.bench.profile import StepWindowProfiler
from workloads.bench.settings import (CHATS_ONLY, CHATS_SUFFIX, HF_TRAINER, HF_TRAINER_PADDED, PAIRS_ONLY,
                                      PAIRS_SUFFIX, PLACEHOLDER_CHATS, REFERENCE, STRATEGY_NAMES, TRL_DPO, TUNED,
                                      BenchSettings, chat_data, preset_config)
from workloads.bench.timing import StepClock
from workloads.train.config import ModelConfig, TrainConfig
from workloads.context import TrainContext
from workloads.train.loop import train
from workloads.train.model import named_architecture, shape_of

CONVERSATIONS_PER_ROW = 2.3
"""Generated conversations per 2,048-token row (about 950 tokens each, packed): how many to write
for the rows a run reads."""
PAIRS_PER_ROW = 2.3
"""Generated preference pairs per 4,096-token row (two sequences of about 930 tokens each, packed)."""


def train_tuned(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
    """The project's loop, called exactly as the Ray Train adapter calls it; `report` collects."""
    reports: list[dict] = []

    def report(metrics_: dict, checkpoint_dir: Optional[Path] = None) -> None:
        reports.append(dict(metrics_))

    summary = train(cfg, dataclasses.replace(ctx, report=report))
    losses = {int(r["step"]): float(r["loss"]) for r in reports}
    if summary.get("first_loss") is not None:
        losses.setdefault(1, float(summary["first_loss"]))
    return StrategyResult(losses=dict(sorted(losses.items())), self_reported=[*reports, {"summary": summary}])


def train_hf_trainer(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
    from workloads.bench.hf_trainer import train_hf_trainer as train_peer

    return train_peer(cfg, ctx=ctx, device=device, batching="flat")


def train_hf_trainer_padded(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device) -> StrategyResult:
    from workloads.bench.hf_trainer import train_hf_trainer as train_peer

    return train_peer(cfg, ctx=ctx, device=device, batching="padded")


def train_trl_dpo(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device,
                  pairs_per_micro_batch: Optional[int] = None) -> StrategyResult:
    from workloads.bench.trl_dpo import train_trl_dpo as train_peer

    return train_peer(cfg, ctx=ctx, device=device, pairs_per_micro_batch=pairs_per_micro_batch)


STRATEGIES: Mapping[str, Strategy] = {REFERENCE: train_reference, TUNED: train_tuned,
                                      HF_TRAINER: train_hf_trainer, HF_TRAINER_PADDED: train_hf_trainer_padded,
                                      TRL_DPO: train_trl_dpo}
assert tuple(STRATEGIES) == STRATEGY_NAMES  # the names settings.py accepts


def job_config(settings: BenchSettings, *, micro_batch: int, chats: Optional[tuple[Path, Path]] = None) -> TrainConfig:
    """The preset with the benchmark's shape; no checkpoints, evaluations or transport gate, which run
    outside the steps (the gate is measured by `python -m workloads.bench nccl`). `chats`: the
    generated chats' (JSONL, tokenizer folder) to train on instead of the preset's data."""
    base = preset_config(settings, data=None if chats is None else chat_data(*chats))
    return dataclasses.replace(
        base,
        seq_len=settings.seq_len,
        micro_batch=micro_batch,
        steps=settings.steps,
        warmup_steps=min(base.warmup_steps, settings.steps - 1),
        seed=settings.seed,
        checkpoint_every=0,
        eval_every=0,
        transport=dataclasses.replace(base.transport, enabled=False),
    )


def flops_per_token(cfg: TrainConfig) -> float:
    """The loop's FLOPs-per-token formula, on a parameter-free (meta) copy of the model with the
    method's adapters (LoRA: the base's weights get no gradient)."""
    from workloads.train.method import method_for
    from workloads.train.objective import objective_for

    model: ModelConfig = cfg.model
    config = (named_architecture(model.name_or_path) if model.is_named_architecture
              else AutoConfig.from_pretrained(model.name_or_path, trust_remote_code=False))
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    shape = shape_of(lm)
    method_for(cfg).adapt(lm, mixed_precision=False, seed=cfg.seed)
    params = sum(p.numel() for p in lm.parameters())
    trained = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    return metrics.flops_per_token(
        n_params=params, frozen_params=params - trained, n_layers=shape.n_layers, n_heads=shape.n_heads,
        head_dim=shape.head_dim, seq_len=cfg.seq_len,
    ) + objective_for(cfg).extra_flops_per_token(n_params=shape.n_params, n_layers=shape.n_layers,
                                                 n_heads=shape.n_heads, head_dim=shape.head_dim, seq_len=cfg.seq_len)


def predicted_peak_gib(cfg: TrainConfig, *, world_size: int, device: torch.device) -> Optional[float]:
    """The memory model's peak for the loop's run of `cfg` on `world_size` ranks of one node (flat
    FSDP), with the loss it runs on this device; None off the GPU."""
    if device.type != "cuda":
        return None
    from workloads.sizing.memory import Architecture, predict, settings_for
    from workloads.train.loss import choose_implementation

    config = (named_architecture(cfg.model.name_or_path) if cfg.model.is_named_architecture
              else AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=False))
    loss = choose_implementation(fused=cfg.fused_linear_ce, device=device)
    return round(predict(Architecture.from_config(config), settings_for(cfg, shard_ranks=world_size,
                                                                         loss=loss)).peak_gib, 2)


def model_label(cfg: TrainConfig) -> str:
    """"7b" for Qwen/Qwen2.5-7B-Instruct or qwen2.5-7b, the name otherwise."""
    name = cfg.model.name_or_path.rpartition("/")[2].lower()
    return name.removeprefix("qwen2.5-").removesuffix("-instruct")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


PROGRESS_FIRST_STEPS, PROGRESS_EVERY = 3, 10
"""run_job's progress lines: after each of the first steps, then every tenth."""


def run_job(
    name: str,
    strategy: Strategy,
    cfg: TrainConfig,
    *,
    runtime: Runtime,
    ctx: TrainContext,
    profile_steps: Optional[tuple[int, int]] = None,
    profile_out: Optional[Path] = None,
    memory_steps: Optional[tuple[int, int]] = None,
    warmup: int = 0,
    say: Callable[[str], None] = lambda line: None,
) -> RunResult:
    """One strategy at one micro-batch; an out-of-memory on any rank makes it an OOM result. `say`
    gets a line at the end of the first steps and of every tenth one, on the host's clock from the
    run's start: a peer that compiles or stalls shows where, even if the run never ends."""
    release_memory(runtime.device)
    dist.barrier()
    clock = StepClock(device=runtime.device)
    started = time.perf_counter()
    counter = itertools.count(1)
    profiler = None
    if profile_steps is not None:
        profiler = StepWindowProfiler(first=profile_steps[0], last=profile_steps[1], out=profile_out,
                                      title=f"{name}-mb{cfg.micro_batch}", device=runtime.device,
                                      table=profile_out is not None)
        profiler.start_if_first_step()
    memory = None
    if memory_steps is not None and runtime.is_cuda:
        memory = MemoryWindow(first=memory_steps[0], last=memory_steps[1], out=profile_out, device=runtime.device,
                              title=f"{name}-mb{cfg.micro_batch}")
        memory.start_if_first_step()

    warmup_peak = None

    def after_step(optimizer, args, kwargs) -> None:
        nonlocal warmup_peak
        step = next(counter)
        clock.mark(step)
        if step == warmup and runtime.is_cuda:  # the steady peak counts from here (allocations are host-side)
            warmup_peak = torch.cuda.max_memory_allocated(runtime.device)
            torch.cuda.reset_peak_memory_stats(runtime.device)
        if step <= PROGRESS_FIRST_STEPS or step % PROGRESS_EVERY == 0:
            say(f"[bench] {name} step {step} queued {time.perf_counter() - started:.1f} s after the run began")
        if profiler is not None:
            profiler.after_step(step)
        if memory is not None:
            memory.after_step(step)

    hook = register_optimizer_step_post_hook(after_step)
    error: Optional[str] = None
    result: Optional[StrategyResult] = None
    try:
        result = strategy(cfg, ctx=ctx, device=runtime.device)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        error = _first_line(e)
    finally:
        hook.remove()
    tokens = cfg.samples_per_rank_per_step * cfg.seq_len
    if result is not None and result.self_reported:
        # Packed rows: the example tokens (not padding) a step trained, as the loop counted them.
        tokens = round(result.self_reported[-1]["summary"].get("example_tokens_per_step") or tokens)
    if any_rank(error is not None, device=runtime.device):
        release_memory(runtime.device)
        return RunResult(
            strategy=name, micro_batch=cfg.micro_batch, status=OOM, tokens_per_step_per_gpu=tokens,
            error=error or "out of memory on another rank",
        )
    assert result is not None
    step_seconds = clock.step_seconds()
    if len(step_seconds) != cfg.steps - 1:
        raise RuntimeError(f"{name} made {len(step_seconds) + 1} optimizer steps, expected {cfg.steps}")
    peak = steady = None
    if runtime.is_cuda:
        # The warm-up's end, then a memory window's opening (after it: BenchSettings), reset the peak.
        after_warmup = max(torch.cuda.max_memory_allocated(runtime.device), memory.peak_before_bytes if memory else 0)
        mine = max(after_warmup, warmup_peak or 0)
        peak = max_over_ranks(mine / 2**30, device=runtime.device)
        if warmup_peak is not None:
            steady = max_over_ranks(after_warmup / 2**30, device=runtime.device)
    communication = None
    if profiler is not None and profiler.communication is not None:
        communication = asdict(profiler.communication)
    categories = None if profiler is None or profiler.categories is None else profiler.categories.as_dict()
    return RunResult(
        strategy=name, micro_batch=cfg.micro_batch, status=OK, tokens_per_step_per_gpu=tokens,
        step_seconds=step_seconds, losses=result.losses, peak_mem_gib=peak, steady_peak_mem_gib=steady,
        loop_metrics=result.self_reported,
        communication=communication, profile=categories,
    )


def matmul_rate(settings: BenchSettings, *, runtime: Runtime) -> Optional[dict]:
    """Every rank measures its own device at once; the median over ranks is the denominator."""
    if settings.matmul_size == 0:
        return None
    rate = measure_matmul(device=runtime.device, size=settings.matmul_size)
    per_rank: list[Optional[MatmulRate]] = [None] * runtime.world_size
    dist.all_gather_object(per_rank, rate)
    return {
        "flops": statistics.median(r.flops for r in per_rank),
        "per_rank_tflops": [round(r.flops / 1e12, 1) for r in per_rank],
        **{k: v for k, v in asdict(rate).items() if k not in ("flops", "median_s")},
    }


def environment(runtime: Runtime) -> dict:
    return {
        "world_size": runtime.world_size,
        "device": torch.cuda.get_device_name(runtime.device) if runtime.is_cuda else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "python": platform.python_version(),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }


class Document:
    """The JSON written after every run, so a run killed part-way leaves what it measured."""

    def __init__(
        self, settings: BenchSettings, *, header: dict, flops: float, peak_flops: Optional[float],
        matmul: Optional[dict], out: Optional[Path], method: str = "full", model: str = "",
    ):
        self.settings, self.out = settings, out
        self.method, self.model = method, model
        """For the peer comparison's label ("tuned vs hf-trainer, lora, 7b")."""
        self.flops, self.peak_flops = flops, peak_flops
        self.matmul_flops = matmul["flops"] if matmul else None
        self.runs: list[RunResult] = []
        self.data = {
            **header,
            "flops_per_token": flops,
            "peak_flops": peak_flops,
            "matmul": matmul,
            "runs": [],
            "figures": [],
            "comparisons": [],
        }

    def add(self, run: RunResult) -> None:
        self.runs.append(run)
        self.data["runs"].append(asdict(run))
        figures = self.figures()
        self.data["figures"] = [asdict(f) for f in figures]
        self.data["comparisons"] = [asdict(c) for c in self.comparisons(figures)]
        if self.out:
            write_json(self.out / "bench.json", self.data)

    def figures(self) -> list[RunFigures]:
        return [
            run_figures(
                run, warmup=self.settings.warmup, flops_per_token=self.flops,
                peak_flops=self.peak_flops, matmul_flops=self.matmul_flops,
            )
            for run in self.runs
        ]

    def comparisons(self, figures: list[RunFigures]) -> list:
        return [*comparisons(figures, baseline=REFERENCE, candidate=TUNED),
                *chat_comparisons(figures, synthetic=TUNED, chats=TUNED + CHATS_SUFFIX),
                *peer_comparisons(figures, candidate=TUNED + CHATS_SUFFIX,
                                  peers=[p + CHATS_SUFFIX for p in (HF_TRAINER, HF_TRAINER_PADDED)],
                                  describe=f"hf-trainer, {self.method}, {self.model}"),
                *peer_comparisons(figures, candidate=TUNED + PAIRS_SUFFIX, peers=[TRL_DPO + PAIRS_SUFFIX],
                                  describe=f"trl-dpo, {self.method}, {self.model}")]

    def table(self) -> str:
        figures = self.figures()
        return format_table(figures, self.comparisons(figures))


def run_benchmark(
    settings: BenchSettings,
    *,
    runtime: Runtime,
    scratch_dir: Path,
    strategies: Mapping[str, Strategy] = STRATEGIES,
    say: Callable[[str], None] = print,
) -> Document:
    """The whole comparison: matmul rate, then every strategy at every micro-batch."""
    # The first run's config (the chats' paths do not matter to what it is used for here).
    base = job_config(settings, micro_batch=settings.micro_batches[0],
                      chats=None if settings.data[0] == "synthetic" else PLACEHOLDER_CHATS)
    records = {"chats": None, "pairs": None}
    say(f"[bench] {runtime.world_size} ranks on {environment(runtime)['device']}; measuring the bf16 matmul rate")
    matmul = matmul_rate(settings, runtime=runtime)
    if matmul:
        say(f"[bench] matmul {settings.matmul_size}^3 bf16: {matmul['flops'] / 1e12:.1f} TFLOP/s (median over ranks)")
    header = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "environment": environment(runtime),
    }
    document = Document(
        settings, header=header, flops=flops_per_token(base),
        peak_flops=metrics.device_peak_flops(runtime.device, configured=base.peak_flops), matmul=matmul,
        out=settings.out if runtime.rank == 0 else None, method=base.method, model=model_label(base),
    )
    ctx = TrainContext(
        rank=runtime.rank,
        world_size=runtime.world_size,
        local_rank=runtime.local_rank,
        local_world_size=runtime.local_world_size,
        node_rank=runtime.rank // runtime.local_world_size,
        report=lambda metrics_, checkpoint_dir=None: None,
        latest_checkpoint=lambda: None,
        scratch_dir=scratch_dir,
    )
    if settings.memory_cap_gib is not None and runtime.is_cuda:
        total = torch.cuda.get_device_properties(runtime.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_cap_gib * 2**30 / total), runtime.device)
        say(f"[bench] CUDA memory capped at {settings.memory_cap_gib} GiB per process")
    rows = settings.steps * max(settings.micro_batches) * base.grad_accum_steps * runtime.world_size
    if "chats" in settings.data:
        count = max(200, math.ceil(rows * CONVERSATIONS_PER_ROW * settings.seq_len / 2048))
        records["chats"] = write_chat_data(scratch_dir / f"chats-rank{runtime.rank}", count=count, seed=settings.seed)
        shape = describe(count, seed=settings.seed, seq_len=settings.seq_len)
        document.data["chats"] = shape
        say(f"[bench] {count} generated chats: {shape}")
    if "pairs" in settings.data:
        from workloads.bench.preference_pairs import describe_pairs, generate_pairs, write_pair_data

        count = max(200, math.ceil(rows * PAIRS_PER_ROW * settings.seq_len / 4096))
        records["pairs"] = write_pair_data(scratch_dir / f"pairs-rank{runtime.rank}", count=count, seed=settings.seed)
        shape = describe_pairs(generate_pairs(count, seed=settings.seed))
        document.data["pairs"] = shape
        say(f"[bench] generated preference pairs: {shape}")
    for micro_batch in settings.micro_batches:
        for data in settings.data:
            names = {"synthetic": [s for s in settings.strategies if s not in CHATS_ONLY + PAIRS_ONLY],
                     "chats": [s for s in settings.strategies if s not in (REFERENCE, *PAIRS_ONLY)],
                     "pairs": [s for s in settings.strategies if s in (TUNED, *PAIRS_ONLY)]}[data]
            for strategy in names:
                name = strategy + {"synthetic": "", "chats": CHATS_SUFFIX, "pairs": PAIRS_SUFFIX}[data]
                cfg = job_config(settings, micro_batch=micro_batch, chats=records.get(data))
                if strategy == TUNED:
                    document.data.setdefault("memory_model", {})[f"{name}-mb{micro_batch}"] = predicted_peak_gib(
                        cfg, world_size=runtime.world_size, device=runtime.device)
                run_strategy = strategies[strategy]
                if strategy == TRL_DPO and settings.peer_micro_batch:
                    run_strategy = functools.partial(run_strategy, pairs_per_micro_batch=settings.peer_micro_batch)
                document.add(announce_run(name, run_strategy, cfg, settings=settings, runtime=runtime,
                                          ctx=ctx, document=document, say=say))
    release_memory(runtime.device)
    return document


def announce_run(name: str, strategy: Strategy, cfg: TrainConfig, *, settings: BenchSettings, runtime: Runtime,
                 ctx: TrainContext, document: Document, say: Callable[[str], None]) -> RunResult:
    """One run, with a line before and one after it."""
    micro_batch = cfg.micro_batch
    say(f"[bench] {name} micro-batch {micro_batch}: {settings.steps} steps at seq {settings.seq_len}")
    run = run_job(name, strategy, cfg, runtime=runtime, ctx=ctx, say=say,
                  profile_steps=settings.profile_steps, profile_out=settings.out if runtime.rank == 0 else None,
                  memory_steps=settings.memory_steps, warmup=settings.warmup)
    if run.status == OK:
        figures = run_figures(run, warmup=settings.warmup, flops_per_token=document.flops,
                              peak_flops=document.peak_flops, matmul_flops=document.matmul_flops)
        say(
            f"[bench] {name} micro-batch {micro_batch}: {figures.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
            f"({'no' if figures.mfu_vs_peak is None else f'{figures.mfu_vs_peak:.1%}'} MFU), "
            f"step median {figures.step_s_median:.4f} s, "
            f"loss {figures.final_loss:.4f} at step {figures.final_step}, peak {run.peak_mem_gib} GiB "
            f"({run.steady_peak_mem_gib} after the warm-up)"
        )
    else:
        say(f"[bench] {name} micro-batch {micro_batch}: {run.status} ({run.error})")
    return run


def run(settings: BenchSettings) -> int:
    runtime = init_runtime()
    leader = runtime.rank == 0

    def say(line: str) -> None:
        if leader:
            print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        document = run_benchmark(settings, runtime=runtime, scratch_dir=Path(scratch), say=say)
    if leader:
        table = document.table()
        print(table, flush=True)
        if settings.out:
            (settings.out / "table.txt").write_text(table + "\n")
    dist.destroy_process_group()
    return 0
