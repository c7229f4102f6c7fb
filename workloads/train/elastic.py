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

A config with `rows_per_step` states the rows of a step outright (the GPU presets do): the
micro-steps then follow from the world size the run has, elastic or not (`micro_steps_for_rows`).
"""

from __future__ import annotations

ELASTIC_PREFIX = "[elastic] "
"""Rank 0's line at the start of a run on fewer ranks than planned (or on all of them again)."""


def accumulation_for(world_size: int, *, grad_accum_steps: int, planned_world_size: int) -> int:
    """Micro-steps per optimizer step on `world_size` ranks that train on as many samples as
    `grad_accum_steps` micro-steps on `planned_world_size` ranks; ValueError where no whole number
    does."""
    planned = planned_world_size or world_size
    micro_batches = grad_accum_steps * planned
    if world_size < 1 or micro_batches % world_size:
        fits = sorted(n for n in range(1, planned + 1) if micro_batches % n == 0)
        raise ValueError(
            f"{world_size} ranks cannot keep the samples per optimizer step of {planned} ranks with "
            f"grad_accum_steps={grad_accum_steps}: {micro_batches} micro-batches per step do not divide "
            f"among {world_size}; world sizes that do: {', '.join(map(str, fits))}. Choose --min-nodes so "
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
