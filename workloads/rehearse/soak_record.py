"""The soak's record: its uninterrupted reference run, and what it writes in its folder (summary.json,
the memory and storage samples, soak.png). workloads/rehearse/soak.py runs the soak."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from workloads.client.report import completed_losses
from workloads.rehearse.soak_plan import FAULT_KINDS

if TYPE_CHECKING:
    from workloads.rehearse.soak_checks import FinishedSoak
    from workloads.rehearse.soak_plan import SoakSettings


class Reference:
    """The same run uninterrupted, through the torchrun adapter: the same loop on two gloo ranks
    without Ray, each its own "node" (GROUP_RANK, as `torchrun --nnodes 2` sets it), so that the loop
    plans the mesh the local cluster's two nodes get (HSDP, one rank per node) and reduces gradients
    the same way. Started at once, in the background at `niceness` (a soak's waits leave CPU idle);
    `losses()` waits for it and gives each step's loss."""

    def __init__(self, settings: SoakSettings, *, out: Path, niceness: int = 0) -> None:
        from workloads.client.cluster import free_port

        self.out = out
        argv = [sys.executable, "-m", "workloads.launch.torchrun", "--preset", "demo-cpu", "--out", str(out),
                *(arg for override in [*settings.overrides(), "tracking.uri=off"] for arg in ("--set", override))]
        port = free_port()
        self.ranks = []
        for rank in range(2):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "GROUP_RANK": str(rank)}
            with (out.parent / f"{out.name}-rank-{rank}.txt").open("w") as log:
                self.ranks.append(subprocess.Popen(["nice", "-n", str(niceness), *argv], stdout=log,
                                                   stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL))

    def losses(self) -> dict[int, float]:
        codes = [rank.wait() for rank in self.ranks]
        if any(codes):
            raise RuntimeError(f"the uninterrupted reference run failed (exit codes {codes}); see "
                               f"{self.out.parent}/{self.out.name}-rank-*.txt")
        reports = [json.loads(line)["metrics"] for line in
                   (self.out / "metrics" / "rank-0.jsonl").read_text().splitlines() if line.strip()]
        # The torchrun adapter keeps every checkpoint it writes (160 KiB each here; a 30-minute
        # soak's reference writes hundreds): only the losses are wanted.
        for folder in self.out.glob("checkpoint-*"):
            shutil.rmtree(folder)
        return {int(r["step"]): float(r["loss"]) for r in reports if "loss" in r}

    def stop(self) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def plot(soak: FinishedSoak, *, path: Path) -> None:
    """The loss by step with each fault marked, and each role's resident memory over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record, reference = soak.record, soak.reference
    losses = completed_losses(soak.logs.lines)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [3, 2]})
    top.plot(sorted(losses), [losses[s] for s in sorted(losses)], label="soak (each step as completed)", lw=1)
    top.plot(sorted(reference), [reference[s] for s in sorted(reference)], "--", label="uninterrupted", lw=1)
    colors = dict(zip(FAULT_KINDS, plt.rcParams["axes.prop_cycle"].by_key()["color"][2:]))
    for row in record["fault_table"]:
        top.axvline(row["step"], color=colors[row["kind"]], lw=1, alpha=0.8)
        top.annotate(row["kind"], (row["step"], 1.0), xycoords=("data", "axes fraction"), rotation=90,
                     va="top", ha="right", fontsize=8, color=colors[row["kind"]])
    top.set(xlabel="step", ylabel="training loss", title=f"soak: {len(record['fault_table'])} faults, seed "
            f"{record['seed']}, {record['wall_s'] / 60:.0f} min")
    top.legend(loc="center right")
    totals: dict[str, dict[float, float]] = {}
    for sample in soak.memory:
        totals.setdefault(sample["role"], {}).setdefault(sample["t"], 0.0)
        totals[sample["role"]][sample["t"]] += sample["rss_mib"]
    for role, series in sorted(totals.items()):
        bottom.plot([t / 60 for t in series], list(series.values()), label=role, lw=1)
    for row in record["fault_table"]:
        bottom.axvline(row["at_s"] / 60, color=colors[row["kind"]], lw=1, alpha=0.6)
    bottom.set(xlabel="minutes", ylabel="resident memory, MiB (sum per role)")
    bottom.legend(loc="upper left", fontsize=8, ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_record(soak: FinishedSoak, *, out: Path) -> None:
    """summary.json (the record), memory.json and storage.json (the samples), soak.png."""
    plot(soak, path=out / "soak.png")
    (out / "memory.json").write_text(json.dumps(soak.memory) + "\n")
    (out / "storage.json").write_text(json.dumps(soak.storage_samples) + "\n")
    (out / "summary.json").write_text(json.dumps(soak.record, indent=2, default=str) + "\n")
