"""The evaluation stage against lm-eval run alone, on the same model, records and GPU.

    python -m workloads.bench.evaluate_peer --model DIR --base DIR --chats FILE --records N --out DIR
        [--batch-size 16] [--max-new-tokens 64] [--device cuda]

Ours: `python -m workloads evaluate MODEL --base BASE` (the stage's units, as each GPU worker of a
job runs them: the held-out task built from the run's records, the base's cache looked up, lm-eval's
`simple_evaluate` with its Hugging Face backend), one process, timed end to end, twice: the second
finds the base's scores in the cache, as the next run on the same base does. The peer: lm-eval's own
CLI (`python -m lm_eval --model hf ...`) on the same task folder, once per model, each process timed
end to end, at the same batch size and dtype. Both read only local files (HF_HUB_OFFLINE,
HF_DATASETS_OFFLINE). Writes figures.json (every time, score and the generation speed) and each
command's log under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def timed(argv: list[str], *, log: Path) -> tuple[float, int]:
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}).returncode
    seconds = time.monotonic() - started
    print(f"[evaluate-peer] {' '.join(argv[:4])} ... exit {code} in {seconds:.1f} s (log {log})", flush=True)
    return seconds, code


def train_overrides(args: argparse.Namespace, cache: Path) -> list[str]:
    """The run's config as the stage reads it: the chats, a held-out share that gives --records of them."""
    lines = sum(1 for line in args.chats.open() if line.strip())
    fraction = min(0.5, args.records / lines)
    return ["data.kind=jsonl", f"data.path={args.chats.resolve()}", f"data.eval_fraction={fraction}",
            "evaluate.tasks=heldout", f"evaluate.limit={args.records}", f"evaluate.batch_size={args.batch_size}",
            f"evaluate.max_new_tokens={args.max_new_tokens}", f"evaluate.cache={cache}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.evaluate_peer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the tuned model folder")
    parser.add_argument("--base", type=Path, required=True, help="the base model folder")
    parser.add_argument("--chats", type=Path, required=True, help="the run's chat JSONL")
    parser.add_argument("--records", type=int, default=300, help="held-out records to evaluate")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sets = train_overrides(args, args.out / "evaluation-cache")
    figures: dict = {"records": args.records, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                     "device": args.device}
    if args.device.startswith("cuda"):
        import torch

        figures["gpu"] = torch.cuda.get_device_name(0)

    ours = [sys.executable, "-m", "workloads", "evaluate", str(args.model), "--base", str(args.base), "--device",
            args.device, "--json", "--runs-dir", str(args.out), "--out", str(args.out / "ours")]
    for s in sets:
        ours += ["--set", s]
    for name in ("ours-first", "ours-cached"):
        seconds, code = timed(ours, log=args.out / f"{name}.log")
        text = (args.out / f"{name}.log").read_text()
        record = json.loads(text[text.index("{\n"):text.rindex("\n}") + 2]) if code == 0 else {}
        figures[name] = {"seconds": round(seconds, 1), "exit": code,
                         "units": record.get("units"), "rows": record.get("rows")}

    # The same task folder for the peer, built as the stage builds it.
    from workloads.evaluate.tasks import build_heldout_task
    from workloads.train.config import TrainConfig, with_overrides

    train = with_overrides(TrainConfig(), [f"model.name_or_path={args.model}", *sets]).to_dict()
    task = build_heldout_task(train, args.out / "task", tokenizer_folder=args.model)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for name, model in (("peer-tuned", args.model), ("peer-base", args.base)):
        seconds, code = timed([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                               f"pretrained={model},dtype={dtype}", "--include_path", str(task), "--tasks", "heldout",
                               "--batch_size", str(args.batch_size), "--device", args.device, "--limit",
                               str(args.records), "--output_path", str(args.out / name)],
                              log=args.out / f"{name}.log")
        results = sorted((args.out / name).rglob("results_*.json"))
        scores = json.loads(results[-1].read_text()) if results else {}
        figures[name] = {"seconds": round(seconds, 1), "exit": code,
                         "evaluation_s": float(scores.get("total_evaluation_time_seconds") or 0) or None,
                         "results": (scores.get("results") or {}).get("heldout")}
    first = figures["ours-first"]
    units = {u["role"]: u["seconds"] for u in first.get("units") or []}
    peer = figures["peer-tuned"]["seconds"] + figures["peer-base"]["seconds"]
    tokens = args.records * args.max_new_tokens
    figures["summary"] = {
        "ours_two_models_s": first["seconds"], "peer_two_models_s": round(peer, 1),
        "ours_over_peer": round(first["seconds"] / peer, 3) if peer else None,
        "ours_cached_base_s": figures["ours-cached"]["seconds"],
        "ours_tuned_unit_s": units.get("tuned"), "peer_tuned_harness_s": figures["peer-tuned"]["evaluation_s"],
        "generation_tokens_per_s_tuned_unit": round(tokens / units["tuned"], 1) if units.get("tuned") else None,
        "same_score": (first.get("rows") or [{}])[0].get("tuned") == ((figures["peer-tuned"]["results"] or {})
                                                                       .get("exact_match,none")),
    }
    (args.out / "figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print("[evaluate-peer] " + json.dumps(figures["summary"], sort_keys=True), flush=True)
    return 0 if first["exit"] == 0 and figures["peer-tuned"]["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
