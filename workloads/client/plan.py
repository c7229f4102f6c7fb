"""`python -m workloads plan`: what a run needs and what it costs, without a cluster or a GPU.

    python -m workloads plan [--preset P | --model-size 1.5b|7b] [--set KEY=VALUE ...]
                             [--stack NAME] [--instance-type g6.12xlarge] [--nodes 2] [--region R] [--json]

Prints the method, the rows per optimizer step (a preset's fixed rows, made of the largest micro-batch
the GPU's memory takes and the micro-steps the ranks need), the predicted memory per GPU against the
GPU's (workloads/sizing/memory.py), the predicted tokens/s (the step-time model, workloads/sizing/step_time.py,
from the loop's MFU measured on an H200), the cluster's $/h at a region's On-Demand list price, and the
hours and dollars per billion tokens. Without --preset, the one `submit` would choose for that GPU
(and the method `--set method=` names), and why. `--stack NAME` plans that stack's GPU nodes in its
region; --instance-type, --nodes and --region say otherwise. Exit codes: 0 it fits; 1 it does not
(the nearest settings that do are listed); 2 bad input.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Optional

from infra.instance_types import PRICE_TABLE_REGION
from workloads.client.cluster import PROJECT_DIR
from workloads.client.usage import Parser, UsageError

DEFAULT_INSTANCE_TYPE = "g6.12xlarge"
DEFAULT_NODES = 2
"""The GPU nodes planned without --stack or --nodes: a stack's default (ray-eks:gpuNodeCount), and
submit's with --address and --instance-type."""

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2

MEASURED_MFU = {"full": 0.552, "lora": 0.552}
"""The loop's MFU by method, measured on H200s (docs/PERFORMANCE.md): carried over to the target's
GPU by its peak, which assumes the same efficiency there (an estimate, said so in the output). LoRA
takes the full fine-tune's until a benchmark measures its own (the memory check's three timed steps
of 7B LoRA ran at 58.0%)."""


def _arg_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m workloads plan", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", help="training preset (default: the one submit picks for the GPU)")
    parser.add_argument("--model-size", default="1.5b", choices=("1.5b", "7b"),
                        help="without --preset: the model whose preset to choose (default 1.5b)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--stack", help="plan this stack's GPU nodes (instance type, nodes, region: Pulumi.NAME.yaml)")
    parser.add_argument("--instance-type",
                        help=f"GPU instance type (default: the stack's, else {DEFAULT_INSTANCE_TYPE})")
    parser.add_argument("--nodes", type=int, help=f"GPU nodes (default: the stack's, else {DEFAULT_NODES})")
    parser.add_argument("--region", help="the region whose On-Demand prices the cost takes (default: the stack's, "
                        "else us-east-1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def step_model(cfg, arch, memory_settings, *, kind: str):
    """The step-time model's shape and strategy for this run (LoRA reduces only its adapters)."""
    from workloads.sizing.memory import parameters
    from workloads.sizing.step_time import BF16_BYTES, FP32_BYTES, ModelShape, Strategy
    from workloads.train.metrics import flops_per_token

    params = parameters(arch, memory_settings)
    per_layer = sum(p.numel for p in params if p.unit == "layer")
    root = sum(p.numel for p in params if p.unit != "layer")
    trained_layer = sum(p.numel for p in params if p.unit == "layer" and p.trained)
    trained_root = sum(p.numel for p in params if p.unit != "layer" and p.trained)
    total = arch.layers * per_layer + root
    frozen = total - arch.layers * trained_layer - trained_root
    attention = 12.0 * arch.layers * arch.heads * arch.head_dim * cfg.seq_len
    flops = flops_per_token(n_params=total, frozen_params=frozen, n_layers=arch.layers, n_heads=arch.heads,
                            head_dim=arch.head_dim, seq_len=cfg.seq_len)
    if cfg.objective == "dpo" and cfg.dpo.reference == "model":  # the reference's forward, every step
        flops += 2.0 * total + attention / 3
    shape = ModelShape(layers=arch.layers, params_per_layer=per_layer, root_params=root, flops_per_token=flops,
                       trained_per_layer=trained_layer, trained_root=trained_root,
                       forward_flops_per_token=2.0 * total + attention / 3)
    cross = BF16_BYTES if cfg.mixed_precision and cfg.cross_node_reduce_dtype == "bfloat16" else FP32_BYTES
    strategy = Strategy(label=cfg.method, kind=kind, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len,
                        grad_accum_steps=cfg.grad_accum_steps, reshard_after_forward=cfg.reshard_after_forward,
                        activation_checkpointing=cfg.model.activation_checkpointing, cross_node_bytes=cross)
    return shape, strategy


def make_plan(cfg, *, preset_name: str, instance_type: str, nodes: int, cwd: Path,
              size_micro_batch: bool = True, region: str = PRICE_TABLE_REGION, preset_reason: str = "",
              method_set: Optional[str] = None) -> dict:
    """The plan as plain data (what --json prints). With `size_micro_batch` (the user set none) and
    rows_per_step, the micro-batch is the largest the GPU's memory takes, as `submit` picks it.
    `method_set`: the method --set gives a preset of another (the plan is that preset as set)."""
    from infra.instance_types import INSTANCE_TYPES
    from infra.prices import on_demand
    from workloads.sizing.memory import Architecture, offloaded_host_bytes, settings_for
    from workloads.sizing.step_time import Hardware, Link, predict_step
    from workloads.client.fit import (Target, assess, check_lora_targets, model_config, nearest_fits,
                                      offloading_turned_on, sized_for)

    target = Target.instances(instance_type, nodes)
    kind = INSTANCE_TYPES[instance_type]
    config = model_config(cfg, cwd=cwd)
    if config is None:
        raise ValueError(f"model.name_or_path {cfg.model.name_or_path!r}: its shape cannot be read here (give a "
                         "named architecture, a local folder or a hub id this machine can reach)")
    check_lora_targets(cfg, config)
    arch = Architecture.from_config(config)
    sized = sized_for(cfg, target, cwd=cwd, config=config) if size_micro_batch else cfg
    fit = assess(sized, arch, target)
    turned_on = offloading_turned_on(cfg, sized)
    price = on_demand(instance_type, region)
    cfg, run = sized, fit.cfg  # run: the micro-batch and micro-steps the target's ranks train with
    world = target.world_size
    plan = {
        "preset": preset_name, "preset_reason": preset_reason, "method_set": method_set,
        "model": cfg.model.name_or_path, "method": cfg.method, "objective": cfg.objective,
        "reference": reference_kind(cfg),
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "activation_offloading": cfg.model.activation_offloading,
        "offloading_turned_on": turned_on,
        "instance_type": instance_type, "nodes": nodes, "gpus_per_node": kind.gpus, "gpu": kind.gpu_model,
        "world_size": world, "parallelism": "hsdp" if fit.shard_ranks < world else "fsdp",
        "shard_ranks": fit.shard_ranks, "micro_batch": run.micro_batch, "grad_accum_steps": run.grad_accum_steps,
        "rows_per_step": run.micro_batch * run.grad_accum_steps * world,
        "rows_fixed": bool(cfg.rows_per_step),
        "micro_batch_from_memory": bool(cfg.rows_per_step) and size_micro_batch and fit.fits,
        "micro_batch_fits_none": bool(cfg.rows_per_step) and size_micro_batch and not fit.fits,
        "tokens_per_step": run.micro_batch * run.grad_accum_steps * world * cfg.seq_len,
        "memory": {"predicted_gib": round(fit.prediction.peak_gib, 2), "needed_gib": round(fit.needed_gib, 2),
                   "gpu_gib": round(target.memory_gib, 2), "fits": fit.fits, "phase": fit.prediction.phase,
                   "terms_gib": {k: round(v / 2**30, 2) for k, v in fit.prediction.terms.items()},
                   "offloaded_to_host_gib": round(offloaded_host_bytes(
                       arch, settings_for(run, shard_ranks=fit.shard_ranks)) / 2**30, 2)},
        "region": region,
        "usd_per_hour": None if price.usd_per_hour is None else round(nodes * price.usd_per_hour, 2),
        "price": {"region": price.region, "date": price.date},
    }
    if not fit.fits:
        plan["fits_with"] = [{"change": a.label, "predicted_gib": round(a.fit.prediction.peak_gib, 2)}
                             for a in nearest_fits(cfg, arch, target)]
    peak = kind.gpu.peak_bf16_flops if kind.gpu else None
    if peak is None:
        plan["speed"] = None
        return plan
    mfu = MEASURED_MFU[cfg.method]
    hardware = Hardware(nodes=nodes, gpus_per_node=kind.gpus, peak_flops=peak, mfu=mfu,
                        intra=Link.constant(kind.gpu.link_gbps), inter=Link.constant(kind.network_gbps / 8),
                        usd_per_node_hour=kind.usd_per_hour)
    shape, strategy = step_model(run, arch, settings_for(run, shard_ranks=fit.shard_ranks), kind=plan["parallelism"])
    step = predict_step(hardware, shape, strategy)
    cluster = step.tokens_per_s_per_gpu * world
    hours = 1e9 / cluster / 3600
    plan["speed"] = {"tokens_per_s_per_gpu": round(step.tokens_per_s_per_gpu, 1), "tokens_per_s": round(cluster, 1),
                     "step_s": round(step.step_s, 3), "exposed_comm_s": round(step.exposed_comm_s, 3),
                     "mfu": mfu, "peak_flops": peak, "inter_node_gbps": kind.network_gbps / 8,
                     "hours_per_billion_tokens": round(hours, 2),
                     "usd_per_billion_tokens": (None if plan["usd_per_hour"] is None
                                                else round(hours * plan["usd_per_hour"], 2))}
    parameters = shape.layers * shape.params_per_layer + shape.root_params
    plan["run"] = run_time(cfg, step_s=step.step_s, parameters=parameters, gpu=kind.gpu_model, peak_flops=peak,
                           gpus=world, usd_per_hour=plan["usd_per_hour"], cwd=cwd)
    return plan


def reference_kind(cfg) -> "str | None":
    """How a preference objective's reference is had (None for SFT), as `plan` says it."""
    if cfg.objective != "dpo":
        return None
    if cfg.dpo.reference == "precomputed":
        return "precomputed before step 1"
    if cfg.dpo.reference_model:
        return f"a frozen copy of {cfg.dpo.reference_model}"
    return "the adapters switched off" if cfg.method == "lora" else "a frozen copy"


def run_time(cfg, *, step_s: float, parameters: int, gpu: str, peak_flops: float, gpus: int,
             usd_per_hour: float | None, cwd: Path) -> dict:
    """The whole run: its steps, then the evaluation after training (workloads/evaluate/timing.py)."""
    from workloads.evaluate.timing import estimate

    evaluation = estimate(cfg, parameters=parameters, gpu=gpu, peak_flops=peak_flops, gpus=gpus, cwd=cwd)
    training_s = cfg.steps * step_s
    total_s = training_s + (evaluation.seconds if evaluation else 0.0)
    return {"steps": cfg.steps, "training_s": round(training_s, 1),
            "evaluation": None if evaluation is None else evaluation.to_dict(), "total_s": round(total_s, 1),
            "usd": None if usd_per_hour is None else round(total_s / 3600 * usd_per_hour, 2)}


def format_plan(plan: dict) -> str:
    memory, speed = plan["memory"], plan["speed"]
    method = "LoRA" if plan["method"] == "lora" else "full fine-tune"
    if plan.get("objective") == "dpo":
        method = f"DPO, {method} (reference: {plan['reference']})"
    extra = ", activation checkpointing" if plan["activation_checkpointing"] else ""
    if plan["activation_offloading"]:
        extra += (" and offloading (turned on: without it the run does not fit)" if plan["offloading_turned_on"]
                  else " and offloading")
    layout = (f"HSDP: sharded over {plan['shard_ranks']} ranks per node" if plan["parallelism"] == "hsdp"
              else f"flat FSDP over {plan['world_size']} ranks")
    terms = ", ".join(f"{k} {v:.2f}" for k, v in memory["terms_gib"].items())
    verdict = "fits" if memory["fits"] else "DOES NOT FIT"
    as_set = f" with --set method={plan['method_set']}" if plan.get("method_set") else ""
    lines = [
        f"plan            {plan['preset']}{as_set} on {plan['nodes']} x {plan['instance_type']} "
        f"({plan['world_size']} x {plan['gpu']})",
        *([f"preset          {plan['preset']}: {plan['preset_reason']}"] if plan.get("preset_reason") else []),
        f"method          {method} of {plan['model']}{extra}, {layout}",
        f"rows per step   {plan['rows_per_step']} = micro-batch {plan['micro_batch']} x {plan['grad_accum_steps']} "
        f"micro-steps x {plan['world_size']} ranks ({plan['tokens_per_step']:,} tokens)"
        + (f"; fixed by {plan['preset']}: the micro-steps follow the ranks" if plan["rows_fixed"] else "")
        + ("; the largest micro-batch the GPU's memory takes" if plan["micro_batch_from_memory"] else "")
        + ("; no micro-batch fits the GPU's memory" if plan.get("micro_batch_fits_none") else ""),
        f"memory per GPU  {memory['predicted_gib']:.2f} GiB predicted, {memory['needed_gib']:.2f} with the "
        f"allocator's slack and the CUDA context, of {memory['gpu_gib']:.2f} GiB ({plan['gpu']}): {verdict}",
        f"                [{terms}]",
    ]
    if memory["offloaded_to_host_gib"]:
        lines.append(f"host memory     {memory['offloaded_to_host_gib']:.2f} GiB pinned per rank for the offloaded "
                     "layer inputs")
    if speed is None:
        lines.append(f"speed           not predicted: no published bf16 peak for the {plan['gpu']}")
    else:
        lines.append(f"speed           {speed['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                     f"{speed['tokens_per_s']:,.0f} in all (step {speed['step_s']:.2f} s; MFU {speed['mfu']} as "
                     f"measured on H200s, of {speed['peak_flops'] / 1e12:.0f} TFLOP/s; "
                     f"{speed['inter_node_gbps']:.1f} GB/s between nodes)")
        hours = f"{speed['hours_per_billion_tokens']:,.1f} h"
        lines.append(f"cost            no On-Demand list price for {plan['instance_type']} (Capacity Blocks); "
                     f"{hours} per billion tokens" if plan["usd_per_hour"] is None else
                     f"cost            ${plan['usd_per_hour']:.2f} per hour ({_priced(plan)}); "
                     f"{hours} and ${speed['usd_per_billion_tokens']:,.0f} per billion tokens")
    if plan.get("run"):
        run = plan["run"]
        evaluation = run["evaluation"]
        lines.append(f"run             {run['steps']} steps: {run['training_s'] / 60:,.1f} min of training"
                     + (f" + {evaluation['seconds'] / 60:,.1f} min of evaluation ({evaluation['units']} lm-eval units "
                        f"of {', '.join(f'{t} {n}' for t, n in evaluation['examples_per_task'].items())} examples; "
                        f"{evaluation['assumptions']})" if evaluation else ", no evaluation")
                     + f" = {run['total_s'] / 3600:,.2f} h"
                     + (f", ${run['usd']:,.2f}" if run["usd"] is not None else ""))
    if not memory["fits"]:
        ways = [f"{w['change']} ({w['predicted_gib']:.1f} GiB)" for w in plan.get("fits_with", [])]
        lines.append("fits with       " + (", or ".join(ways) if ways else "nothing nearby: use GPUs with more memory"))
    return "\n".join(lines)


def _priced(plan: dict) -> str:
    """Whose list price the cost is, in a clause."""
    price, region = plan["price"], plan["region"]
    where = f"{plan['nodes']} x {plan['instance_type']} at {price['region']}'s On-Demand list price of {price['date']}"
    return where if price["region"] == region else f"{where}: the table has no {region} price for it"


def cluster_of(args: argparse.Namespace) -> tuple[str, int, str]:
    """The instance type, node count and price region to plan: the flags', else the stack file's
    (--stack), else the defaults."""
    from infra.config.rules import known_regions

    instance_type, nodes, region = DEFAULT_INSTANCE_TYPE, DEFAULT_NODES, PRICE_TABLE_REGION
    if args.stack:
        from infra.config import load_stack_config

        stack = load_stack_config(args.stack, PROJECT_DIR)
        instance_type, nodes, region = stack.gpu_instance_type, stack.gpu_node_count, stack.region
    if args.region is not None:
        if args.region not in known_regions():
            close = difflib.get_close_matches(args.region, sorted(known_regions()), n=1)
            raise ValueError(f"--region {args.region!r} is not an AWS region" +
                             (f"; did you mean {close[0]}?" if close else ""))
        region = args.region
    return args.instance_type or instance_type, nodes if args.nodes is None else args.nodes, region


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser().parse_args(argv)
        from infra.instance_types import INSTANCE_TYPES
        from workloads.client.fit import Target
        from workloads.client.overrides import given_keys, user_overrides
        from workloads.client.presets import choose_preset
        from workloads.train.config import preset, with_overrides

        instance_type, nodes, region = cluster_of(args)
        target = Target.instances(instance_type, nodes)
        kind = INSTANCE_TYPES[instance_type]
        choice = choose_preset(preset_name=args.preset, model_size=args.model_size, gpu_memory_gib=kind.gpu_memory_gib,
                               gpus=target.world_size, overrides=args.set, cluster=f"{nodes} x {instance_type}")
        why = choice.why
        if choice.name.startswith("qwen2.5-7b-lora") and not args.preset and choice.method_set is None \
                and "method" not in given_keys(args.set):
            from workloads.train.config import FULL_7B_MIN_RANKS_24GB

            needed = -(-FULL_7B_MIN_RANKS_24GB // kind.gpus)
            why += f" (--nodes {needed} plans the full fine-tune, qwen2.5-7b-24gb)"
        base = preset(choice.name)
        cfg = with_overrides(base, user_overrides(base.to_dict(), args.set))
        plan = make_plan(cfg, preset_name=choice.name, instance_type=instance_type, nodes=nodes, cwd=Path.cwd(),
                         size_micro_batch="micro_batch" not in given_keys(args.set), region=region,
                         preset_reason=why, method_set=choice.method_set)
    except (UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return EXIT_OK if plan["memory"]["fits"] else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main("plan", sys.argv[1:]))
