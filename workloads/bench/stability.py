"""`python -m workloads.bench.stability RUN_DIR [--out DIR] [--warmup-steps N]`: whether a run stays
stable over minutes: memory flat step over step and tokens/s without drift.

Reads rank 0's step records (RUN_DIR/metrics/rank-0.jsonl, as `workloads.launch.torchrun` writes
them: the tokens/s of each window between log steps, the memory in use and its peak at each log
step), plots tokens/s and memory by step (stability.png, when matplotlib is installed) and checks
the windows after the warm-up (steps after `--warmup-steps`; default: the first tenth of the run,
and never the first window, which holds the compilation):

- drift: the least-squares line through the steady windows' tokens/s moves, from the first steady
  step to the last, by at most DRIFT_MAX of the windows' mean. A run that slows (or speeds up)
  steadily by more fails; noise around a flat line does not move the line;
- memory: the memory in use at the steady log steps spreads over at most MEMORY_SPREAD_GIB, and the
  peak grows by at most that much after the warm-up (a tensor leaked each step shows in both).

Writes DIR/stability.json (the verdicts, their figures and the windows); exit 0 when both hold, 1
when one does not, 2 for bad input (no records, too few steady windows).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

DRIFT_MAX = 0.02
"""Largest relative change of the tokens/s trend over the steady part of the run."""
MEMORY_SPREAD_GIB = 0.25
"""Largest spread of the memory in use, and growth of the peak, after the warm-up."""
MIN_STEADY_WINDOWS = 5


@dataclass(frozen=True, kw_only=True)
class Window:
    step: int
    tokens_per_s: float
    mem_in_use_gib: Optional[float] = None
    peak_mem_gib: Optional[float] = None


def read_windows(path: Path) -> list[Window]:
    """The log steps' windows of a metrics JSONL file, in step order."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            m = json.loads(line)["metrics"]
            if m.get("tokens_per_s_per_device") is not None:
                out.append(Window(step=int(m["step"]), tokens_per_s=float(m["tokens_per_s_per_device"]),
                                  mem_in_use_gib=m.get("mem_in_use_gib"), peak_mem_gib=m.get("peak_mem_gib")))
    return sorted(out, key=lambda w: w.step)


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


@dataclass(frozen=True, kw_only=True)
class Verdict:
    warmup_steps: int
    steady_windows: int
    tokens_per_s_mean: float
    drift: float
    """The trend's change from the first steady step to the last, over the mean (signed)."""
    drift_ok: bool
    memory_spread_gib: Optional[float]
    peak_growth_gib: Optional[float]
    memory_ok: Optional[bool]
    """None where the records carry no memory in use (a run of a loop that did not report it)."""

    @property
    def ok(self) -> bool:
        return self.drift_ok and self.memory_ok is not False


def judge(windows: Sequence[Window], *, warmup_steps: Optional[int] = None) -> Verdict:
    """ValueError when fewer than MIN_STEADY_WINDOWS windows follow the warm-up."""
    if not windows:
        raise ValueError("no step records with tokens/s")
    if warmup_steps is None:
        warmup_steps = max(windows[0].step, windows[-1].step // 10)
    kept = [w for w in windows if w.step > warmup_steps]
    if len(kept) < MIN_STEADY_WINDOWS:
        raise ValueError(f"{len(kept)} windows after the warm-up of {warmup_steps} steps: need at least "
                         f"{MIN_STEADY_WINDOWS} (run longer, log more often, or lower --warmup-steps)")
    steps = [float(w.step) for w in kept]
    rates = [w.tokens_per_s for w in kept]
    mean = sum(rates) / len(rates)
    slope, _ = line_fit(steps, rates)
    drift = slope * (steps[-1] - steps[0]) / mean
    in_use = [w.mem_in_use_gib for w in kept if w.mem_in_use_gib is not None]
    peaks = [w.peak_mem_gib for w in kept if w.peak_mem_gib is not None]
    spread = round(max(in_use) - min(in_use), 3) if in_use else None
    growth = round(max(peaks) - peaks[0], 3) if peaks else None
    memory_ok = None if spread is None else spread <= MEMORY_SPREAD_GIB and (growth or 0) <= MEMORY_SPREAD_GIB
    return Verdict(warmup_steps=warmup_steps, steady_windows=len(kept), tokens_per_s_mean=round(mean, 1),
                   drift=round(drift, 5), drift_ok=abs(drift) <= DRIFT_MAX, memory_spread_gib=spread,
                   peak_growth_gib=growth, memory_ok=memory_ok)


def plot(windows: Sequence[Window], verdict: Verdict, path: Path) -> bool:
    """tokens/s and memory by step, the warm-up shaded; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [w.step for w in windows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(steps, [w.tokens_per_s for w in windows], marker=".", lw=1)
    top.set_ylabel("tokens/s per GPU")
    top.set_title(f"drift {verdict.drift:+.2%} (limit {DRIFT_MAX:.0%}), memory spread "
                  f"{verdict.memory_spread_gib} GiB (limit {MEMORY_SPREAD_GIB})")
    for name, key in (("in use", "mem_in_use_gib"), ("peak", "peak_mem_gib")):
        values = [getattr(w, key) for w in windows]
        if any(v is not None for v in values):
            bottom.plot(steps, values, marker=".", lw=1, label=name)
    bottom.set_ylabel("GiB")
    bottom.set_xlabel("step")
    bottom.legend()
    for ax in (top, bottom):
        ax.axvspan(steps[0], verdict.warmup_steps, color="0.9", label=None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.stability", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's --out folder (metrics/rank-0.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="where stability.json and .png go (default RUN_DIR)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps left out (default: the first tenth)")
    args = parser.parse_args(argv)
    records = args.run_dir / "metrics" / "rank-0.jsonl"
    try:
        if not records.is_file():
            raise ValueError(f"{records} does not exist: give the --out folder of a torchrun run")
        windows = read_windows(records)
        verdict = judge(windows, warmup_steps=args.warmup_steps)
    except ValueError as exc:
        print(f"stability: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)
    plotted = plot(windows, verdict, out / "stability.png")
    (out / "stability.json").write_text(json.dumps(
        {"verdict": {**asdict(verdict), "ok": verdict.ok}, "drift_max": DRIFT_MAX,
         "memory_spread_gib_max": MEMORY_SPREAD_GIB, "plot": "stability.png" if plotted else None,
         "windows": [asdict(w) for w in windows]}, indent=2) + "\n")
    print(f"stability: {verdict.steady_windows} steady windows after step {verdict.warmup_steps}: "
          f"{verdict.tokens_per_s_mean:,.0f} tokens/s, drift {verdict.drift:+.2%} (limit {DRIFT_MAX:.0%}); memory in "
          f"use spread {verdict.memory_spread_gib} GiB, peak growth {verdict.peak_growth_gib} GiB (limit "
          f"{MEMORY_SPREAD_GIB}); {'stable' if verdict.ok else 'NOT stable'}"
          + ("" if plotted else " (no plot: matplotlib is not installed)"))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
