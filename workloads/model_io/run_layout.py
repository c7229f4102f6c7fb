"""The names of a run's stored folders, free of torch so that the command line can read a run's
layout (which checkpoint holds an export, where its adapter is) without importing it."""

from __future__ import annotations

MODEL_DIR = "model"
"""The Hugging Face folder inside each checkpoint (metadata; the final one also holds the weights)
and, next to a run's checkpoints, the default export target."""

ADAPTER_DIR = "adapter"
"""The LoRA adapter's subfolder of an exported model."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

DCP_METADATA = ".metadata"
"""The file torch.distributed.checkpoint writes last into a complete checkpoint folder."""


def checkpoint_folders(files: dict[str, int]) -> list[str]:
    """The complete checkpoint folders among a run's files (relative; "" for the run folder itself),
    oldest first: names sort by step (`checkpoint-0000060`) or by time (`checkpoint_2026-...`)."""
    folders = {name.rpartition("/")[0] for name in files if name.rpartition("/")[2] == DCP_METADATA}
    return sorted(folders, key=lambda f: (f.rpartition("/")[2], f))
