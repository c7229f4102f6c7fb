"""The fine-tuning method, as one object the loop calls: which parameters train, what FSDP2 keeps in
fp32, what the optimizer holds, what a checkpoint stores and what the export writes.

- `FullFineTune`: every parameter trains. FSDP2 shards fp32 master weights (bf16 copies for compute
  under mixed precision), AdamW holds two fp32 moments per weight, a checkpoint holds all of them,
  and the export is the model.
- `LoraFineTune`: peft's LoRA adapters on the decoder's linear layers train, nothing else. The base
  weights are frozen and, under mixed precision, stored in bf16 (FSDP2 shards them as they are: no
  fp32 master copy, no gradient, no optimizer state); the adapters are fp32 parameters that FSDP2
  casts to bf16 for compute like any other. A checkpoint holds the adapters and their optimizer
  state only; the export is the model with the adapters merged into its weights (a Hugging Face
  folder), plus the adapter in peft's own format in its `adapter/` subfolder.

The loop calls, in order: `adapt` (before sharding), `fill_adapters` (after the base's weights were
loaded into the shards, for a model built on the meta device), `saves_frozen` (checkpoints) and
`write_export` (the final checkpoint's model).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterator, Optional, Protocol

import torch
from torch import nn

from workloads.model_io.export import (
    gathered,
    named_tensors,
    write_tensors,
    write_weights_from_shards,
)
from workloads.model_io.hf_writer import SafetensorsWriter
from workloads.model_io.load import file_name, fill_from_tensors, tensor_aliases
# ADAPTER_DIR: the peft adapter folder inside an exported LoRA model folder (`PeftModel.from_pretrained(
# base, model/adapter)`); a subfolder, so that `from_pretrained(model)` loads the merged weights alone.
from workloads.model_io.run_layout import ADAPTER_DIR, ADAPTER_WEIGHTS
from workloads.train.config import LoraSettings, TrainConfig

ADAPTER_NAME = "default"
"""peft's name for the one adapter (it appears in parameter names: `lora_A.default.weight`)."""
BASE_LAYER = ".base_layer"
"""What peft adds to the path of a wrapped linear layer's own weight and bias."""
STACKED_NAME = "stacked"
"""peft's name for an adapter stacked beneath the trained one (`lora.stacked_adapter`), kept frozen."""


class FineTuneMethod(Protocol):
    name: str

    def adapt(self, lm: nn.Module, *, mixed_precision: bool, seed: int) -> None:
        """Change the (unsharded, possibly meta) model in place before FSDP2 shards it."""

    def fill_adapters(self, lm: nn.Module) -> None:
        """After the pretrained weights were loaded into the shards: fill what the files lack."""

    saves_frozen: bool
    """Whether a checkpoint holds the frozen parameters too (else the trained ones only)."""

    def weight_file_name(self, name: str) -> Optional[str]:
        """The name a parameter has in a Hugging Face weight file, or None when it has none."""

    def write_metadata(self, folder: Path) -> None:
        """What every checkpoint's `model/` folder holds of the method (rank 0; LoRA: its adapter
        config, so that any checkpoint can be exported)."""

    def write_export(self, lm: nn.Module, folder: Path, *, dtype: torch.dtype, writer_rank: bool) -> int:
        """Gather the sharded model and write its Hugging Face weights into `folder` (a collective)."""

    def describe(self) -> dict:
        """For the run's summary and tracker."""

    def untrained(self, lm: nn.Module) -> Optional[ContextManager]:
        """A context in which `lm` computes as the model training started from, without a copy of
        it (a preference objective's reference: workloads/train/reference.py); None where the
        method has none (a full fine-tune changes every weight: its reference is a copy)."""


@dataclass(frozen=True)
class FullFineTune:
    name: str = "full"
    saves_frozen: bool = True

    def adapt(self, lm: nn.Module, *, mixed_precision: bool, seed: int) -> None:
        return None

    def fill_adapters(self, lm: nn.Module) -> None:
        return None

    def weight_file_name(self, name: str) -> Optional[str]:
        return file_name(name)

    def write_metadata(self, folder: Path) -> None:
        return None

    def write_export(self, lm: nn.Module, folder: Path, *, dtype: torch.dtype, writer_rank: bool) -> int:
        return write_weights_from_shards(lm, folder, dtype=dtype, writer_rank=writer_rank)

    def describe(self) -> dict:
        return {"method": self.name}

    def untrained(self, lm: nn.Module) -> Optional[ContextManager]:
        return None


def decoder_linear_names(lm: nn.Module) -> list[str]:
    """The distinct last path components of the linear modules inside the decoder layers."""
    layers = lm.get_decoder().layers
    return sorted({name.rpartition(".")[2] for name, module in layers.named_modules()
                   if isinstance(module, nn.Linear) and name})


def resolve_target_modules(lm: nn.Module, requested: tuple[str, ...]) -> list[str]:
    """The target module names for `lora.target_modules` (empty: every decoder linear); ValueError,
    naming the model's linear modules, for a name that matches none of them."""
    available = decoder_linear_names(lm)
    if not requested:
        return available
    missing = [m for m in requested if m not in available]
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} match no linear module of the model's decoder layers; it has "
            f"{', '.join(available)} (or set lora.target_modules=[] for all of them)")
    return sorted(set(requested))


@dataclass
class LoraFineTune:
    settings: LoraSettings
    base_model: str = ""
    """The base's name or path and revision, recorded in the adapter's config."""
    base_revision: str = ""
    name: str = "lora"
    saves_frozen: bool = False
    """The frozen base comes from its source on every start (and with the same seed, for a named
    architecture's random weights)."""
    initial: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    """Adapter values made by `adapt` for a model on the meta device, to fill its shards with."""
    targets: list[str] = dataclasses.field(default_factory=list)
    """The adapted module names, resolved against the model by `adapt`."""
    stacked: Optional[Path] = None
    """The local folder of a peft adapter stacked beneath the trained one (an SFT run's), frozen: the
    model computes W + its delta + the trained adapters' delta; its reference (`untrained`) is W +
    its delta."""

    def peft_config(self, target_modules: list[str]):
        from peft import LoraConfig

        return LoraConfig(r=self.settings.rank, lora_alpha=self.settings.alpha, lora_dropout=self.settings.dropout,
                          target_modules=target_modules, bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=self.base_model or None, revision=self.base_revision or None)

    def adapt(self, lm: nn.Module, *, mixed_precision: bool, seed: int) -> None:
        """Inject the adapters (peft freezes every other parameter). On a model built on the meta
        device the adapters are made on the CPU at once, initialized as peft initializes them (A
        as nn.Linear's default, B zero), so every rank starts from the same adapters; their values
        are kept to refill the shards after loading (`fill_adapters`)."""
        from peft import inject_adapter_in_model

        self.targets = resolve_target_modules(lm, self.settings.target_modules)
        torch.manual_seed(seed)
        inject_adapter_in_model(self.peft_config(self.targets), lm, adapter_name=ADAPTER_NAME)
        self.initial.clear()
        for module_name, module in lm.named_modules():
            if not hasattr(module, "reset_lora_parameters"):
                continue
            adapters = (module.lora_A[ADAPTER_NAME], module.lora_B[ADAPTER_NAME])
            if adapters[0].weight.is_meta:
                for adapter in adapters:
                    adapter.to_empty(device="cpu")
                module.reset_lora_parameters(ADAPTER_NAME, True)
                for part, adapter in zip(("lora_A", "lora_B"), adapters):
                    self.initial[f"{module_name}.{part}.{ADAPTER_NAME}.weight"] = adapter.weight.detach().clone()
        if self.stacked is not None:
            self._stack(lm)
        if mixed_precision:
            # The frozen base computes in bf16 anyway (FSDP2's param dtype): keeping it in bf16 halves
            # its memory and leaves nothing for FSDP2 to cast. Tied weights are one parameter.
            for param in lm.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)

    def _stack(self, lm: nn.Module) -> None:
        """Inject the stacked adapter as peft saved it, with its values, active beneath the trained
        one and frozen (its values kept with `initial` for a model on the meta device)."""
        from peft import LoraConfig, inject_adapter_in_model
        from safetensors.torch import load_file

        inject_adapter_in_model(LoraConfig.from_pretrained(str(self.stacked)), lm, adapter_name=STACKED_NAME)
        saved = {}
        for key, value in load_file(str(self.stacked / ADAPTER_WEIGHTS)).items():
            # peft's names: base_model.model.<module>.lora_A.weight
            module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
            saved[f"{module}.lora_{part.removesuffix('.weight')}.{STACKED_NAME}.weight"] = value
        for module_name, module in lm.named_modules():
            if STACKED_NAME not in getattr(module, "lora_A", {}):
                continue
            for part in ("lora_A", "lora_B"):
                adapter, name = getattr(module, part)[STACKED_NAME], f"{module_name}.{part}.{STACKED_NAME}.weight"
                if name not in saved:
                    raise ValueError(f"lora.stacked_adapter {self.stacked}: {ADAPTER_WEIGHTS} holds no tensor for "
                                     f"{name.replace(f'.{STACKED_NAME}.', '.')}: it is not this model's adapter")
                if adapter.weight.is_meta:
                    adapter.to_empty(device="cpu")
                    self.initial[name] = saved[name]
                with torch.no_grad():
                    adapter.weight.copy_(saved[name])
            module._active_adapter = [ADAPTER_NAME, STACKED_NAME]
        for name, param in lm.named_parameters():
            param.requires_grad_(f".{ADAPTER_NAME}." in name)

    def fill_adapters(self, lm: nn.Module) -> None:
        if self.initial:
            fill_from_tensors(lm, self.initial)

    def weight_file_name(self, name: str) -> Optional[str]:
        if ".lora_" in name:
            return None
        return file_name(name).replace(BASE_LAYER + ".", ".")

    def write_metadata(self, folder: Path) -> None:
        self.peft_config(self.targets).save_pretrained(str(folder / ADAPTER_DIR))

    def _merged(self, lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The base's tensors under their Hugging Face names, each adapted weight W replaced by
        W + scaling * B A (peft's `get_delta_weight` without fan_in_fan_out), computed in fp32."""
        adapted = {name: module for name, module in lm.named_modules() if hasattr(module, "lora_A")}
        state = named_tensors(lm)
        for name in tensor_aliases(lm):
            out_name = self.weight_file_name(name)
            if out_name is None:
                continue
            full = gathered(state[name])
            owner, _, leaf = name.rpartition(".")
            module = adapted.get(owner.removesuffix(BASE_LAYER)) if owner.endswith(BASE_LAYER) else None
            if module is not None and leaf == "weight":
                full = full.float()
                for adapter in module.lora_A:  # the trained adapter, and one stacked beneath it
                    a = gathered(module.lora_A[adapter].weight).float()
                    b = gathered(module.lora_B[adapter].weight).float()
                    full = full + (b @ a) * module.scaling[adapter]
            yield out_name, full

    def adapter_tensors(self, lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters, gathered, under the names peft's `save_pretrained` gives them."""
        state = named_tensors(lm)
        for name in tensor_aliases(lm):
            if ".lora_" in name and f".{ADAPTER_NAME}." in name:
                peft_name = file_name(name).replace(f".{ADAPTER_NAME}.", ".")
                yield f"base_model.model.{peft_name}", gathered(state[name])

    def write_export(self, lm: nn.Module, folder: Path, *, dtype: torch.dtype, writer_rank: bool) -> int:
        written = write_tensors(self._merged(lm), SafetensorsWriter(folder) if writer_rank else None, dtype=dtype)
        adapter_dir = folder / ADAPTER_DIR
        # The adapters are small (160 MB for a 7B model at rank 16), in fp32 as trained, in one file.
        adapter_writer = (SafetensorsWriter(adapter_dir, max_shard_bytes=2**62, file_name=ADAPTER_WEIGHTS)
                          if writer_rank else None)
        written += write_tensors(self.adapter_tensors(lm), adapter_writer, dtype=torch.float32)
        if writer_rank:
            self.write_metadata(folder)
        return written

    def describe(self) -> dict:
        return {"method": self.name, "lora": dataclasses.asdict(self.settings)}

    def untrained(self, lm: nn.Module) -> ContextManager:
        """The trained adapters switched off: each adapted layer computes its base layer alone, or
        with the stacked adapter beneath. peft's own switches (`enable_adapters`, `set_adapter`) also
        set the adapters' requires_grad, which FSDP2 fixed when it sharded them, so the layers'
        flags are set directly."""
        return _adapters_off(lm, keep=STACKED_NAME if self.stacked is not None else None)


@contextlib.contextmanager
def _adapters_off(lm: nn.Module, *, keep: Optional[str] = None) -> Iterator[None]:
    layers = [module for module in lm.modules() if hasattr(module, "lora_A")]
    active = [layer._active_adapter for layer in layers]
    for layer in layers:
        if keep is None:
            layer._disable_adapters = True
        else:
            layer._active_adapter = [keep]
    try:
        yield
    finally:
        for layer, adapters in zip(layers, active):
            layer._disable_adapters = False
            layer._active_adapter = adapters


def method_for(cfg: TrainConfig) -> FineTuneMethod:
    if cfg.method == "lora":
        stacked = None
        if cfg.lora.stacked_adapter:
            from workloads.model_io.run_model import fetch_adapter
            from workloads.train.paths import resolve_path

            # hub_id_allowed: an s3:// URI passes through (a folder uploaded with the job is found).
            spec = resolve_path(cfg.lora.stacked_adapter, field="lora.stacked_adapter", hub_id_allowed=True)
            stacked = fetch_adapter(spec, cache_dir=cfg.cache_dir)
        return LoraFineTune(settings=cfg.lora, base_model=cfg.model.name_or_path, base_revision=cfg.model.revision,
                            stacked=stacked)
    return FullFineTune()


def trainable_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
