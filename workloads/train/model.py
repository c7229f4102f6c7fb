"""Build the causal LM: a named architecture with random weights, or a pretrained checkpoint.

The module trained is `CausalLMWithLoss`: it returns the loss from the final hidden states and the
(tied) output embedding, so that the full-vocabulary logits need never exist. Because the loss is
computed inside its forward, FSDP2's root unit gathers the embedding/lm_head weight for it and
reduces its gradient like any other.

A pretrained model is built with its parameters on the meta device (`causal_lm_on_meta`), sharded,
and only then filled from its safetensors files (`load_pretrained`), so no rank ever holds the whole
model (workloads/model_io/load.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen2ForCausalLM

from workloads.model_io.architectures import named_architecture
from workloads.model_io.load import LoadStats, file_name, fill_from_safetensors, materialize, parameters_on_meta
import workloads.train.attention  # noqa: F401  (registers the `varlen` attention backend)
from workloads.train.config import ModelConfig
from workloads.train.paths import resolve_path
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy

__all__ = ["named_architecture", "build_causal_lm", "causal_lm_on_meta", "load_pretrained", "model_config",
           "CausalLMWithLoss", "Shape", "shape_of"]


def model_config(cfg: ModelConfig, *, pretrained: Optional[Path] = None):
    """The transformers config to build: the named architecture's, or the pretrained folder's; with
    the attention backend asked for and no KV cache (training)."""
    if pretrained is None:
        config = named_architecture(cfg.name_or_path)
    else:  # transformers' own architectures only: a folder's code (auto_map) never runs in the job
        config = AutoConfig.from_pretrained(pretrained, trust_remote_code=False)
    config._attn_implementation = cfg.attn_implementation
    config.use_cache = False
    return config


HOST_INIT_BYTES = 8 * 2**30
"""A named architecture whose fp32 weights take more than this is built in host memory; FSDP2 then
moves each unit to the GPU as it shards it. Qwen2.5-7B's 30 GB would not fit a 24 GB GPU whole."""
DEVICE_INIT_SHARE = 0.5
"""...unless they take at most this share of the GPU's memory: Qwen2.5-7B's random init on an 80 GB
GPU takes a second there against 60-90 s on the host's cores (a benchmark builds it once per run)."""


def init_device(size_bytes: int, device: torch.device, *, device_memory_bytes: Optional[int] = None) -> torch.device:
    """Where a named architecture's fp32 weights of `size_bytes` are initialized: on `device` when
    small (HOST_INIT_BYTES) or when they take at most DEVICE_INIT_SHARE of its memory, else the host."""
    if device.type != "cuda" or size_bytes <= HOST_INIT_BYTES:
        return device
    if device_memory_bytes is None:
        device_memory_bytes = torch.cuda.get_device_properties(device).total_memory
    return device if size_bytes <= DEVICE_INIT_SHARE * device_memory_bytes else torch.device("cpu")


def build_causal_lm(cfg: ModelConfig, *, device: torch.device, seed: int) -> PreTrainedModel:
    """fp32 weights, identical on every rank (same seed) before sharding: on `device`, or in host
    memory for one large for the device (`init_device`). A local folder is loaded whole with `from_pretrained`
    (the reference benchmark; training uses `causal_lm_on_meta` + `load_pretrained`)."""
    torch.manual_seed(seed)
    if cfg.is_named_architecture:
        config = model_config(cfg)
        with torch.device("meta"):
            size = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters()) * 4
        with torch.device(init_device(size, device)):
            return Qwen2ForCausalLM(config)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_path(cfg.name_or_path, field="model.name_or_path", hub_id_allowed=True),
        dtype=torch.float32,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=False,
    )
    model.config.use_cache = False
    return model.to(device)


def causal_lm_on_meta(config) -> PreTrainedModel:
    """The model of `config` with its parameters on the meta device (no memory) and real buffers.
    It gets a copy of `config`: building in fp32 rewrites the config's dtype, which the caller still
    needs (the dtype the model was published in is the one it is exported in)."""
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)


def load_pretrained(lm: nn.Module, folder: Path, *, device: torch.device, name_in_files=file_name) -> LoadStats:
    """Allocate this rank's shards of the (sharded, meta) `lm` on `device` and fill them from the
    folder's safetensors files, each in its parameter's dtype (`name_in_files`: see
    `fill_from_safetensors`)."""
    materialize(lm, device=device)
    return fill_from_safetensors(lm, folder, name_in_files=name_in_files)


class CausalLMWithLoss(nn.Module):
    """`forward(input_ids, labels, position_ids=None, *, divisor=None, **attention) -> loss`: the sum
    of the next-token losses over the labels that are not ignored, divided by `divisor` (default:
    their count, so the mean). The training step passes the step's global label count instead, an
    integer tensor: FSDP2's mixed precision casts floating-point forward inputs to bf16.

    Packed rows carry position ids that restart with each sample and `attention` (the varlen
    attention's cu_seq_lens_q/k and max_length_q/k, workloads/train/attention.py), which keeps
    attention inside each sample."""

    def __init__(self, lm: PreTrainedModel, *, loss: LinearCrossEntropy) -> None:
        super().__init__()
        self.lm = lm
        self.loss = loss

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        *,
        divisor: Optional[torch.Tensor] = None,
        **attention,
    ) -> torch.Tensor:
        hidden = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        total = self.loss(hidden.flatten(0, 1), weight, labels.flatten())
        if divisor is None:
            divisor = (labels != IGNORE_INDEX).sum().clamp(min=1)
        assert not divisor.is_floating_point(), "a count: a float one would reach here rounded to bf16"
        return total / divisor


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the FLOPs formula needs: parameters (tied weights once), layers, heads, head dim."""

    n_params: int
    n_layers: int
    n_heads: int
    head_dim: int
    vocab_size: int


def shape_of(lm: PreTrainedModel) -> Shape:
    c = lm.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return Shape(
        n_params=sum(p.numel() for p in lm.parameters()),  # parameters() yields a tied weight once
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        head_dim=head_dim,
        vocab_size=c.vocab_size,
    )
