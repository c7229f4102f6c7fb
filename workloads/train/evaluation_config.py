"""The `evaluate` section of a run's config and the gate's rules: plain data, validated at
construction, with nothing heavier than the standard library imported (the config module imports it).

    --set evaluate.tasks=heldout,gsm8k --set evaluate.metric=rougeL
    --set evaluate.gate='heldout:exact_match>=base-0.01,gsm8k:exact_match>=base'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXIT_GATE_FAILED = 5
"""The exit code of a run (`submit`, `run --local`) or `evaluate` whose tuned model missed its gate:
trained and checkpointed, not made the run's model."""

HELDOUT_TASK = "heldout"
"""The run's own task: the records it held out (data.eval_fraction), asked as training showed them."""

HELDOUT_METRICS = ("exact_match", "rougeL", "loglikelihood")
"""What the held-out task can score: the generated answer equal to the record's (after stripping
whitespace), its ROUGE-L F1 against the record's, or the record's answer's log-likelihood per token
under the model (no generation)."""


@dataclass(frozen=True, kw_only=True)
class GateRule:
    """`TASK:METRIC>=base-0.01`: the tuned model's METRIC on TASK must be at least the base's less
    0.01 (`<=` for a metric where lower is better; a plain number instead of `base...` is an absolute
    floor or ceiling)."""

    task: str
    metric: str
    op: str
    """">=" or "<="."""
    relative: bool
    """The bound is the base's score plus `offset`; else `offset` alone."""
    offset: float
    text: str
    """The rule as the user wrote it."""

    def bound(self, base: float | None) -> float:
        assert not self.relative or base is not None, "a relative rule needs the base's score"
        return (base if self.relative else 0.0) + self.offset

    def passes(self, tuned: float, base: float | None) -> bool:
        limit = self.bound(base)
        return tuned >= limit if self.op == ">=" else tuned <= limit


_RULE = re.compile(r"^\s*(?P<task>[^:\s]+)\s*:\s*(?P<metric>[^<>=\s]+)\s*(?P<op>>=|<=)\s*"
                   r"(?:(?P<base>base)\s*(?:(?P<sign>[+-])\s*(?P<delta>\d+(?:\.\d*)?(?:e-?\d+)?))?"
                   r"|(?P<number>-?\d+(?:\.\d*)?(?:e-?\d+)?))\s*$")


def parse_gate(text: str) -> tuple[GateRule, ...]:
    """The rules of `evaluate.gate` (comma-separated); ValueError naming the one that does not parse."""
    rules = []
    # Commas separate rules, and lm-eval names a filtered metric with one (exact_match,strict-match):
    # a rule starts where a comma is followed by TASK:.
    for part in (p for p in re.split(r",(?=\s*[^,:<>=\s]+\s*:)", text) if p.strip()):
        match = _RULE.match(part)
        if match is None:
            raise ValueError(f"evaluate.gate rule {part.strip()!r} does not parse: write TASK:METRIC>=base-0.01 "
                             "(or <=, base, base+N, base-N or a number), several separated by commas")
        relative = match["base"] is not None
        offset = float(match["delta"] or 0) * (-1 if match["sign"] == "-" else 1) if relative else float(
            match["number"])
        rules.append(GateRule(task=match["task"], metric=match["metric"], op=match["op"], relative=relative,
                              offset=offset, text=part.strip()))
    return tuple(rules)


def task_names(text: str) -> tuple[str, ...]:
    """The task names of `evaluate.tasks` (comma-separated), in order, without repeats."""
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """What the stage after training scores, on the tuned model and its base alike (workloads/evaluate)."""

    tasks: str = HELDOUT_TASK
    """Comma-separated task names: "heldout" (the records the run held out, data.eval_fraction, as a
    task made for the run: no network) and any of lm-eval's (gsm8k, ifeval, mmlu, hellaswag, ...,
    whose datasets the workers fetch from the hub). Empty: no evaluation."""

    metric: str = "exact_match"
    """The held-out task's metric: "exact_match", "rougeL" or "loglikelihood" (the answer's
    log-likelihood per token, no generation)."""

    gate: str = ""
    """Comma-separated rules the tuned model must pass, e.g. `heldout:exact_match>=base-0.01`. A run
    that misses one exits 5, names the task and by how much, and its model is not made the run's."""

    base: str = ""
    """The model to compare with (a hub id, s3:// or local folder); empty: model.name_or_path at its
    pinned revision."""

    limit: int = 500
    """Examples per task at most (the first ones; lm-eval's `limit`); 0: all."""

    max_new_tokens: int = 64
    """Generation length of the held-out task's answers."""

    batch_size: int = 16
    """Sequences per forward pass in lm-eval's Hugging Face backend."""

    apply_chat_template: bool = False
    """Render standard tasks' prompts with the tokenizer's chat template (lm-eval's
    --apply_chat_template). The held-out task is always rendered with it, as training saw it."""

    num_fewshot: int = -1
    """Few-shot examples of the standard tasks; -1: each task's own default."""

    cache: str = ""
    """Where the base's scores are kept (local folder or s3://); empty: `evaluation-cache` beside the
    runs in the run's storage."""

    def __post_init__(self) -> None:
        if self.metric not in HELDOUT_METRICS:
            raise ValueError(f"evaluate.metric is {self.metric!r}: use one of {', '.join(HELDOUT_METRICS)}")
        for name in ("limit", "max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or value < (0 if name == "limit" else 1):
                raise ValueError(f"evaluate.{name} is {value!r}: use {'0 (all) or ' if name == 'limit' else ''}"
                                 "a positive number")
        if self.num_fewshot < -1:
            raise ValueError(f"evaluate.num_fewshot is {self.num_fewshot}: use -1 (the task's own) or 0 and up")
        rules = parse_gate(self.gate)
        names = task_names(self.tasks)
        for rule in rules:
            if rule.task not in names:
                raise ValueError(f"evaluate.gate rule {rule.text!r} names task {rule.task!r}, which evaluate.tasks "
                                 f"({self.tasks or 'empty'}) does not run: add it there")
            if rule.task == HELDOUT_TASK and rule.metric != self.metric:
                raise ValueError(f"evaluate.gate rule {rule.text!r}: the heldout task scores {self.metric} "
                                 f"(evaluate.metric), not {rule.metric!r}")

    @property
    def task_list(self) -> tuple[str, ...]:
        return task_names(self.tasks)

    @property
    def rules(self) -> tuple[GateRule, ...]:
        return parse_gate(self.gate)
