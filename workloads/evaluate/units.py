"""One unit of evaluation: one model (the tuned one, its base, or base + LoRA adapter) on one task,
wherever it runs (a GPU worker of the job, the local CPU, `python -m workloads evaluate`).

Each unit builds the held-out task itself (the same records, seed and tokenizer on every node make
the same task, whose hash keys the base's cache), fetches its model into the node's cache (the base
is usually there already: training read it), and looks the base's scores up in the cache before it
loads anything.
"""

from __future__ import annotations

import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from workloads.model_io.run_layout import ADAPTER_DIR
from workloads.train.evaluation_config import HELDOUT_TASK

ROLES = ("tuned", "adapter", "base")
"""tuned: the run's exported model (merged, for LoRA); adapter: the base with the run's LoRA adapter
applied by peft (lm-eval's `peft=`); base: what the run started from."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    role: str
    task: str

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role


@dataclass(frozen=True, kw_only=True)
class Models:
    """Where each model of the evaluation is: URIs or local paths, fetched by the unit."""

    tuned: str
    """The exported model folder (local, or s3://)."""
    base: str
    """A hub id, s3:// folder or local folder."""
    base_revision: str = ""


def plan_units(tasks: tuple[str, ...], *, lora: bool, base: bool = True) -> list[Unit]:
    """Every (model, task) pair: the tuned model's first (it is what the gate judges), then the
    adapter's (LoRA), then the base's (often cached)."""
    roles = ["tuned", *(["adapter"] if lora else []), *(["base"] if base else [])]
    return [Unit(role=role, task=task) for role in roles for task in tasks]


def local_folder(uri: str, *, cache_dir: str) -> Path:
    """A model folder as a local path: itself, or an s3:// folder downloaded into the node's cache."""
    from workloads.model_io.storage import is_s3, locate

    if not is_s3(uri):
        return Path(uri)
    from workloads.model_io.cache import cache_root, entry_name, fill_once

    location = locate(uri)
    entry = fill_once(cache_root(cache_dir), entry_name("evaluate", uri, "model"), location.download)
    return entry.path


def node_here() -> str:
    """The Ray node's address inside a Ray task (the local cluster's nodes share one host name), else
    the host's name."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostname()


def device_here() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_unit(unit: Unit, *, train: dict, models: Models, storage_path: str, device: Optional[str] = None) -> dict:
    """Evaluate one unit; a plain dict (it crosses Ray): role, task, scores by metric, higher is
    better by metric, seconds, cached, node."""
    from workloads.evaluate import cache, harness
    from workloads.evaluate.tasks import build_heldout_task, examples_digest, task_manager
    from workloads.model_io.sources import fetch_model
    from workloads.train.config import TrainConfig

    started = time.monotonic()
    cfg = TrainConfig.from_dict(train)
    settings = cfg.evaluate
    device = device or device_here()
    tuned = local_folder(models.tuned, cache_dir=cfg.cache_dir)
    base = fetch_model(models.base, revision=models.base_revision, cache_dir=cfg.cache_dir, what="evaluate.base") \
        if unit.role in ("base", "adapter") else None
    with tempfile.TemporaryDirectory(prefix="evaluate-") as tmp:
        include_path, digest = None, ""
        if unit.task == HELDOUT_TASK:
            include_path = build_heldout_task(train, Path(tmp) / "heldout", tokenizer_folder=tuned,
                                              cache_dir=cfg.cache_dir)
            digest = examples_digest(include_path)
        key, where = "", None
        if unit.role == "base":
            dtype = harness.model_args(pretrained=base, peft=None, device=device)["dtype"]
            key = cache.cache_key(model=cache.model_identity(models.base, revision=models.base_revision, local=base),
                                  task=unit.task, task_digest=digest, settings=settings, dtype=dtype,
                                  lm_eval_version=harness.lm_eval_version())
            where = cache.cache_location(settings, storage_path=storage_path)
            cached = cache.read_cached(where, key)
            if cached is not None:
                return {**asdict(unit), "scores": {m: asdict(s) for m, s in cached.items()}, "higher_is_better": {},
                        "seconds": round(time.monotonic() - started, 2), "cached": True, "node": node_here()}
        pretrained, peft = (tuned, None) if unit.role == "tuned" else (
            (base, tuned / ADAPTER_DIR) if unit.role == "adapter" else (base, None))
        result = harness.evaluate_model(pretrained=pretrained, peft=peft, tasks=[unit.task], settings=settings,
                                        device=device, manager=task_manager(include_path))
    scores = result.scores.get(unit.task, {})
    if not scores:
        raise RuntimeError(f"lm-eval reported no score for task {unit.task} (results for: "
                           f"{', '.join(result.scores) or 'nothing'})")
    if where is not None:
        cache.write_cached(where, key, scores, about={"model": models.base, "revision": models.base_revision,
                                                      "task": unit.task, "lm_eval": result.lm_eval_version})
    return {**asdict(unit), "scores": {m: asdict(s) for m, s in scores.items()},
            "higher_is_better": result.higher_is_better.get(unit.task, {}),
            "seconds": round(time.monotonic() - started, 2), "cached": False, "node": node_here()}
