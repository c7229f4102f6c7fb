"""`python -m workloads.bench.perf_record OUT`: the figures of a performance record (`docs/gpu/record.sh
perf3 OUT`) in one JSON, each measured peak beside the memory model's prediction, and the targets.

OUT holds one folder per benchmark call (each with its bench.json). For every run of the loop the
prediction is the memory model's for the config the benchmark built (its preset, `--set` overrides
and micro-batch at its world size, with the loss the run used); the Trainer runs have no prediction
(the model is of the loop). The targets compare with Unsloth's figures measured on the same GPU
kind (docs/PERFORMANCE.md): the bar they must clear is 1.25 times them.

Writes OUT/perf.json and prints its table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

UNSLOTH = {
    "H100": {"lora_checkpointed": 9_398, "lora": 13_973},
    "H200": {"lora_checkpointed": 9_907, "lora": 15_169},
}
"""Unsloth 2026.10.9's tokens/s on the 7B LoRA r16 chats (docs/PERFORMANCE.md, ../shared/DESIGN.md):
its offloaded checkpointing, and its best without checkpointing (padded batches)."""
UNSLOTH_CHECKPOINTED_PEAK_GIB = 18.5
BAR = 1.25
FULL_1_5B_MFU = 0.58


def gpu_kind(device: str) -> Optional[str]:
    return next((kind for kind in UNSLOTH if kind in device), None)


def predicted_gib(bench: dict, run: dict) -> Optional[float]:
    """The memory model's peak for a loop run of this bench.json (None for a peer's run)."""
    if not run["strategy"].startswith("tuned"):
        return None
    from workloads.sizing.memory import Architecture, predict, settings_for
    from workloads.bench.settings import PLACEHOLDER_CHATS, BenchSettings, chat_data, preset_config
    from workloads.model_io.architectures import named_architecture

    import dataclasses

    s = bench["settings"]
    settings = BenchSettings(preset=s["preset"], overrides=tuple(s["overrides"]), data=tuple(s["data"]),
                             micro_batches=tuple(s["micro_batches"]), steps=s["steps"], warmup=s["warmup"],
                             allow_cpu=s["allow_cpu"], strategies=tuple(s["strategies"]))
    chats = run["strategy"].endswith("-chats")
    cfg = preset_config(settings, data=chat_data(*PLACEHOLDER_CHATS) if chats else None)
    cfg = dataclasses.replace(cfg, micro_batch=run["micro_batch"], seq_len=s["seq_len"])
    summary = next((m["summary"] for m in run.get("loop_metrics", []) if "summary" in m), {})
    loss = {"liger": "liger", "chunked": "chunked"}.get(summary.get("loss_implementation"), None)
    world = bench["environment"]["world_size"]
    arch = Architecture.from_config(named_architecture(cfg.model.name_or_path))
    return round(predict(arch, settings_for(cfg.for_world_size(world), shard_ranks=world, loss=loss)).peak_gib, 2)


@dataclass(frozen=True, kw_only=True)
class Target:
    label: str
    measured: Optional[float]
    bar: Optional[float]
    at_most: bool = False

    @property
    def met(self) -> Optional[bool]:
        if self.measured is None or self.bar is None:
            return None
        return self.measured <= self.bar if self.at_most else self.measured >= self.bar

    def as_dict(self) -> dict:
        rounded = None if self.measured is None else round(self.measured, 3)
        return {"target": self.label, "measured": rounded, "bar": self.bar, "met": self.met}


def collect(out: Path) -> dict:
    """Every run of every bench.json under OUT, with its prediction, and the targets."""
    runs, comparisons, device = [], [], ""
    for path in sorted(out.glob("*/bench.json")):
        bench = json.loads(path.read_text())
        device = device or bench["environment"]["device"]
        figures = {(f["strategy"], f["micro_batch"]): f for f in bench["figures"]}
        for run in bench["runs"]:
            f = figures[(run["strategy"], run["micro_batch"])]
            runs.append({"call": path.parent.name, "strategy": run["strategy"], "micro_batch": run["micro_batch"],
                         "status": run["status"], "tokens_per_s": f.get("tokens_per_s_per_gpu"),
                         "mfu": f.get("mfu_vs_peak"), "step_s": f.get("step_s_median"),
                         "peak_gib": run.get("peak_mem_gib"), "predicted_gib": predicted_gib(bench, run),
                         "loss_first": f.get("first_loss"), "loss_last": f.get("final_loss"),
                         "profile": run.get("profile"), "error": run.get("error")})
        comparisons += [{"call": path.parent.name, **c} for c in bench["comparisons"]]
    return {"device": device, "runs": runs, "comparisons": comparisons,
            "targets": [t.as_dict() for t in targets(runs, device=device)]}


def _run(runs: Sequence[dict], call: str, strategy: str = "tuned-chats") -> Optional[dict]:
    return next((r for r in runs if r["call"] == call and r["strategy"] == strategy and r["status"] == "ok"), None)


def targets(runs: Sequence[dict], *, device: str) -> list[Target]:
    unsloth = UNSLOTH.get(gpu_kind(device) or "", {})
    offloaded, plain, full = _run(runs, "7b-lora-offload"), _run(runs, "7b-lora"), _run(runs, "1.5b-full")
    hf_ac, hf_plain = _run(runs, "7b-lora-ac", "hf-trainer-chats"), _run(runs, "7b-lora", "hf-trainer-chats")
    checkpointed = _run(runs, "7b-lora-ac")

    def value(run, key):
        return None if run is None else run[key]

    def ratio(a, b):
        return None if a is None or b is None else round(a["tokens_per_s"] / b["tokens_per_s"], 3)

    bar_ac = unsloth.get("lora_checkpointed")
    bar_plain = unsloth.get("lora")
    return [
        Target(label="7B LoRA r16, checkpointed and offloaded, peak GiB <= Unsloth's offloaded checkpointing",
               measured=value(offloaded, "peak_gib"), bar=UNSLOTH_CHECKPOINTED_PEAK_GIB, at_most=True),
        Target(label=f"7B LoRA r16, checkpointed and offloaded, tokens/s >= {BAR} x Unsloth's",
               measured=value(offloaded, "tokens_per_s"), bar=None if bar_ac is None else BAR * bar_ac),
        Target(label=f"7B LoRA r16 without checkpointing, tokens/s >= {BAR} x Unsloth's best",
               measured=value(plain, "tokens_per_s"), bar=None if bar_plain is None else BAR * bar_plain),
        Target(label=f"1.5B full fine-tune (fp32 master weights) MFU >= {FULL_1_5B_MFU:.0%}",
               measured=value(full, "mfu"), bar=FULL_1_5B_MFU),
        Target(label="7B LoRA checkpointed: the loop over Trainer + peft, same call",
               measured=ratio(checkpointed, hf_ac), bar=1.0),
        Target(label="7B LoRA checkpointed and offloaded over checkpointed alone, tokens/s (overlap: near 1)",
               measured=ratio(offloaded, checkpointed), bar=0.95),
        Target(label="7B LoRA without checkpointing: the loop over Trainer + peft, same call",
               measured=ratio(plain, hf_plain), bar=1.0),
    ]


def table(record: dict) -> str:
    lines = [f"device: {record['device'] or '?'}",
             f"{'call':<18} {'strategy':<22} {'mb':>3} {'status':<6} {'tok/s':>9} {'MFU':>6} {'peak GiB':>9} "
             f"{'model GiB':>9}"]
    for r in record["runs"]:
        cells = [f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-",
                 f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                 f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-",
                 f"{r['predicted_gib']:.2f}" if r["predicted_gib"] is not None else "-"]
        lines.append(f"{r['call']:<18} {r['strategy']:<22} {r['micro_batch']:>3} {r['status']:<6} {cells[0]:>9} "
                     f"{cells[1]:>6} {cells[2]:>9} {cells[3]:>9}")
    lines.append("")
    for t in record["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"{verdict:<13} {t['target']}: {t['measured']} (bar {t['bar']})")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.perf_record", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the record's folder (one subfolder per benchmark call)")
    args = parser.parse_args(argv)
    if not any(args.out.glob("*/bench.json")):
        print(f"perf_record: error: no */bench.json under {args.out}", file=sys.stderr)
        return 2
    record = collect(args.out)
    (args.out / "perf.json").write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
