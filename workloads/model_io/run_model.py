"""A fine-tuning run as the model another run starts from (`--set model.name_or_path=RUN`): DPO after
SFT, or any run after another.

RUN may be a model folder (local or s3://: used as it is), a local run folder of `run --local`
(runs/<name>, its exported `model/` first), a run's checkpoint storage (local or s3://, the Ray Train
run folder that holds checkpoint folders) or one checkpoint folder. It names the model its newest
checkpoint exported (`<checkpoint>/model`: the weights, tokenizer and config; for a LoRA run the
adapter merged in, and the adapter itself in `model/adapter`). A run whose checkpoints hold no
export is refused with the command that makes one.

For a LoRA run with `model.adapter: stack`, the run's base model (its adapter config's
base_model_name_or_path and revision) is where the new run starts, and the run's adapter goes in
`lora.stacked_adapter`, kept beneath the new adapters (workloads/train/method.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workloads.model_io.cache import cache_root, entry_name, fill_once
from workloads.model_io.run_layout import ADAPTER_CONFIG, ADAPTER_DIR, MODEL_DIR, checkpoint_folders
from workloads.model_io.storage import is_s3, locate


@dataclass(frozen=True, kw_only=True)
class StartingModel:
    name_or_path: str
    """The model folder (or, stacked, the base model) the run starts from."""
    revision: str = ""
    """The base model's hub revision when stacked on a hub base."""
    stacked_adapter: str = ""
    """The run's adapter folder, when stacked."""
    run: str = ""
    """The run it came from; empty when name_or_path was a model already."""


def _exported(files: dict[str, int], folder: str) -> bool:
    prefix = f"{folder}/{MODEL_DIR}/" if folder else f"{MODEL_DIR}/"
    return prefix + "config.json" in files and any(
        name.startswith(prefix) and "/" not in name[len(prefix):] and name.endswith(".safetensors") for name in files)


def starting_model(spec: str, *, stack: bool = False) -> StartingModel:
    """What `spec` (model.name_or_path) starts from; a hub id, a named architecture or a model folder
    unchanged. ValueError for a run with no exported model, or a stack of a run that is not LoRA."""
    if not is_s3(spec) and not spec.startswith(("/", ".", "~")):
        if not Path(spec).expanduser().exists():
            return StartingModel(name_or_path=spec)  # a hub id or a named architecture
    location = locate(spec)
    files = location.files()
    if "config.json" in files:
        model, run = location, ""
    else:
        folders = [f for f in [""] + checkpoint_folders(files) if _exported(files, f)]
        if not folders:
            if not checkpoint_folders(files):
                return StartingModel(name_or_path=spec)  # not a run: the model loader says what is wrong
            raise ValueError(f"model.name_or_path {spec!r} is a run whose checkpoints hold no exported model: "
                             f"export one (python -m workloads export {spec}) and start from it, or from its "
                             "model/ folder")
        # A local run's own export (written at its end) first, else the newest checkpoint's.
        chosen = "" if "" in folders else folders[-1]
        model, run = location.join(chosen, MODEL_DIR) if chosen else location.join(MODEL_DIR), spec
    adapter = model.join(ADAPTER_DIR)
    if not stack:
        return StartingModel(name_or_path=model.uri, run=run)
    try:
        adapter_config = json.loads(adapter.join(ADAPTER_CONFIG).read_bytes())
    except (OSError, ValueError):
        raise ValueError(f"model.adapter is 'stack' but {model.uri} is not a LoRA run's model (no "
                         f"{ADAPTER_DIR}/{ADAPTER_CONFIG}): stack applies to a LoRA run; use "
                         "model.adapter=merge") from None
    base = adapter_config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter.uri}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path): stack needs "
                         "it; use model.adapter=merge to start from the merged weights")
    return StartingModel(name_or_path=base, revision=adapter_config.get("revision") or "", stacked_adapter=adapter.uri,
                         run=run or spec)


def fetch_adapter(spec: str, *, cache_dir: str = "") -> Path:
    """The local folder of a peft adapter (`lora.stacked_adapter`): as it is, or fetched from s3://
    into the node cache once per node. ValueError where it holds no adapter."""
    location = locate(spec)
    if not location.remote:
        folder = Path(location.path)
    else:
        files = location.files()
        folder = fill_once(cache_root(cache_dir), entry_name("s3-adapter", spec),
                           lambda target: location.download(target, names=sorted(files))).path
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"lora.stacked_adapter {spec!r} holds no {ADAPTER_CONFIG}: give a peft adapter folder (a LoRA "
                         f"run's model/{ADAPTER_DIR})")
    return folder
