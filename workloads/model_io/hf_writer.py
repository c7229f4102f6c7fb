"""A Hugging Face folder's weights, written: the dtype they are written in and the safetensors
writer (one file, or shards with their index, as save_pretrained writes them), which both exports
use, the full one (export.py) and the LoRA one (lora_export.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from workloads.model_io.load import INDEX_FILE


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORT_DTYPES = ("auto", *DTYPES)
"""`auto`: the dtype the pretrained model was published in (its config's `dtype`), float32 for a
model trained from random weights."""

MAX_SHARD_BYTES = 2 * 2**30
"""Largest safetensors file written; a bigger model is split into several with an index."""


def config_dtype(config) -> Optional[torch.dtype]:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value).removeprefix("torch.")) if value else None


def resolve_dtype(choice: str, config) -> torch.dtype:
    """The dtype to write: `choice` by name, or for "auto" the config's own (float32 if it has none)."""
    if choice not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {choice!r}: use one of {', '.join(EXPORT_DTYPES)}")
    if choice == "auto":
        return config_dtype(config) or torch.float32
    return DTYPES[choice]


class SafetensorsWriter:
    """Writes tensors into `model.safetensors`, or several `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` once they exceed `max_shard_bytes`, as save_pretrained does."""

    def __init__(self, folder: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                 file_name: str = "model.safetensors") -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.file_name = file_name
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.folder / f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = self.folder / self.file_name
            self._written[0][0].rename(final)
            return [final]
        weight_map, paths = {}, []
        for i, (path, names) in enumerate(self._written, start=1):
            final = self.folder / f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            paths.append(final)
            weight_map.update((name, final.name) for name in names)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return paths
