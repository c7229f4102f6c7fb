"""`python -m workloads.bench.dpo_record BENCH_DIR... --out FILE`: the DPO record's figures
(docs/gpu/record.sh dpo) from its benchmark runs' bench.json files, as one JSON.

For each run folder (a model and method): the loop's and TRL's tokens/s per GPU, MFU, peak memory
and losses, the pairs each trains per step, the ratio of the loop's tokens/s to TRL's, whether the
loop's peak is at or under TRL's, and the memory model's predicted peak against the loop's
measured one. A run that ran out of memory, or never ended, is recorded as such.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from workloads.bench.settings import PAIRS_SUFFIX, TRL_DPO, TUNED

TARGET_RATIO = 1.3
"""The loop's tokens/s over TRL's that the record is held to, at equal or lower peak memory."""


def _run(document: dict, strategy: str) -> tuple[Optional[dict], Optional[dict]]:
    """(its figures, its run) for the strategy's first run in a bench.json."""
    figures = next((f for f in document.get("figures", []) if f["strategy"] == strategy), None)
    run = next((r for r in document.get("runs", []) if r["strategy"] == strategy), None)
    return figures, run


def _summary(run: Optional[dict]) -> dict:
    reported = (run or {}).get("loop_metrics") or []
    return (reported[-1] if reported else {}).get("summary", {})


def case(folder: Path) -> dict:
    """One bench folder's figures."""
    path = folder / "bench.json"
    if not path.is_file():
        return {"folder": str(folder), "status": "no bench.json: the run did not start or was killed first"}
    document = json.loads(path.read_text())
    settings = document.get("settings", {})
    out: dict = {"folder": str(folder), "preset": settings.get("preset"), "overrides": settings.get("overrides"),
                 "pairs_data": document.get("pairs"), "environment": document.get("environment")}
    for label, strategy in (("loop", TUNED + PAIRS_SUFFIX), ("trl", TRL_DPO + PAIRS_SUFFIX)):
        figures, run = _run(document, strategy)
        if figures is None:
            out[label] = {"status": "did not end (killed by the time limit, or failed: see its log)"}
            continue
        summary = _summary(run)
        entry = {key: figures.get(key) for key in ("status", "micro_batch", "tokens_per_s_per_gpu", "mfu_vs_peak",
                                                   "peak_mem_gib", "step_s_median", "first_loss", "final_loss")}
        if label == "loop":
            data = summary.get("data", {})
            rows = summary.get("rows_per_step")
            entry.update(rows_per_step=rows, pairs_per_row=data.get("pairs_per_row"),
                         pairs_per_step=round(rows * data["pairs_per_row"], 1) if rows and data.get("pairs_per_row")
                         else None, reference=summary.get("reference"), method=summary.get("method"),
                         activation_checkpointing=summary.get("activation_checkpointing"),
                         example_tokens_per_step=summary.get("example_tokens_per_step"))
            memory_model = (document.get("memory_model") or {}).get(f"{strategy}-mb{figures['micro_batch']}")
            entry["memory_model_peak_gib"] = memory_model
            if memory_model and figures.get("peak_mem_gib"):
                entry["measured_over_predicted"] = round(figures["peak_mem_gib"] / memory_model, 3)
        else:
            entry.update({key: summary.get(key) for key in ("pairs_per_step", "pairs_per_micro_batch",
                                                            "grad_accum_steps", "liger", "activation_checkpointing",
                                                            "example_tokens_per_step")})
        out[label] = entry
    loop, trl = out["loop"], out["trl"]
    if loop.get("tokens_per_s_per_gpu") and trl.get("tokens_per_s_per_gpu"):
        ratio = loop["tokens_per_s_per_gpu"] / trl["tokens_per_s_per_gpu"]
        memory_ok = (loop.get("peak_mem_gib") is not None and trl.get("peak_mem_gib") is not None
                     and loop["peak_mem_gib"] <= trl["peak_mem_gib"])
        out.update(ratio=round(ratio, 3), loop_memory_at_or_under_trl=memory_ok,
                   target_met=ratio >= TARGET_RATIO and memory_ok)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.dpo_record", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="bench output folders (bench.json)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    record = {"target_ratio": TARGET_RATIO, "cases": [case(folder) for folder in args.folders]}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for entry in record["cases"]:
        loop, trl = entry.get("loop", {}), entry.get("trl", {})
        print(f"{entry.get('preset')}: loop {loop.get('tokens_per_s_per_gpu')} tokens/s at {loop.get('peak_mem_gib')} "
              f"GiB (memory model {loop.get('memory_model_peak_gib')}), TRL {trl.get('tokens_per_s_per_gpu')} at "
              f"{trl.get('peak_mem_gib')} GiB: ratio {entry.get('ratio')}, target met {entry.get('target_met')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
