"""One model on some tasks through EleutherAI's lm-evaluation-harness (`simple_evaluate`, its
Hugging Face backend), with nothing fetched from the network unless the task reads the hub.

A LoRA adapter is evaluated as lm-eval does it (`peft=`: the base loaded, the adapter applied on top);
a merged or full model as a plain folder.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from workloads.evaluate.compare import Score
from workloads.train.evaluation_config import EvaluateConfig


@dataclass(frozen=True, kw_only=True)
class ModelScores:
    scores: dict[str, dict[str, Score]]
    """task -> metric -> score."""
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)
    seconds: float = 0.0
    lm_eval_version: str = ""


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def _number(value) -> Optional[float]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def scores_of(results: dict) -> tuple[dict[str, dict[str, Score]], dict[str, dict[str, bool]]]:
    """lm-eval's results (`"exact_match,none": 0.5, "exact_match_stderr,none": 0.1`) as scores by task
    and metric (a filter other than "none" is kept in the metric's name: `exact_match,flexible-extract`)."""
    scores: dict[str, dict[str, Score]] = {}
    for task, values in results["results"].items():
        samples = int((results.get("n-samples") or {}).get(task, {}).get("effective") or 0)
        for key, value in values.items():
            name, _, filter_name = key.partition(",")
            if not filter_name or name.endswith("_stderr") or _number(value) is None:
                continue
            metric = name if filter_name == "none" else key
            stderr = _number(values.get(f"{name}_stderr,{filter_name}"))
            scores.setdefault(task, {})[metric] = Score(value=float(value), stderr=stderr, samples=samples)
    better = {task: {m: bool(v) for m, v in metrics.items()}
              for task, metrics in (results.get("higher_is_better") or {}).items()}
    return scores, better


def model_args(*, pretrained: Path | str, peft: Optional[Path], device: str, revision: str = "") -> dict:
    import torch

    args: dict = {"pretrained": str(pretrained),
                  "dtype": "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"}
    if revision:
        args["revision"] = revision
    if peft is not None:
        args["peft"] = str(peft)
    return args


def evaluate_model(*, pretrained: Path | str, tasks: list[str], settings: EvaluateConfig, device: str,
                   peft: Optional[Path] = None, include_path: Optional[Path] = None, revision: str = "",
                   manager=None) -> ModelScores:
    """Score one model (a folder or hub id; `peft`: an adapter folder on top) on `tasks` with lm-eval."""
    from lm_eval import simple_evaluate

    from workloads.evaluate.tasks import task_manager

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    started = time.monotonic()
    results = simple_evaluate(
        model="hf", model_args=model_args(pretrained=pretrained, peft=peft, device=device, revision=revision),
        tasks=list(tasks), batch_size=settings.batch_size, device=device, limit=settings.limit or None,
        num_fewshot=None if settings.num_fewshot < 0 else settings.num_fewshot,
        apply_chat_template=settings.apply_chat_template, task_manager=manager or task_manager(include_path),
        log_samples=False, bootstrap_iters=1000, verbosity="ERROR")
    scores, better = scores_of(results)
    return ModelScores(scores=scores, higher_is_better=better, seconds=time.monotonic() - started,
                       lm_eval_version=lm_eval_version())
