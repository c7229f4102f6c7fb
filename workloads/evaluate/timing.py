"""How long the evaluation adds to a run, for `plan`: from the tasks' sizes and the speed of greedy
generation in lm-eval's Hugging Face backend.

A unit (one model on one task) loads the model, prefills every prompt (compute-bound) and then
decodes `max_new_tokens` steps per batch of `batch_size` prompts. A decode step reads every weight
once, so it takes the weights' bytes over the GPU's memory bandwidth, and never less than the host's
time to launch a step's kernels through transformers' generate (DECODE_STEP_FLOOR_S). The units run
on the run's GPUs at once, as the stage spreads them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from workloads.train.evaluation_config import HELDOUT_TASK, EvaluateConfig

HBM_GBPS = {"L4": 300.0, "A10G": 600.0, "L40S": 864.0, "A100": 1555.0, "H100": 3350.0, "H200": 4800.0,
            "B200": 8000.0}
"""Memory bandwidth by GPU model, GB/s, by the datasheets."""

DECODE_BANDWIDTH_SHARE = 0.5
"""The share of the memory bandwidth a batched decode step reaches in eager PyTorch."""

DECODE_STEP_FLOOR_S = 0.025
"""The least one decode step of a 28-layer model takes through transformers' generate: the host
launching its kernels one by one (an estimate; docs/gpu/record.sh `evaluate` measures the real one)."""

PREFILL_MFU = 0.3
"""The share of the bf16 peak that prompt processing reaches at lm-eval's batch sizes."""

UNIT_OVERHEAD_S = 20.0
"""lm-eval's import, the task's dataset built from its files, the model read from the node's cache."""

PROMPT_TOKENS = 512
"""Tokens of a held-out prompt, for the estimate (a chat's context up to its last answer)."""

STANDARD_EXAMPLES = 1000
"""Examples of a standard task whose size is not known here, before evaluate.limit."""


@dataclass(frozen=True, kw_only=True)
class EvaluationEstimate:
    units: int
    examples_per_task: dict[str, int]
    unit_s: dict[str, float]
    seconds: float
    """Wall time of the stage: its units spread over the run's GPUs."""
    assumptions: str

    def to_dict(self) -> dict:
        return asdict(self)


def heldout_examples(cfg, *, cwd: Path) -> int:
    """How many held-out records the run will have: data.eval_fraction of its records (a local file's
    lines, else data.max_examples), at most evaluate.limit."""
    data = cfg.data
    records = data.max_examples
    path = Path(data.path).expanduser() if data.kind == "jsonl" and "://" not in data.path else None
    if path is not None:
        path = path if path.is_absolute() else cwd / path
        if path.is_file() and path.suffix != ".parquet":
            with path.open("rb") as f:
                lines = sum(1 for line in f if line.strip())
            records = min(records, lines) if records else lines
    held = max(1, round(records * data.eval_fraction)) if records and data.eval_fraction > 0 else 0
    return min(held, cfg.evaluate.limit) if cfg.evaluate.limit else held


def estimate(cfg, *, parameters: int, gpu: Optional[str], peak_flops: Optional[float], gpus: int,
             cwd: Path) -> Optional[EvaluationEstimate]:
    """The evaluation's wall time on `gpus` GPUs of model `gpu`; None when the run is not evaluated or
    the GPU's speed is not known."""
    settings: EvaluateConfig = cfg.evaluate
    tasks = [t for t in settings.task_list if t != HELDOUT_TASK or (cfg.data.kind != "synthetic"
                                                                     and cfg.data.eval_fraction > 0)]
    if not tasks or gpu not in HBM_GBPS or not peak_flops:
        return None
    weight_bytes = 2.0 * parameters  # bf16
    step_s = max(weight_bytes / (HBM_GBPS[gpu] * 1e9 * DECODE_BANDWIDTH_SHARE), DECODE_STEP_FLOOR_S)
    examples = {t: heldout_examples(cfg, cwd=cwd) if t == HELDOUT_TASK else
                (min(STANDARD_EXAMPLES, settings.limit) if settings.limit else STANDARD_EXAMPLES) for t in tasks}
    unit_s = {}
    for task, count in examples.items():
        scored_without_generation = task == HELDOUT_TASK and settings.metric == "loglikelihood"
        new_tokens = 0 if scored_without_generation else settings.max_new_tokens
        prefill = 2.0 * parameters * count * PROMPT_TOKENS / (peak_flops * PREFILL_MFU)
        decode = math.ceil(count / settings.batch_size) * new_tokens * step_s
        unit_s[task] = round(UNIT_OVERHEAD_S + prefill + decode, 1)
    roles = 3 if cfg.method == "lora" else 2  # tuned, base (+ base with the adapter)
    per_role = list(unit_s.values()) * roles
    lanes = [0.0] * max(1, gpus)  # longest first onto the least loaded GPU, as Ray fills free ones
    for seconds in sorted(per_role, reverse=True):
        lanes[lanes.index(min(lanes))] += seconds
    return EvaluationEstimate(units=len(per_role), examples_per_task=examples, unit_s=unit_s,
                              seconds=round(max(lanes), 1),
                              assumptions=f"decode step {step_s * 1000:.0f} ms, prompts of {PROMPT_TOKENS} tokens, "
                                          "the base not yet cached")
