"""The training loop, shared by the Ray Train and torchrun adapters; it never imports Ray.

`train(cfg, ctx)` expects the default process group to exist already. It only calls small named
steps: run the transport gate, fetch the pretrained model (once per node), read and pack the data,
build the model on the meta device, shard it, fill the shards from the pretrained weights, build the
optimizer, resume from the latest checkpoint, check that packed samples cannot attend to each other,
then step, evaluate, report and save; the final checkpoint also gets the trained model as a Hugging
Face folder. Values are read back from the device only on log steps, so other steps queue work
without waiting for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from workloads.context import (DATA_PREFIX, GATE_PREFIX, LOAD_PREFIX, METHOD_PREFIX, SUMMARY_PREFIX, TRAIN_PREFIX,
                               TrainContext)
from workloads.model_io.export import ModelMetadata, generation_config_for
from workloads.model_io.hf_writer import resolve_dtype
from workloads.model_io.run_layout import MODEL_DIR
from workloads.model_io.sources import fetch_model
from workloads.train import checkpoint, elastic, metrics, resumed, tracking
from workloads.train.config import TrainConfig
from workloads.train.data import Batch, Data, reading_of_data, samples_per_step
from workloads.train.encode import load_tokenizer
from workloads.train.loss import IGNORE_INDEX
from workloads.train.model import (
    CausalLMWithLoss,
    Shape,
    build_causal_lm,
    causal_lm_on_meta,
    load_pretrained,
    model_config,
    shape_of,
)
from workloads.train.method import FineTuneMethod, FullFineTune, method_for, trainable_parameters
from workloads.train.objective import Objective, objective_for
from workloads.train.starting import with_starting_model
from workloads.train.optim import build_optimizer, schedule
from workloads.train.elastic import ELASTIC_PREFIX, accumulation_for
from workloads.train.preemption import PREEMPTION_PREFIX, PreemptionWatch, notice_record
from workloads.train.paths import resolve_path
from workloads.train.parallel import (
    GradientSync,
    MeshPlan,
    build_mesh,
    model_state_bytes,
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


def fetch_pretrained(cfg: TrainConfig) -> Optional[Path]:
    """The pretrained model's local folder (downloaded once per node), or None for a named
    architecture trained from random weights."""
    if cfg.model.is_named_architecture:
        return None
    # A folder sent with the job is found in the job's folder, not the worker's (workloads/train/paths.py).
    spec = resolve_path(cfg.model.name_or_path, field="model.name_or_path", hub_id_allowed=True)
    return fetch_model(spec, revision=cfg.model.revision, cache_dir=cfg.cache_dir)


def build_model(
    cfg: TrainConfig, *, device: torch.device, pretrained: Optional[Path] = None,
    method: Optional[FineTuneMethod] = None, objective: Optional[Objective] = None,
) -> tuple[CausalLMWithLoss, Shape]:
    """Random weights for a named architecture; for a pretrained folder, parameters on the meta
    device, to be filled after sharding (`load_weights`). Then the method adapts it (LoRA's
    adapters) and the objective wraps it (the SFT loss, or a preference objective's log-probs);
    the shape is the base model's."""
    if pretrained is None:
        lm = build_causal_lm(cfg.model, device=device, seed=cfg.seed)
    else:
        lm = causal_lm_on_meta(model_config(cfg.model, pretrained=pretrained))
    shape = shape_of(lm)
    (method or method_for(cfg)).adapt(lm, mixed_precision=cfg.mixed_precision, seed=cfg.seed)
    return (objective or objective_for(cfg)).wrap(lm, device=device), shape


def node_of_each_rank(ctx: TrainContext, *, device: torch.device) -> list[int]:
    mine = torch.tensor([ctx.node_rank], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def mesh_plan(cfg: TrainConfig, *, ctx: TrainContext, device: torch.device, model: nn.Module) -> MeshPlan:
    """Flat FSDP or HSDP for this run's nodes (`cfg.parallelism`; the same plan on every rank)."""
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return plan_mesh(
        requested=cfg.parallelism,
        node_of_rank=node_of_each_rank(ctx, device=device),
        model_state_bytes=model_state_bytes(model),
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
        activation_checkpointing=cfg.model.activation_checkpointing,
        activation_offloading=cfg.model.activation_offloading,
    )


def resume(
    ctx: TrainContext, *, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer, method: FineTuneMethod
) -> checkpoint.Progress:
    folder = ctx.latest_checkpoint()
    if folder is None:
        return checkpoint.Progress(step=0, data_position=0)
    return checkpoint.load(folder, model=model, optimizer=optimizer, method=method.name,
                           frozen=method.saves_frozen)


def load_weights(
    model: CausalLMWithLoss, pretrained: Path, *, ctx: TrainContext, device: torch.device, fetch_s: float,
    build_s: float = 0.0, method: Optional[FineTuneMethod] = None,
) -> list[dict]:
    """Fill this rank's shards from the pretrained folder; every rank's load figures, rank order:
    seconds to fetch the folder, to build and shard the empty model, to fill the shards; bytes read;
    peak host memory so far and peak GPU memory of the fill (the shards and one slice in flight)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    method = method or FullFineTune()
    stats = load_pretrained(model.lm, pretrained, device=device, name_in_files=method.weight_file_name)
    method.fill_adapters(model.lm)
    mine = {
        "rank": ctx.rank,
        "node_rank": ctx.node_rank,
        "fetch_s": round(fetch_s, 2),
        "build_s": round(build_s, 2),
        "fill_s": round(stats.seconds, 2),
        "read_mib": round(stats.bytes_read / 2**20, 1),
        "peak_host_gib": round(metrics.peak_host_memory_gib(), 2),
        "peak_device_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if stats.unused:
        print_rank0(ctx, LOAD_PREFIX, {"unused_tensors": stats.unused[:10], "unused_count": len(stats.unused)})
    return everyone


def model_metadata(cfg: TrainConfig, *, config, pretrained: Optional[Path], data: Data) -> ModelMetadata:
    """What each checkpoint's `model/` folder holds besides the weights; `config` is the model's as
    read from its source (building the model in fp32 rewrites the built model's dtype)."""
    tokenizer = data.tokenizer
    if tokenizer is None and pretrained is not None and any(pretrained.glob("tokenizer*")):
        tokenizer = load_tokenizer(str(pretrained))
    extra_eos = [] if data.end_of_turn is None else [data.end_of_turn]
    return ModelMetadata(
        config=config,
        generation_config=generation_config_for(config, source=pretrained, extra_eos=extra_eos),
        tokenizer=tokenizer,
        dtype=resolve_dtype(cfg.export_dtype, config),
    )


def device_batches(
    source, cfg: TrainConfig, *, ctx: TrainContext, device: torch.device, position: int,
    objective: Optional[Objective] = None,
) -> Iterator[Batch]:
    on_cuda = device.type == "cuda"
    for batch in (objective or objective_for(cfg)).batches(
        source,
        position=position,
        micro_batch=cfg.micro_batch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        pin_memory=on_cuda,
    ):
        yield batch.to(device, non_blocking=on_cuda)


def save_checkpoint(
    ctx: TrainContext,
    *,
    model: CausalLMWithLoss,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_position: int,
    metadata: ModelMetadata,
    export_weights: bool,
    tracking_run_id: str = "",
    method: Optional[FineTuneMethod] = None,
    planned_world_size: int = 0,
    hub_revisions: Optional[dict[str, str]] = None,
    eval_loss: Optional[float] = None,
    objective: Optional[Objective] = None,
) -> Path:
    """Save the sharded state (what the method keeps); rank 0 adds `model/` (config, generation
    config, tokenizer) and, with `export_weights`, the method's export of the weights there, and
    what the objective keeps (a precomputed reference)."""
    method = method or FullFineTune()
    folder = checkpoint.checkpoint_dir(ctx.scratch_dir, step=step)
    progress = checkpoint.Progress(step=step, data_position=data_position, world_size=ctx.world_size,
                                   tracking_run_id=tracking_run_id, method=method.name,
                                   planned_world_size=planned_world_size, hub_revisions=hub_revisions or {},
                                   eval_loss=eval_loss)
    checkpoint.save(folder, model=model, optimizer=optimizer, progress=progress, frozen=method.saves_frozen)
    if ctx.rank == 0:
        metadata.write(folder / MODEL_DIR)
        method.write_metadata(folder / MODEL_DIR)
    if export_weights:
        method.write_export(model.lm, folder / MODEL_DIR, dtype=metadata.dtype, writer_rank=ctx.rank == 0)
    if objective is not None:
        objective.save(folder, writer_rank=ctx.rank == 0)
    return folder


LEAK_RTOL = 1e-4
"""A sample's loss may move this much (relative) when another sample of its row changes: bf16
kernels are deterministic, so the expected change is none; attention across samples moves it by
orders of magnitude more."""


def packed_attention_leaks(model: CausalLMWithLoss, batch: Batch, *, vocab_size: int) -> bool:
    """Whether a packed sample's loss changes when the sample before it in its row changes: every
    rank runs the same two forward passes (collectives); the verdict is any rank's."""
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    altered = batch.input_ids.clone()
    judged = False
    for row, positions in enumerate(batch.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        if len(starts) < 3 or not (batch.labels[row, starts[1]:starts[2]] != IGNORE_INDEX).any():
            continue
        labels[row, starts[1]:starts[2]] = batch.labels[row, starts[1]:starts[2]]
        altered[row, : starts[1]] = (altered[row, : starts[1]] + 1) % vocab_size
        judged = True
        break
    model.eval()
    with torch.no_grad():
        # The sum: one value for the SFT loss and a preference objective's per-token log-probs alike.
        before = model(batch.input_ids, labels, batch.position_ids, **batch.attention()).sum()
        after = model(altered, labels, batch.position_ids, **batch.attention()).sum()
    model.train()
    leak = torch.tensor(
        [float(judged and abs(after.item() - before.item()) > LEAK_RTOL * max(1.0, abs(before.item())))],
        device=before.device,
    )
    dist.all_reduce(leak, op=dist.ReduceOp.MAX)
    return bool(leak.item())


def mean_across_ranks(values: torch.Tensor) -> list[float]:
    """All-reduce average (gloo has no AVG op), read back to the host: a sync point."""
    total = values.detach().to(torch.float32).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total / dist.get_world_size()).tolist()


@dataclass
class Throughput:
    """Tokens/s of the steps between consecutive log steps, excluding checkpoint saving. Tokens are
    the positions holding examples: padding is counted apart (`padding_share`), not as work."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    """Example tokens of this window (this rank's)."""
    windows: list[float] = field(default_factory=list)
    all_tokens: int = 0
    """Example tokens of the run so far (this rank's)."""
    all_positions: int = 0
    """Positions of the run so far, padding included."""

    def add(self, micro_batches: list[Batch]) -> None:
        tokens = sum(b.input_ids.numel() if b.example_tokens is None else b.example_tokens for b in micro_batches)
        self.tokens += tokens
        self.all_tokens += tokens
        self.all_positions += sum(b.input_ids.numel() for b in micro_batches)

    def close_window(self, *, tokens: float | None = None) -> float:
        """This window's tokens/s: of `tokens` when given (e.g. the mean over ranks), else of
        this rank's."""
        rate = metrics.tokens_per_s(
            tokens=self.tokens if tokens is None else tokens, seconds=time.perf_counter() - self.started
        )
        self.windows.append(rate)
        return rate

    def restart(self) -> None:
        self.started, self.tokens = time.perf_counter(), 0

    def mean(self) -> float | None:
        """The mean over windows, leaving out the first (compilation, allocator warm-up) when
        there are others."""
        steady = self.windows[1:] or self.windows
        return sum(steady) / len(steady) if steady else None

    def padding_share(self) -> float | None:
        """Share of the positions trained so far that were padding."""
        return None if not self.all_positions else round(1 - self.all_tokens / self.all_positions, 4)


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
    # On another number of ranks than planned (an elastic run after a node loss, a run resumed on
    # another world size), more or fewer micro-steps per rank keep the samples per optimizer step
    # (workloads/train/elastic.py); ValueError where none can. A resumed run also reads the hub
    # commits its checkpoint recorded (workloads/train/resumed.py).
    saved = resumed.saved_progress(ctx)
    planned_world_size = elastic.planned_world_size(world_size=ctx.world_size, elastic_planned=ctx.planned_world_size,
                                                    saved=saved)
    # With rows_per_step (the GPU presets) the rows of a step are stated outright: the micro-steps
    # follow from the world size the run has, whatever it was planned or saved on.
    cfg = cfg.for_world_size(ctx.world_size) if cfg.rows_per_step else dataclasses.replace(
        cfg, grad_accum_steps=accumulation_for(
            ctx.world_size, grad_accum_steps=cfg.grad_accum_steps, planned_world_size=planned_world_size,
            cause="elastic" if ctx.planned_world_size else "resume"))
    cfg, kept = resumed.keep_hub_revisions(cfg, saved)
    if ctx.rank == 0 and kept:
        print("\n".join(kept), flush=True)
    cfg, started_from = with_starting_model(cfg)  # a run named by a path only the nodes see (the client does the rest)
    if ctx.rank == 0 and started_from:
        print(started_from, flush=True)
    nodes = nodes_in_run(ctx, device=device)
    started = time.perf_counter()
    pretrained = fetch_pretrained(cfg)
    fetch_s = time.perf_counter() - started
    config = model_config(cfg.model, pretrained=pretrained)
    vocab_size = config.vocab_size
    # Held out for the planned world size: an elastic run on fewer ranks splits its data the same way.
    eval_rows = cfg.eval_batches * cfg.micro_batch * planned_world_size if cfg.eval_every else 0
    objective = objective_for(cfg)
    data = objective.build_data(cfg, vocab_size=vocab_size, eval_rows=eval_rows, cache_dir=cfg.cache_dir,
                                model_name_or_path=str(pretrained or cfg.model.name_or_path))
    print_rank0(ctx, DATA_PREFIX, {**data.stats, **reading_of_data(
        data.stats, steps=cfg.steps,
        rows_per_step=samples_per_step(micro_batch=cfg.samples_per_rank_per_step, world_size=ctx.world_size))})
    if cfg.eval_every and data.eval is None:
        raise ValueError("eval_every is set but no data is held out: raise data.eval_fraction or set eval_every=0")
    held_out = [] if data.eval is None else objective.eval_batches(
        data.eval, rows=data.eval_rows, micro_batch=cfg.micro_batch, rank=ctx.rank, world_size=ctx.world_size,
        max_rows=cfg.eval_batches * cfg.micro_batch * planned_world_size)

    built = time.perf_counter()
    method = method_for(cfg)
    model, shape = build_model(cfg, device=device, pretrained=pretrained, method=method, objective=objective)
    plan = mesh_plan(cfg, ctx=ctx, device=device, model=model)
    # Counted before sharding: the base's weights and the method's additions, and which train.
    all_params, trained_params = sum(p.numel() for p in model.parameters()), trainable_parameters(model)
    print_rank0(ctx, METHOD_PREFIX, {**method.describe(), "trained_params": trained_params, "params": all_params})
    model = shard_model(model, cfg, plan=plan, device=device)
    if pretrained is None and device.type == "cuda":
        # A named architecture's random weights may have been built whole on the GPU (init_device):
        # that passing copy is not the run's peak, which counts from the sharded model on.
        torch.cuda.reset_peak_memory_stats(device)
    _, sync = reductions(cfg, plan)
    load = None
    if pretrained is not None:
        load = load_weights(model, pretrained, ctx=ctx, device=device, fetch_s=fetch_s,
                            build_s=time.perf_counter() - built, method=method)
        print_rank0(ctx, LOAD_PREFIX, {"source": cfg.model.name_or_path, "ranks": load})
    metadata = model_metadata(cfg, config=config, pretrained=pretrained, data=data)
    optimizer = build_optimizer(model, cfg, device=device)
    progress = resume(ctx, model=model, optimizer=optimizer, method=method)
    objective.prepare(model, method=method, data=data, pretrained=pretrained, device=device,
                      resume_from=ctx.latest_checkpoint() if progress.step else None, rank=ctx.rank,
                      world_size=ctx.world_size)
    if ctx.planned_world_size or planned_world_size != ctx.world_size:  # says on how many ranks it goes on
        print_rank0(ctx, ELASTIC_PREFIX, {"world_size": ctx.world_size, "planned_world_size": planned_world_size,
                                          "nodes": nodes, "grad_accum_steps": cfg.grad_accum_steps,
                                          "samples_per_step": cfg.samples_per_rank_per_step * ctx.world_size,
                                          "resumed_from_step": progress.step, "parallelism": plan.kind})
    stream = device_batches(data.train, cfg, ctx=ctx, device=device, position=progress.data_position,
                            objective=objective)
    first_batch = next(stream)
    if first_batch.position_ids is not None and packed_attention_leaks(model, first_batch, vocab_size=shape.vocab_size):
        raise RuntimeError(
            f"packed samples attend to each other with attn_implementation={cfg.model.attn_implementation!r} "
            "and this transformers version (the backend ignores the batch's cu_seq_lens and its restarting "
            "position ids): use varlen (the default), sdpa, flex_attention or flash_attention_2"
        )
    stream = itertools.chain([first_batch], stream)
    tracker = tracking.start(cfg, rank=ctx.rank, progress=progress, world_size=ctx.world_size, nodes=nodes,
                             plan=plan)

    flops = metrics.flops_per_token(
        n_params=all_params,
        frozen_params=all_params - trained_params,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        head_dim=shape.head_dim,
        seq_len=cfg.seq_len,
    ) + objective.extra_flops_per_token(n_params=shape.n_params, n_layers=shape.n_layers, n_heads=shape.n_heads,
                                        head_dim=shape.head_dim, seq_len=cfg.seq_len)
    per_step = samples_per_step(micro_batch=cfg.samples_per_rank_per_step, world_size=ctx.world_size)
    peak_flops = metrics.device_peak_flops(device, configured=cfg.peak_flops)
    watch = PreemptionWatch(ctx.preemption_notice, every=cfg.preemption_check_every)
    throughput = Throughput()
    first_loss: torch.Tensor | None = None
    first_value: float | None = None
    last: dict = {}
    eval_loss: float | None = None
    best_eval = float("inf")  # of this attempt: a resumed run's best checkpoint keeps its export
    for step in range(progress.step + 1, cfg.steps + 1):
        lr = schedule(cfg, step)
        micro_batches = [next(stream) for _ in range(cfg.grad_accum_steps)]
        loss, grad_norm = objective.step(model, optimizer, micro_batches, lr=lr, grad_clip=cfg.grad_clip, sync=sync)
        throughput.add(micro_batches)
        if first_loss is None:
            first_loss = loss
        final = step == cfg.steps
        notice = watch.check(step)  # every rank asks at the same steps: a barrier
        notice_seen = time.time()
        save_now = notice is not None or cfg.checkpoint_every > 0 and (step % cfg.checkpoint_every == 0 or final)
        eval_now = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or final)
        if cfg.checkpoint.keep_best:  # every checkpoint scored, every evaluation kept
            save_now = eval_now = save_now or eval_now
        if not (save_now or eval_now or step % cfg.log_every == 0 or final):
            continue

        window_tokens = torch.tensor(float(throughput.tokens), device=device)
        loss_value, first_value, mean_tokens = mean_across_ranks(torch.stack([loss, first_loss, window_tokens]))
        rate = throughput.close_window(tokens=mean_tokens)
        last = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "tokens_per_s_per_device": round(rate, 1),
            "mfu": metrics.device_mfu(
                device, tokens_per_s=rate, flops_per_token=flops, peak_flops=peak_flops
            ),
            "peak_mem_gib": round(metrics.peak_memory_gib(device), 2),
            "mem_in_use_gib": round(metrics.memory_in_use_gib(device), 3),
            "grad_norm": grad_norm.item(),
            **objective.step_metrics(),
        }
        best = False
        if eval_now:
            evaluation = objective.evaluate(model, held_out, device=device)
            eval_loss = evaluation["eval_loss"]
            last.update(evaluation)
            best = cfg.checkpoint.keep_best and eval_loss < best_eval
            best_eval = min(best_eval, eval_loss)
        print_rank0(ctx, TRAIN_PREFIX, last)
        tracker.log_step(last)
        if save_now:
            position = progress.data_position + (step - progress.step) * per_step
            folder = save_checkpoint(ctx, model=model, optimizer=optimizer, step=step, data_position=position,
                                     metadata=metadata, export_weights=(final or best) and cfg.export_model,
                                     tracking_run_id=tracker.run_id, method=method,
                                     planned_world_size=planned_world_size, hub_revisions=resumed.hub_revisions(cfg),
                                     eval_loss=eval_loss if eval_now else None, objective=objective)
            ctx.report(last, checkpoint_dir=folder)
            if notice is not None:
                print_rank0(ctx, PREEMPTION_PREFIX, notice_record(notice, step=step, seen_unix_s=notice_seen,
                                                                  saved_unix_s=time.time()))
        else:
            ctx.report(last)
        throughput.restart()

    mean_rate = throughput.mean()
    steps_done = max(0, cfg.steps - progress.step)
    # A collective on every rank: each rank's rows hold their own share of padding.
    (example_tokens,) = mean_across_ranks(torch.tensor([float(throughput.all_tokens)], device=device))
    summary = {
        "first_loss": first_value,
        "last_loss": last.get("loss"),
        "eval_loss": eval_loss,
        "tokens_per_s_per_device": None if mean_rate is None else round(mean_rate, 1),
        "mfu": None
        if mean_rate is None
        else metrics.device_mfu(
            device, tokens_per_s=mean_rate, flops_per_token=flops, peak_flops=peak_flops
        ),
        "peak_flops": peak_flops,
        "example_tokens_per_step": round(example_tokens / steps_done, 1) if steps_done else None,
        "padding_share": throughput.padding_share(),
        "peak_mem_gib": round(metrics.peak_memory_gib(device), 2),
        "steps_done": steps_done,
        "resumed_from_step": progress.step,
        "world_size": ctx.world_size,
        "planned_world_size": planned_world_size,
        "nodes": nodes,
        "parallelism": {"kind": plan.kind, "mesh": list(plan.shape), "reason": plan.reason},
        "grad_accum_steps": cfg.grad_accum_steps,
        "micro_batch": cfg.micro_batch,
        "rows_per_step": per_step,
        "loss_implementation": model.loss.implementation,
        **method.describe(),
        **objective.describe(),
        "trained_params": trained_params,
        "params": all_params,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "activation_offloading": cfg.model.activation_offloading and device.type == "cuda",
        "flops_per_token": flops,
        "transport_gate": dataclasses.asdict(gate),
        "data": data.stats,
        "model_load": load,
        "preemption_checks": watch.summary(),
    }
    print_rank0(ctx, SUMMARY_PREFIX, summary)
    tracker.finish(summary)
    return summary
