"""The training loop, shared by the Ray Train and torchrun adapters; it never imports Ray.

`train(cfg, ctx)` expects the default process group to exist already. It only calls small named
steps: run the transport gate, build the model, shard it, build the optimizer, resume from the
latest checkpoint, then step, report and save. Values are read back from the device only on log
steps, so other steps queue work without waiting for it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from workloads.train import checkpoint, metrics
from workloads.train.config import TrainConfig
from workloads.context import GATE_PREFIX, SUMMARY_PREFIX, TRAIN_PREFIX, TrainContext
from workloads.train.data import Batch, batches, build_source, samples_per_step
from workloads.train.loss import LinearCrossEntropy, choose_implementation
from workloads.train.model import CausalLMWithLoss, Shape, build_causal_lm, shape_of
from workloads.train.optim import build_optimizer, clip_grad_norm, schedule, set_lr
from workloads.train.parallel import (
    GradientSync,
    MeshPlan,
    build_mesh,
    parallelize,
    plan_mesh,
    reduction_plan,
)
from workloads.transport.gate import run_transport_gate



def resolve_device(ctx: TrainContext) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_model(cfg: TrainConfig, *, device: torch.device) -> tuple[CausalLMWithLoss, Shape]:
    lm = build_causal_lm(cfg.model, device=device, seed=cfg.seed)
    loss = LinearCrossEntropy(
        implementation=choose_implementation(fused=cfg.fused_linear_ce, device=device),
        chunk_size=cfg.loss_chunk_size,
    )
    return CausalLMWithLoss(lm, loss=loss), shape_of(lm)


def node_of_each_rank(ctx: TrainContext, *, device: torch.device) -> list[int]:
    mine = torch.tensor([ctx.node_rank], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def mesh_plan(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device, n_params: int) -> MeshPlan:
    """Flat FSDP or HSDP for this run's nodes (`cfg.parallelism`; the same plan on every rank)."""
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return plan_mesh(
        requested=cfg.parallelism,
        node_of_rank=node_of_each_rank(ctx, device=device),
        n_params=n_params,
        device_memory_bytes=memory,
    )


def reductions(cfg: TrainConfig, plan: MeshPlan) -> tuple[torch.dtype, GradientSync]:
    """(FSDP2's reduce dtype, what each micro-step's backward reduces) for this config and mesh."""
    return reduction_plan(
        plan, mixed_precision=cfg.mixed_precision, cross_node_dtype=getattr(torch, cfg.cross_node_reduce_dtype)
    )


def shard_model(
    model: CausalLMWithLoss, cfg: TrainConfig, *, plan: MeshPlan, device: torch.device
) -> CausalLMWithLoss:
    reduce_dtype, _ = reductions(cfg, plan)
    return parallelize(
        model,
        mesh=build_mesh(plan, device_type=device.type),
        compile=cfg.compile,
        mixed_precision=cfg.mixed_precision,
        reshard_after_forward=cfg.reshard_after_forward,
        reduce_dtype=reduce_dtype,
    )


def resume(
    ctx: TrainContext, *, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer
) -> checkpoint.Progress:
    folder = ctx.latest_checkpoint()
    if folder is None:
        return checkpoint.Progress(step=0, data_position=0)
    return checkpoint.load(folder, model=model, optimizer=optimizer)


def device_batches(
    cfg: TrainConfig, *, ctx: TrainContext, device: torch.device, vocab_size: int, position: int
) -> Iterator[Batch]:
    source = build_source(
        cfg.data,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        vocab_size=vocab_size,
        model_name_or_path=cfg.model.name_or_path,
    )
    on_cuda = device.type == "cuda"
    for batch in batches(
        source,
        position=position,
        micro_batch=cfg.micro_batch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        pin_memory=on_cuda,
    ):
        yield batch.to(device, non_blocking=on_cuda)


def accumulate_gradients(
    model: CausalLMWithLoss, micro_batches: list[Batch], *, sync: GradientSync
) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients summed; returns the mean loss (a device
    tensor). Each micro-batch's mean loss is scaled by 1/len, so with equal-sized micro-batches the
    gradient is that of one batch holding them all."""
    loss = torch.zeros((), device=micro_batches[0].tokens.device)
    for i, batch in enumerate(micro_batches):
        micro_loss = model(batch.input_ids, batch.labels) / len(micro_batches)
        # After the forward: FSDP2 sets each unit's reduce dtype at its first forward.
        sync.before_backward(model, last=i == len(micro_batches) - 1)
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def train_step(
    model: CausalLMWithLoss,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    *,
    lr: float,
    grad_clip: float,
    sync: GradientSync = GradientSync(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over the micro-batches; returns (loss, grad norm) as device tensors, not
    yet read back."""
    set_lr(optimizer, lr)
    loss = accumulate_gradients(model, micro_batches, sync=sync)
    grad_norm = clip_grad_norm(model, max_norm=grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach()


def save_checkpoint(
    ctx: TrainContext,
    *,
    model: CausalLMWithLoss,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_position: int,
) -> Path:
    folder = checkpoint.checkpoint_dir(ctx.scratch_dir, step=step)
    progress = checkpoint.Progress(step=step, data_position=data_position)
    return checkpoint.save(folder, model=model, optimizer=optimizer, progress=progress)


def mean_across_ranks(values: torch.Tensor) -> list[float]:
    """All-reduce average (gloo has no AVG op), read back to the host: a sync point."""
    total = values.detach().to(torch.float32).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total / dist.get_world_size()).tolist()


@dataclass
class Throughput:
    """Tokens/s of the steps between consecutive log steps, excluding checkpoint saving."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    windows: list[float] = field(default_factory=list)

    def close_window(self, *, micro_batch: int, seq_len: int) -> float:
        rate = metrics.tokens_per_s(
            steps=self.steps,
            micro_batch=micro_batch,
            seq_len=seq_len,
            seconds=time.perf_counter() - self.started,
        )
        self.windows.append(rate)
        return rate

    def restart(self) -> None:
        self.started, self.steps = time.perf_counter(), 0

    def mean(self) -> float | None:
        """The mean over windows, leaving out the first (compilation, allocator warm-up) when
        there are others."""
        steady = self.windows[1:] or self.windows
        return sum(steady) / len(steady) if steady else None


def print_rank0(ctx: TrainContext, prefix: str, payload: dict) -> None:
    if ctx.rank == 0:
        print(prefix + json.dumps(payload, separators=(",", ":")), flush=True)


def nodes_in_run(ctx: TrainContext, *, device: torch.device) -> int:
    """How many nodes the ranks run on (node ranks are 0..N-1): the hosts that trained."""
    highest = torch.tensor([ctx.node_rank], dtype=torch.int64, device=device)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return int(highest.item()) + 1


def train(cfg: TrainConfig, ctx: TrainContext) -> dict:
    device = resolve_device(ctx)
    # First, before the model is built or a checkpoint restored: a wrong transport is found in
    # seconds, not after minutes of loading (TransportGateError on every rank).
    gate = run_transport_gate(cfg.transport, ctx=ctx, device=device)
    print_rank0(
        ctx, GATE_PREFIX, {"applies": gate.applies, "passed": gate.passed, "message": gate.message}
    )
    nodes = nodes_in_run(ctx, device=device)
    model, shape = build_model(cfg, device=device)
    plan = mesh_plan(cfg, ctx=ctx, device=device, n_params=shape.n_params)
    model = shard_model(model, cfg, plan=plan, device=device)
    _, sync = reductions(cfg, plan)
    optimizer = build_optimizer(model, cfg, device=device)
    progress = resume(ctx, model=model, optimizer=optimizer)
    data = device_batches(
        cfg, ctx=ctx, device=device, vocab_size=shape.vocab_size, position=progress.data_position
    )

    flops = metrics.flops_per_token(
        n_params=shape.n_params,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        head_dim=shape.head_dim,
        seq_len=cfg.seq_len,
    )
    per_step = samples_per_step(micro_batch=cfg.samples_per_rank_per_step, world_size=ctx.world_size)
    throughput = Throughput()
    first_loss: torch.Tensor | None = None
    first_value: float | None = None
    last: dict = {}
    for step in range(progress.step + 1, cfg.steps + 1):
        lr = schedule(cfg, step)
        micro_batches = [next(data) for _ in range(cfg.grad_accum_steps)]
        loss, grad_norm = train_step(model, optimizer, micro_batches, lr=lr, grad_clip=cfg.grad_clip, sync=sync)
        throughput.steps += 1
        if first_loss is None:
            first_loss = loss
        save_now = cfg.checkpoint_every > 0 and (step % cfg.checkpoint_every == 0 or step == cfg.steps)
        if not (save_now or step % cfg.log_every == 0 or step == cfg.steps):
            continue

        loss_value, first_value = mean_across_ranks(torch.stack([loss, first_loss]))
        rate = throughput.close_window(micro_batch=cfg.samples_per_rank_per_step, seq_len=cfg.seq_len)
        last = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "tokens_per_s_per_device": round(rate, 1),
            "mfu": metrics.device_mfu(
                device, tokens_per_s=rate, flops_per_token=flops, peak_flops=cfg.peak_flops
            ),
            "peak_mem_gib": round(metrics.peak_memory_gib(device), 2),
            "grad_norm": grad_norm.item(),
        }
        print_rank0(ctx, TRAIN_PREFIX, last)
        if save_now:
            position = progress.data_position + (step - progress.step) * per_step
            folder = save_checkpoint(ctx, model=model, optimizer=optimizer, step=step, data_position=position)
            ctx.report(last, checkpoint_dir=folder)
        else:
            ctx.report(last)
        throughput.restart()

    mean_rate = throughput.mean()
    summary = {
        "first_loss": first_value,
        "last_loss": last.get("loss"),
        "tokens_per_s_per_device": None if mean_rate is None else round(mean_rate, 1),
        "mfu": None
        if mean_rate is None
        else metrics.device_mfu(
            device, tokens_per_s=mean_rate, flops_per_token=flops, peak_flops=cfg.peak_flops
        ),
        "peak_mem_gib": round(metrics.peak_memory_gib(device), 2),
        "steps_done": max(0, cfg.steps - progress.step),
        "resumed_from_step": progress.step,
        "world_size": ctx.world_size,
        "nodes": nodes,
        "parallelism": {"kind": plan.kind, "mesh": list(plan.shape), "reason": plan.reason},
        "grad_accum_steps": cfg.grad_accum_steps,
        "loss_implementation": model.loss.implementation,
        "flops_per_token": flops,
        "transport_gate": dataclasses.asdict(gate),
    }
    print_rank0(ctx, SUMMARY_PREFIX, summary)
    return summary
