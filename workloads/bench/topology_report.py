"""The topology benchmark's document: figures per run, comparisons, the step-time model's
predictions against the outcomes, and the targets, from the phases' raw records. Pure functions."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Optional

from workloads.sizing.step_time import (
    BF16_BYTES,
    FP32_BYTES,
    Hardware,
    Link,
    ModelShape,
    Strategy,
    cluster_strategies,
    g6_12xlarge_pair,
    model_shape,
    predict_step,
)

EMULATED, ONE_HOST = "emulated", "one-host"
LOSS_RTOL = 1e-3
"""bf16 between nodes against fp32 between nodes, the loss at every step: tests/test_loop_topology.py
measures 0.023% on CPU and bounds it at 0.1%."""
MODEL_RTOL = 0.2
NVLINK_FLOOR = 52_000
"""tokens/s/GPU at micro-batch 16 on one host over NVLink that the default must keep (the tuned
loop ran 52,896 on 2026-11-30)."""


def _summary(run: dict) -> dict:
    for item in run.get("loop_metrics", []):
        if "summary" in item:
            return item["summary"]
    return {}


def _peak_flops(run: dict) -> Optional[float]:
    """The peak a run's MFU is against: its config's, else the one its loop found for its GPU."""
    return run["config"].get("peak_flops") or _summary(run).get("peak_flops")


def run_figures(run: dict, *, phase: str, warmup: int, steps: int, ranks_per_gpu: int) -> dict:
    """Step time (median of the steps after warmup, the profiled last step left out) and rates."""
    figures = {"label": run["strategy"], "phase": phase, "status": run["status"], "error": run.get("error"),
               "grad_accum_steps": run["grad_accum_steps"], "micro_batch": run["micro_batch"]}
    if run["status"] != "ok":
        return figures
    timed = [s for step, s in run["step_seconds"].items() if warmup < int(step) < steps]
    summary = _summary(run)
    peak = _peak_flops(run)
    step_s = statistics.median(timed)
    per_rank = run["tokens_per_step_per_gpu"] / step_s
    per_gpu = per_rank * (ranks_per_gpu if phase == EMULATED else 1)
    losses = {int(k): v for k, v in run["losses"].items()}
    figures.update(
        timed_steps=len(timed),
        step_s=step_s,
        tokens_per_s_per_rank=per_rank,
        tokens_per_s_per_gpu=per_gpu,
        mfu=per_gpu * summary.get("flops_per_token", 0.0) / peak if peak else None,
        parallelism=summary.get("parallelism"),
        loss_implementation=summary.get("loss_implementation"),
        peak_mem_gib=run.get("peak_mem_gib"),
        losses=[losses[s] for s in sorted(losses)],
        communication=run.get("communication"),
    )
    return figures


def _rate(figures: dict[str, dict], label: str) -> Optional[float]:
    return figures.get(label, {}).get("tokens_per_s_per_gpu")


def baseline_name(layout: dict) -> str:
    if layout["gpus"] == 0:
        return "one host (gloo on CPU)"
    if layout["shared"]:
        return "one host (one rank alone on the shared GPU, no communication; no NVLink baseline on one GPU)"
    return "one host over NVLink"


def comparisons(figures: dict[str, dict], *, tokens_per_step: dict[str, int], layout: dict) -> list[dict]:
    one_host = baseline_name(layout)
    pairs = [
        ("auto", "flat", "HSDP with bf16 between hosts (the default) vs flat FSDP (today's loop)"),
        ("hsdp-fp32", "flat", "HSDP with fp32 between hosts vs flat FSDP (today's loop)"),
        ("auto-k1", "flat-k1", "the default vs flat FSDP (today's loop), no accumulation"),
        ("auto", "one-host", f"the default on 2 emulated hosts vs {one_host}"),
        ("auto-k1", "one-host-k1", f"the default on 2 emulated hosts vs {one_host}, no accumulation"),
        ("flat-k1", "one-host-k1", f"flat FSDP on 2 emulated hosts vs {one_host}, no accumulation"),
    ]
    result = []
    for candidate, baseline, text in pairs:
        a, b = _rate(figures, candidate), _rate(figures, baseline)
        if a is None or b is None:
            continue
        tokens = tokens_per_step.get(candidate)
        result.append({
            "label": f"{candidate} vs {baseline.replace('-', ' ')}: {text}, {tokens:,} tokens per optimizer step",
            "candidate": candidate, "baseline": baseline, "ratio": a / b, "tokens_per_optimizer_step": tokens,
        })
    return result


def _link(rows: list[dict]) -> Optional[Link]:
    points = sorted({(r["size_bytes"], r["busbw_gbps"]) for r in rows if r["busbw_gbps"] > 0})
    return Link(points=tuple(points)) if points else None


def _strategy(figures: dict, run: dict, *, seq_len: int) -> Strategy:
    config = run["config"]
    kind = (figures.get("parallelism") or {}).get("kind", "fsdp")
    bf16 = config["mixed_precision"] and config["cross_node_reduce_dtype"] == "bfloat16"
    return Strategy(label=figures["label"], kind=kind, micro_batch=run["micro_batch"], seq_len=seq_len,
                    grad_accum_steps=run["grad_accum_steps"], reshard_after_forward=config["reshard_after_forward"],
                    cross_node_bytes=BF16_BYTES if bf16 else FP32_BYTES)


def predictions(phases: dict, figures: dict[str, dict], *, layout: dict, spec: dict,
                shape: ModelShape, peak_flops: float) -> tuple[list[dict], Optional[float], Optional[str]]:
    """The model's step time for every run, from the measured bandwidths and the one-host MFU
    (counted with the model's own FLOPs per token, so the calibration run predicts itself)."""
    rates = {label: figures.get(label, {}).get("tokens_per_s_per_gpu") for label in ("one-host-k1", "one-host")}
    calibration = next((label for label, rate in rates.items() if rate), None)
    if calibration is None:
        return [], None, None
    mfu = rates[calibration] * shape.flops_per_token / peak_flops
    between = _link(phases.get(EMULATED, {}).get("bandwidth", []))
    within = _link(phases.get(ONE_HOST, {}).get("bandwidth", []))
    per_host, ranks_per_gpu = layout["gpus_per_host"], 2 if layout["shared"] else 1
    one_host_ranks = 1 if layout["shared"] else 2 * per_host
    hardware = {
        EMULATED: Hardware(nodes=2, gpus_per_node=per_host, peak_flops=peak_flops, mfu=mfu,
                           intra=within if per_host > 1 else None, inter=between, ranks_per_gpu=ranks_per_gpu),
        ONE_HOST: Hardware(nodes=1, gpus_per_node=one_host_ranks, peak_flops=peak_flops, mfu=mfu,
                           intra=within if one_host_ranks > 1 else None),
    }
    rows = []
    for phase, record in phases.items():
        for run in record["runs"]:
            f = figures.get(run["strategy"], {})
            if not f.get("step_s") or (phase == EMULATED and between is None):
                continue
            p = predict_step(hardware[phase], shape, _strategy(f, run, seq_len=spec["seq_len"]))
            measured_exposed = (f.get("communication") or {}).get("exposed_s")
            rows.append({
                "label": f["label"], "phase": phase, "predicted_step_s": p.step_s, "measured_step_s": f["step_s"],
                "error": p.step_s / f["step_s"] - 1, "predicted_exposed_comm_s": p.exposed_comm_s,
                "measured_exposed_comm_s": measured_exposed, "predicted_compute_s": p.compute_s,
                "calibration": f["label"] == calibration,
            })
    return rows, mfu, calibration


def _loss_gap(figures: dict[str, dict], candidate: str, baseline: str) -> Optional[float]:
    a, b = figures.get(candidate, {}).get("losses"), figures.get(baseline, {}).get("losses")
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def targets(figures: dict[str, dict], comps: list[dict], preds: list[dict], *, layout: dict, spec: dict) -> list[dict]:
    ratio = {(c["candidate"], c["baseline"]): c["ratio"] for c in comps}
    comparable = layout["gpus"] >= 2
    rows = []

    def add(target: str, value: Optional[float], met: Optional[bool], note: str = "") -> None:
        rows.append({"target": target, "value": value, "met": met, "note": note})

    vs_one = ratio.get(("auto", "one-host"))
    add("the default on 2 emulated hosts >= 85% of one host (same tokens per optimizer step)", vs_one,
        None if vs_one is None or not comparable else vs_one >= 0.85,
        "" if comparable else "not comparable: no NVLink baseline on this machine")
    vs_flat = ratio.get(("auto", "flat"))
    add("the default >= 1.9x flat FSDP (same tokens per optimizer step)", vs_flat,
        None if vs_flat is None else vs_flat >= 1.9)
    gap = _loss_gap(figures, "auto", "flat")
    add(f"loss curve of the default within {LOSS_RTOL:.1%} of flat FSDP's at every step", gap,
        None if gap is None else gap <= LOSS_RTOL)
    nvlink = _rate(figures, "one-host-k1")
    applies = comparable and spec["micro_batch"] == 16 and spec["preset"] == "qwen2.5-1.5b-synthetic"
    add(f"one host over NVLink >= {NVLINK_FLOOR:,} tokens/s/GPU at micro-batch 16", nvlink,
        None if nvlink is None or not applies else nvlink >= NVLINK_FLOOR,
        "" if applies else "needs two GPUs, micro-batch 16 and the qwen2.5-1.5b preset")
    emulated = [p for p in preds if p["phase"] == EMULATED]
    worst = max((abs(p["error"]) for p in emulated), default=None)
    add(f"step-time model within {MODEL_RTOL:.0%} of the emulated outcomes", worst,
        None if worst is None else worst <= MODEL_RTOL)
    return rows


def build_document(*, spec: dict, layout: dict, limits: list[str], phases: dict, exits: dict, transport: dict,
                   wall_s: float) -> dict:
    ranks_per_gpu = 2 if layout["shared"] else 1
    figures: dict[str, dict] = {}
    for phase, record in phases.items():
        for run in record["runs"]:
            figures[run["strategy"]] = run_figures(run, phase=phase, warmup=spec["warmup"], steps=spec["steps"],
                                                   ranks_per_gpu=ranks_per_gpu)
    ranks = {EMULATED: 2 * layout["gpus_per_host"], ONE_HOST: 1 if layout["shared"] else 2 * layout["gpus_per_host"]}
    tokens_per_step = {
        run["strategy"]: ranks[phase] * run["micro_batch"] * run["grad_accum_steps"] * spec["seq_len"]
        for phase, record in phases.items() for run in record["runs"]
    }
    comps = comparisons(figures, tokens_per_step=tokens_per_step, layout=layout)
    first = next((run for record in phases.values() for run in record["runs"]), None)
    preds, mfu, calibration, cluster = [], None, None, []
    if first is not None and _peak_flops(first):
        shape = model_shape(first["config"]["model"]["name_or_path"], seq_len=spec["seq_len"])
        preds, mfu, calibration = predictions(phases, figures, layout=layout, spec=spec, shape=shape,
                                              peak_flops=_peak_flops(first))
        if mfu is not None and layout["gpus"] > 0:
            hw = g6_12xlarge_pair(mfu=mfu)
            cluster = [asdict(predict_step(hw, shape, s)) for s in cluster_strategies(seq_len=spec["seq_len"])]
    settings = {k: v for k, v in spec.items() if k != "runs"}
    settings.update(emulated_hosts=2, gpus_per_host=layout["gpus_per_host"], machine_gpus=layout["gpus"],
                    ranks_per_gpu=ranks_per_gpu, one_host_ranks=ranks[ONE_HOST],
                    runs={phase: [r["label"] for r in runs] for phase, runs in spec["runs"].items()})
    environment = next((record["environment"] for record in phases.values()), {})
    return {
        "settings": settings,
        "environment": environment,
        "limits": limits,
        "exit_codes": exits,
        "wall_s": wall_s,
        "transport_between_emulated_hosts": transport,
        "bandwidth": {phase: record.get("bandwidth", []) for phase, record in phases.items()},
        "figures": list(figures.values()),
        "comparisons": comps,
        "model": {"mfu": mfu, "calibrated_on": calibration, "predictions": preds},
        "targets": targets(figures, comps, preds, layout=layout, spec=spec),
        "g6_12xlarge_pair_predictions": cluster,
        "runs": {phase: record["runs"] for phase, record in phases.items()},
    }


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def format_document(doc: dict) -> str:
    s = doc["settings"]
    lines = [
        f"{s['emulated_hosts']} emulated hosts x {s['gpus_per_host']} GPU(s) ({s['machine_gpus']} GPU(s) on the "
        f"machine, {s['ranks_per_gpu']} rank(s) per GPU); one host: {s['one_host_ranks']} rank(s); "
        f"preset {s['preset']}, micro-batch {s['micro_batch']}, seq {s['seq_len']}, {s['steps']} steps "
        f"({s['warmup']} warm-up, the last profiled)",
    ]
    lines += [f"limit: {text}" for text in doc["limits"]]
    for phase, rows in doc["bandwidth"].items():
        cells = ", ".join(f"{r['size_bytes'] / 2**20:,.0f} MiB {r['busbw_gbps']:.2f}" for r in rows)
        lines.append(f"all-reduce busbw GB/s, {phase}: {cells}")
    lines.append(f"NCCL connections between the emulated hosts: {doc['transport_between_emulated_hosts']}")
    lines.append("")
    header = ("run", "kind", "K", "status", "step s", "tok/s/GPU", "MFU", "exposed comm s", "comm s", "loss first",
              "loss last")
    rows = [header]
    for f in doc["figures"]:
        comm = f.get("communication") or {}
        losses = f.get("losses") or [None]
        rows.append((f["label"], (f.get("parallelism") or {}).get("kind", "-"), str(f["grad_accum_steps"]), f["status"],
                     _fmt(f.get("step_s"), ".3f"), _fmt(f.get("tokens_per_s_per_gpu"), ",.0f"),
                     _fmt(f.get("mfu"), ".1%"), _fmt(comm.get("exposed_s"), ".3f"), _fmt(comm.get("comm_s"), ".3f"),
                     _fmt(losses[0], ".4f"), _fmt(losses[-1], ".4f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    lines += [f"{c['ratio']:.3f}x  {c['label']}" for c in doc["comparisons"]]
    model = doc["model"]
    if model["predictions"]:
        lines.append("")
        lines.append(f"step-time model (MFU {model['mfu']:.3f} from {model['calibrated_on']}, measured bandwidths):")
        for p in model["predictions"]:
            lines.append(f"  {p['label']:<12} predicted {p['predicted_step_s']:.3f} s, measured "
                         f"{p['measured_step_s']:.3f} s ({p['error']:+.0%}); exposed comm predicted "
                         f"{p['predicted_exposed_comm_s']:.3f} s, "
                         f"profiled {_fmt(p['measured_exposed_comm_s'], '.3f')} s"
                         f"{' (calibration run)' if p['calibration'] else ''}")
    lines.append("")
    for t in doc["targets"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        note = f"  ({t['note']})" if t["note"] else ""
        lines.append(f"[{verdict}] {t['target']}: {_fmt(t['value'], '.3f')}{note}")
    if doc["g6_12xlarge_pair_predictions"]:
        lines.append("")
        lines.append("predicted on 2x g6.12xlarge (this run's MFU, 5 GB/s network per node, 32 GB/s PCIe):")
        for p in doc["g6_12xlarge_pair_predictions"]:
            lines.append(f"  {p['label']:<34} {p['tokens_per_s_per_gpu']:>8,.0f} tok/s/GPU  "
                         f"${p['usd_per_billion_tokens']:,.0f} per 1e9 tokens")
    return "\n".join(lines)
