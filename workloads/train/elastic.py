"""Training that goes on with the nodes it has: an elastic run restarts from its latest checkpoint
on fewer ranks (a node lost to a Spot interruption) and later on all of them again. What must not
change across a resize is what the run computes per optimizer step: the samples (so the tokens)
of one step. The config's `grad_accum_steps` is meant for the run's planned (largest) world size;
on fewer ranks each rank accumulates more micro-batches, so that

    micro_batch * grad_accum_steps * world_size

stays what it was. The data position is counted in global samples (workloads/train/data.py), the
learning rate follows the optimizer step (workloads/train/optim.py), the mesh is planned again for
the ranks there are (workloads/train/parallel.py) and DCP reshards the model and optimizer state
on load (workloads/train/checkpoint.py): none of those depend on the world size.

The same holds for any resumed run: each checkpoint records the planned world size, and a run
resumed from it keeps that, not the world size it was launched on (a run that is not elastic,
resumed on another number of ranks, would otherwise train on another number of samples per step
with the same learning-rate schedule and step count).

A config with `rows_per_step` states the rows of a step outright (the GPU presets do): the
micro-steps then follow from the world size the run has, elastic, resumed or neither
(`micro_steps_for_rows`), and no planned world size is needed.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

ELASTIC_PREFIX = "[elastic] "
"""Rank 0's line at the start of a run on another number of ranks than planned (an elastic run's
smaller world size, or a run resumed on another world size), and at each start of an elastic run."""


def planned_world_size(*, world_size: int, elastic_planned: int, saved: Mapping[str, Any]) -> int:
    """The world size the config's grad_accum_steps is meant for. A resumed run keeps the one its
    checkpoint recorded (`saved`: its progress.json), however it was launched now; a fresh elastic
    run plans for its largest world size; any other run for the ranks it has. A checkpoint from
    before the record: the elastic run's largest world size, else the world size that saved it."""
    recorded = int(saved.get("planned_world_size") or 0)
    return recorded or elastic_planned or int(saved.get("world_size") or 0) or world_size


def accumulation_for(world_size: int, *, grad_accum_steps: int, planned_world_size: int,
                     cause: Literal["elastic", "resume"] = "elastic") -> int:
    """Micro-steps per optimizer step on `world_size` ranks that train on as many samples as
    `grad_accum_steps` micro-steps on `planned_world_size` ranks; ValueError where no whole number
    does, with the way out for an elastic run (`cause` "elastic") or a resumed one ("resume")."""
    planned = planned_world_size or world_size
    micro_batches = grad_accum_steps * planned
    if world_size < 1 or micro_batches % world_size:
        # An elastic run goes up to its planned world size; a resumed one to a rank per micro-batch.
        most = micro_batches if cause == "resume" else planned
        fits = ", ".join(str(n) for n in range(1, most + 1) if micro_batches % n == 0)
        if cause == "resume":
            raise ValueError(
                f"resuming on {world_size} ranks cannot keep the samples per optimizer step of the checkpoint's "
                f"run, planned for {planned} ranks with grad_accum_steps={grad_accum_steps}: {micro_batches} "
                f"micro-batches per step do not divide among {world_size}. Resume on {fits} ranks, or lower "
                f"micro_batch and raise grad_accum_steps by one factor until {world_size} divides "
                f"grad_accum_steps x {planned}")
        raise ValueError(
            f"{world_size} ranks cannot keep the samples per optimizer step of {planned} ranks with "
            f"grad_accum_steps={grad_accum_steps}: {micro_batches} micro-batches per step do not divide "
            f"among {world_size}; world sizes that do: {fits}. Choose --min-nodes so "
            "that every allowed world size is one of them, or a grad_accum_steps that a multiple "
            "of the node count divides")
    return micro_batches // world_size


def micro_steps_for_rows(world_size: int, *, micro_batch: int, rows_per_step: int) -> tuple[int, int]:
    """(micro-batch, micro-steps per optimizer step) with which `world_size` ranks train
    `rows_per_step` rows a step (TrainConfig.rows_per_step): the largest micro-batch up to
    `micro_batch` that divides each rank's rows. ValueError where the rows do not divide among the
    ranks, naming the world sizes that would do."""
    if world_size < 1 or rows_per_step % world_size:
        fits = [n for n in range(1, rows_per_step + 1) if rows_per_step % n == 0]
        raise ValueError(
            f"{world_size} ranks cannot share rows_per_step={rows_per_step} evenly; world sizes that can: "
            f"{', '.join(map(str, fits))}. Choose the nodes (or --min-nodes) so the run's GPUs are one of them, "
            "or a rows_per_step they divide")
    per_rank = rows_per_step // world_size
    chosen = next(m for m in range(min(micro_batch, per_rank), 0, -1) if per_rank % m == 0)
    return chosen, per_rank // chosen
