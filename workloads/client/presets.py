"""Which preset a command takes when the user names none, and why, in words for the console: a
switch to LoRA, or a preset sized for smaller GPUs, is said where it happens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from workloads.client.overrides import given_keys


@dataclass(frozen=True, kw_only=True)
class PresetChoice:
    name: str
    why: str
    """Why this preset, as a clause: "LoRA, as a full fine-tune of 7B needs ..."."""
    method_set: Optional[str] = None
    """The method `--set method=` asks for where it differs from the preset's own: the run is the
    preset as set, and says so beside its name."""

    @property
    def label(self) -> str:
        """The preset's name as a run of it is: `qwen2.5-7b-lora-24gb with --set method=full`."""
        return self.name + (f" with --set method={self.method_set}" if self.method_set else "")


def method_asked(overrides: list[str]) -> Optional[str]:
    """The method `--set method=M` asks for, or None."""
    method = given_keys(overrides).get("method")
    return None if method is None else str(method)


def choose_preset(*, preset_name: Optional[str], model_size: str, gpu_memory_gib: Optional[int],
                  gpus: Optional[int], overrides: list[str], cluster: str) -> PresetChoice:
    """The preset named, else the one for the GPUs (`preset_for_gpu`, by the method the overrides set,
    if any), with why. `cluster` names the GPUs in the reason ("1 x g6.12xlarge")."""
    from workloads.train.config import FULL_7B_MIN_RANKS_24GB, LARGE_GPU_GIB, METHODS, preset, preset_for_gpu

    method = method_asked(overrides)
    name = preset_name or preset_for_gpu(gpu_memory_gib, model_size=model_size, gpus=gpus,
                                         method=method if method in METHODS else None)
    own = preset(name).method
    method_set = method if method in METHODS and method != own else None
    if preset_name:
        return PresetChoice(name=name, why="as --preset names it", method_set=method_set)
    if gpu_memory_gib is None:
        why = f"the preset for GPUs of {LARGE_GPU_GIB} GB or more: the GPUs' memory is not known here"
    elif model_size == "1.5b" or gpu_memory_gib >= LARGE_GPU_GIB:
        kind = "the full fine-tune" if model_size == "7b" else "the fine-tune"
        size = f"GPUs of {LARGE_GPU_GIB} GB or more" if gpu_memory_gib >= LARGE_GPU_GIB else (
            f"GPUs of {gpu_memory_gib} GB (under {LARGE_GPU_GIB} GB)")
        why = f"{kind} of {model_size.upper()} for {size}"
    elif method in METHODS:
        why = f"{'the full fine-tune' if method == 'full' else 'LoRA'} of 7B, as --set method={method} asks"
    elif own == "full":
        why = f"the full fine-tune of 7B, sharded over the {gpus} GPUs of {gpu_memory_gib} GB"
    else:
        why = (f"LoRA, as a full fine-tune of 7B needs its state sharded over {FULL_7B_MIN_RANKS_24GB} or more "
               f"GPUs of {gpu_memory_gib} GB and {cluster} has {gpus or 0}")
    return PresetChoice(name=name, why=why, method_set=method_set)
