"""What a resumed run keeps from the run that saved its checkpoint, so that it stays the same run.

- Its samples per optimizer step: the checkpoint records the world size the run's grad_accum_steps
  is planned for, and accumulation is rescaled to it on the ranks there are now
  (workloads/train/elastic.py), whether the run is elastic or resumed on another number of ranks.
- The model and the data it read: the client resolves a hub model's and a hub dataset's revision to
  a commit once, when the run is submitted (workloads/client/revisions.py), so that every node and
  every restart of that submission read the same files. Each checkpoint records those commits, and a
  run resumed from it reads them again, not what the client resolved this time: a resubmission days
  later would otherwise read a newer commit and pack other rows at the same data position, skipping
  or repeating examples.

Each thing kept that differs from what this start was given is said in one `[resume]` line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from workloads.context import TrainContext
from workloads.model_io.sources import source_kind
from workloads.train import checkpoint
from workloads.train.config import TrainConfig
from workloads.train.paths import resolve_path

RESUME_PREFIX = "[resume] "
"""Rank 0's line for each setting a resumed run takes from its checkpoint instead of its config."""


def saved_progress(ctx: TrainContext) -> dict[str, Any]:
    """progress.json of the checkpoint this start resumes from; {} for a fresh start."""
    folder = ctx.latest_checkpoint()
    return {} if folder is None else checkpoint.read_progress(folder)


def _reads_hub_model(cfg: TrainConfig) -> bool:
    if cfg.model.is_named_architecture:
        return False
    try:
        spec = resolve_path(cfg.model.name_or_path, field="model.name_or_path", hub_id_allowed=True)
        return source_kind(spec, what="model.name_or_path") == "hub"
    except ValueError:  # not a source at all: the fetch says so, with the fix
        return False


def hub_revisions(cfg: TrainConfig) -> dict[str, str]:
    """The hub repositories the run reads ("model:ORG/NAME", "dataset:ORG/NAME") and the revision
    its config gives each (a commit once the client has pinned it; empty: the default branch)."""
    out = {}
    if _reads_hub_model(cfg):
        out[f"model:{cfg.model.name_or_path}"] = cfg.model.revision
    if cfg.data.kind == "hub":
        out[f"dataset:{cfg.data.path}"] = cfg.data.revision
    return out


def keep_hub_revisions(cfg: TrainConfig, saved: Mapping[str, Any]) -> tuple[TrainConfig, list[str]]:
    """The config reading each hub repository at the commit the checkpoint recorded for it, and a
    `[resume]` line for each that differs from the config's revision."""
    recorded = saved.get("hub_revisions") or {}
    lines = []
    for key, revision in hub_revisions(cfg).items():
        kept = recorded.get(key)
        if not kept or kept == revision:
            continue
        kind, _, repo = key.partition(":")
        section = "model" if kind == "model" else "data"
        given = revision or "<default branch>"
        lines.append(f"{RESUME_PREFIX}hub {kind} {repo} at commit {kept}, as the checkpoint's run read it (this "
                     f"start was given {section}.revision={given}): a resumed run reads what it read before; start "
                     "a new run (another --run-name) to read another revision")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), revision=kept)})
    return cfg, lines
