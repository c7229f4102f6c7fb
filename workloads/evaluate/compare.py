"""The tuned model beside its base: per task and metric, both scores, their standard errors, the
difference and whether it is larger than noise; and the gate's verdict.

A difference counts as real when it exceeds two standard errors of the difference, taken as
sqrt(se_tuned^2 + se_base^2): the two scores are means over the same examples but are treated as
independent, which overstates the noise of a paired comparison (the per-example correlation is
positive), so "larger than noise" here errs towards saying no.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from workloads.train.evaluation_config import GateRule

NOISE_STDERRS = 2.0
"""A difference beyond this many standard errors of the difference is called larger than noise."""


@dataclass(frozen=True, kw_only=True)
class Score:
    value: float
    stderr: Optional[float]
    """lm-eval's standard error of the mean over the task's examples; None where it gives none."""
    samples: int = 0


@dataclass(frozen=True, kw_only=True)
class Row:
    task: str
    metric: str
    tuned: float
    tuned_stderr: Optional[float]
    base: Optional[float]
    base_stderr: Optional[float]
    samples: int
    higher_is_better: bool = True

    @property
    def difference(self) -> Optional[float]:
        return None if self.base is None else self.tuned - self.base

    @property
    def noise(self) -> Optional[float]:
        """Two standard errors of the difference (None when a score has no stderr)."""
        if self.tuned_stderr is None or self.base_stderr is None:
            return None
        return NOISE_STDERRS * math.sqrt(self.tuned_stderr ** 2 + self.base_stderr ** 2)

    @property
    def significant(self) -> Optional[bool]:
        if self.difference is None or self.noise is None:
            return None
        return abs(self.difference) > self.noise

    @property
    def verdict(self) -> str:
        """"better", "worse" or "within noise" (or "?" without stderrs or base)."""
        if self.significant is None:
            return "?"
        if not self.significant:
            return "within noise"
        gained = self.difference > 0 if self.higher_is_better else self.difference < 0
        return "better" if gained else "worse"

    def to_dict(self) -> dict:
        return {**asdict(self), "difference": self.difference, "noise": self.noise, "significant": self.significant,
                "verdict": self.verdict}


def compare(tuned: dict[str, dict[str, Score]], base: dict[str, dict[str, Score]],
            *, higher_is_better: Optional[dict[str, dict[str, bool]]] = None) -> list[Row]:
    """One row per task and metric of the tuned model's scores, beside the base's where it has them."""
    rows = []
    for task in tuned:
        for metric, score in tuned[task].items():
            other = base.get(task, {}).get(metric)
            rows.append(Row(task=task, metric=metric, tuned=score.value, tuned_stderr=score.stderr,
                            base=None if other is None else other.value, base_stderr=None if other is None else
                            other.stderr, samples=score.samples,
                            higher_is_better=(higher_is_better or {}).get(task, {}).get(metric, True)))
    return rows


@dataclass(frozen=True, kw_only=True)
class GateResult:
    rule: str
    passed: bool
    tuned: Optional[float]
    bound: Optional[float]
    message: str


def judge(rules: tuple[GateRule, ...], rows: list[Row]) -> list[GateResult]:
    """Each rule's verdict on the table: a rule whose task and metric the table lacks fails (it says so)."""
    by_key = {(r.task, r.metric): r for r in rows}
    results = []
    for rule in rules:
        row = by_key.get((rule.task, rule.metric))
        if row is None or (rule.relative and row.base is None):
            missing = "no score" if row is None else "no base score"
            results.append(GateResult(rule=rule.text, passed=False, tuned=None, bound=None,
                                      message=f"{rule.text}: {missing} for {rule.task}:{rule.metric}"))
            continue
        bound = rule.bound(row.base)
        passed = rule.passes(row.tuned, row.base)
        by = row.tuned - bound
        shown = f"{rule.task}:{rule.metric} {row.tuned:.4f}" + (
            f" vs base {row.base:.4f}" if row.base is not None else "")
        message = (f"{rule.text}: passed ({shown})" if passed else
                   f"{rule.text}: {rule.task} regressed: {shown}, {abs(by):.4f} "
                   f"{'below' if rule.op == '>=' else 'above'} the bound {bound:.4f}")
        results.append(GateResult(rule=rule.text, passed=passed, tuned=row.tuned, bound=bound, message=message))
    return results


def format_table(rows: list[Row]) -> str:
    """The side-by-side table, one line per task and metric."""
    def num(value: Optional[float], *, signed: bool = False) -> str:
        return "-" if value is None else (f"{value:+.4f}" if signed else f"{value:.4f}")

    header = ("TASK", "METRIC", "TUNED", "±", "BASE", "±", "DIFF", "2·SE", "VERDICT")
    lines = [header] + [(r.task, r.metric, num(r.tuned), num(r.tuned_stderr), num(r.base), num(r.base_stderr),
                         num(r.difference, signed=True), num(r.noise), r.verdict) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
