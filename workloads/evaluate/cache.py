"""The base model's scores, kept in the run's storage (local or s3://) by model revision, task and
settings, so the next run on the same base does not pay for them again.

The key is a hash of: what the model is (a hub id at its commit; a local folder by the contents of
its files; an s3:// folder by its URI and its files' sizes), the task (the held-out task by the
questions it asks), every setting that changes a score (metric, limit, generation length, few-shot,
chat template, dtype) and lm-eval's version. Batch size is left out: it changes no score beyond
float rounding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from workloads.evaluate.compare import Score
from workloads.train.evaluation_config import EvaluateConfig
from workloads.model_io.storage import Location, locate

CACHE_DIR = "evaluation-cache"
"""The folder of cached base scores beside the runs in a storage path."""


def folder_identity(folder: Path) -> str:
    """A local model folder by the contents of its files (weights, config, tokenizer)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def model_identity(spec: str, *, revision: str = "", local: Optional[Path] = None) -> str:
    """What the model `spec` (hub id, s3:// or local folder) is, for the cache key."""
    from workloads.model_io.sources import source_kind

    kind = source_kind(spec, what="evaluate.base")
    if kind == "hub":
        return f"hub:{spec}@{revision or 'default'}"
    if kind == "s3":
        files = locate(spec).files()
        return f"s3:{spec}:" + hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
    return folder_identity(local or Path(spec))


def cache_key(*, model: str, task: str, task_digest: str, settings: EvaluateConfig, dtype: str,
              lm_eval_version: str) -> str:
    scoring = {"metric": settings.metric, "limit": settings.limit, "max_new_tokens": settings.max_new_tokens,
               "num_fewshot": settings.num_fewshot, "apply_chat_template": settings.apply_chat_template}
    text = json.dumps({"model": model, "task": task, "task_digest": task_digest, "scoring": scoring, "dtype": dtype,
                       "lm_eval": lm_eval_version}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_location(settings: EvaluateConfig, *, storage_path: str) -> Location:
    return locate(settings.cache or f"{storage_path.rstrip('/')}/{CACHE_DIR}")


def read_cached(where: Location, key: str) -> Optional[dict[str, Score]]:
    """The cached scores of `key` (metric -> score), or None."""
    entry = where.join(f"{key}.json")
    try:
        if not entry.is_file():
            return None
        stored = json.loads(entry.read_bytes())
        return {metric: Score(**score) for metric, score in stored["scores"].items()}
    except (ValueError, KeyError, TypeError):
        return None


def write_cached(where: Location, key: str, scores: dict[str, Score], *, about: dict) -> None:
    """Keep the scores of `key`; written to a local file first, then copied (S3 has no partial object)."""
    import tempfile

    text = json.dumps({"scores": {m: asdict(s) for m, s in scores.items()}, "about": about}, indent=1,
                      sort_keys=True)
    if not where.remote:
        path = Path(where.path) / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        from workloads.files import replace_whole

        replace_whole(path, text)
        return
    with tempfile.TemporaryDirectory(prefix="evaluation-cache-") as tmp:
        (Path(tmp) / f"{key}.json").write_text(text)
        where.upload_from(Path(tmp))
