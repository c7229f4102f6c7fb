"""A LoRA checkpoint as Hugging Face folders: the adapter in peft's format, and the base merged with it.

A LoRA run's checkpoints hold only the adapters (and their optimizer state); its `model/` folder
holds the base's config, tokenizer and the adapter's config (`model/adapter/adapter_config.json`,
written by workloads/train/method.py). So any checkpoint exports:
- the adapter: its tensors under peft's names (`base_model.model.<module>.lora_A.weight`), fp32, with
  that config: `PeftModel.from_pretrained(base, OUT/adapter)` loads it;
- the merged model: each adapted weight W of the base becomes W + (alpha / r) B A (peft's delta,
  without fan_in_fan_out), computed in fp32 and written in the export dtype; every other tensor is
  the base's. The base is the run's as the client submitted it, or the one the user names
  (workloads/model_io/lora_base.py: never the adapter config's own claim, which the job wrote), read
  from its source one safetensors file's worth at a time.
A base that is a named architecture (random weights from a seed) is not stored anywhere: its run's
final checkpoint holds the merged export it made, and other checkpoints export the adapter only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from workloads.model_io.architectures import NAMED_ARCHITECTURES
from workloads.model_io.hf_writer import SafetensorsWriter, resolve_dtype
from workloads.model_io.load import INDEX_FILE, weight_files
from workloads.model_io.lora_base import LoraBase, base_to_merge
from workloads.model_io.run_layout import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, MODEL_DIR
from workloads.model_io.storage import local_location

CHECKPOINT_PREFIX = "model.lm."
"""Where a checkpoint keeps the language model's tensors (the loop's CausalLMWithLoss.lm)."""


def is_lora_checkpoint(checkpoint: Path) -> bool:
    return (checkpoint / MODEL_DIR / ADAPTER_DIR / ADAPTER_CONFIG).is_file()


def adapter_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's adapters, full, under peft's saved names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from workloads.model_io.safe_checkpoint import SafeFileSystemReader, read_checkpoint_metadata

    # Read as export reads any checkpoint: nothing it holds is run (workloads/model_io/safe_checkpoint.py).
    stored = read_checkpoint_metadata(checkpoint).state_dict_metadata
    keys = [k for k, m in stored.items() if isinstance(m, TensorStorageMetadata) and k.startswith(CHECKPOINT_PREFIX)
            and ".lora_" in k]
    if not keys:
        raise ValueError(f"{checkpoint} holds no LoRA adapters, though its {MODEL_DIR}/{ADAPTER_DIR} says it should")
    # Every adapted module has one A and one B: anything else would merge nothing and pass for the base.
    modules: dict[str, set[str]] = {}
    for key in keys:
        module, _, part = key.rpartition(".lora_")
        modules.setdefault(module, set()).add(part)
    for module, parts in modules.items():
        if parts != {"A.default.weight", "B.default.weight"}:
            raise ValueError(f"{checkpoint}: the adapter of {module.removeprefix(CHECKPOINT_PREFIX)!r} is not one "
                             f"lora_A and one lora_B weight (it holds lora_{', lora_'.join(sorted(parts))}): not an "
                             "adapter a LoRA run saves")
    state = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
    return {"base_model.model." + k[len(CHECKPOINT_PREFIX):].replace(".default.", "."): v for k, v in state.items()}


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, scaling: float) -> torch.Tensor:
    """W + scaling * B A, in fp32."""
    return weight.float() + (b.float() @ a.float()) * scaling


def consolidate_lora(checkpoint: Path, out: Path, *, dtype_choice: str = "auto", base: Optional[LoraBase] = None,
                     submitted: Optional[LoraBase] = None, cache_dir: str = "") -> torch.dtype:
    """Write OUT/adapter (peft's format) and, from the base's weights, OUT (the merged model): the
    base `base` (the user's), else `submitted` (the run's as submitted; workloads/model_io/lora_base.py)."""
    from transformers import AutoConfig

    from workloads.model_io.sources import fetch_model

    meta = checkpoint / MODEL_DIR
    metadata = local_location(meta)  # links refused, never followed (workloads/files.py)
    adapter_config = json.loads(metadata.join(ADAPTER_DIR, ADAPTER_CONFIG).read_bytes())
    chosen = base_to_merge(adapter_config, submitted=submitted, given=base)
    adapters = adapter_tensors(checkpoint)
    metadata.copy_to(local_location(out), names=[f"{ADAPTER_DIR}/{ADAPTER_CONFIG}"])
    writer = SafetensorsWriter(out / ADAPTER_DIR, max_shard_bytes=2**62, file_name=ADAPTER_WEIGHTS)
    for name, tensor in sorted(adapters.items()):
        writer.add(name, tensor.float())
    writer.close()
    if chosen is None:
        raise ValueError(
            f"the adapter is written to {out / ADAPTER_DIR}; the merged model needs the base's weights, and there is "
            "no record of this run's submission here (submit and run --local keep one on the machine they run on), "
            "while the checkpoint's adapter_config.json, which the job wrote, is not trusted to name it. Give "
            "--base FOLDER_OR_HUB_ID (and --base-revision REV): the model the run trained on")
    spec = chosen.name_or_path
    if spec in NAMED_ARCHITECTURES:
        raise ValueError(
            f"the adapter is written to {out / ADAPTER_DIR}; the merged model needs the base's weights, and this run's "
            f"base ({spec}) has none stored (random weights): only the run's final checkpoint holds "
            "its merged export. Give --base FOLDER_OR_HUB_ID to merge into another base")
    folder = fetch_model(chosen.source or spec, revision=chosen.revision, cache_dir=cache_dir, what=chosen.told_by)
    config = AutoConfig.from_pretrained(meta, trust_remote_code=False)
    dtype = resolve_dtype(dtype_choice, config)
    metadata.copy_to(local_location(out), names=[n for n in metadata.files() if "/" not in n and not n.endswith(
        (".safetensors", ".py")) and n != INDEX_FILE])
    config.dtype = dtype
    config.save_pretrained(out)
    scaling = float(adapter_config["lora_alpha"]) / float(adapter_config["r"])
    weights = SafetensorsWriter(out)
    merged = 0
    files = weight_files(folder)
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for name in [n for n in f.keys() if files[n] == path]:
                tensor = f.get_tensor(name)
                module = name.removesuffix(".weight")
                a = adapters.get(f"base_model.model.{module}.lora_A.weight")
                if a is not None:
                    tensor = merged_weight(tensor, a, adapters[f"base_model.model.{module}.lora_B.weight"],
                                           scaling=scaling)
                    merged += 1
                weights.add(name, tensor.to(dtype))
    weights.close()
    expected = len(adapters) // 2
    if merged != expected:
        raise ValueError(f"the base {chosen} has {merged} of the {expected} weights the adapter adapts: it is not "
                         "the model the run trained")
    return dtype
