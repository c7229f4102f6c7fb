"""Build the causal LM: a named architecture with random weights, or a pretrained checkpoint.

The module trained is `CausalLMWithLoss`: it returns the loss from the final hidden states and the
(tied) output embedding, so that the full-vocabulary logits need never exist. Because the loss is
computed inside its forward, FSDP2's root unit gathers the embedding/lm_head weight for it and
reduces its gradient like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from workloads.train.config import ModelConfig
from workloads.train.paths import resolve_path
from workloads.train.loss import LinearCrossEntropy


def named_architecture(name: str) -> Qwen2Config:
    common = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_cache=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    if name == "tiny-qwen2":
        return Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            **common,
        )
    if name == "qwen2.5-1.5b":
        return Qwen2Config(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            **common,
        )
    raise ValueError(f"unknown architecture {name!r}")


def build_causal_lm(cfg: ModelConfig, *, device: torch.device, seed: int) -> PreTrainedModel:
    """fp32 weights on `device`, identical on every rank (same seed) before sharding."""
    torch.manual_seed(seed)
    if cfg.is_named_architecture:
        config = named_architecture(cfg.name_or_path)
        config._attn_implementation = cfg.attn_implementation
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_path(cfg.name_or_path, field="model.name_or_path", hub_id_allowed=True),
        dtype=torch.float32,
        attn_implementation=cfg.attn_implementation,
    )
    model.config.use_cache = False
    return model.to(device)


class CausalLMWithLoss(nn.Module):
    """`forward(input_ids, labels) -> mean next-token loss` over an HF causal LM."""

    def __init__(self, lm: PreTrainedModel, *, loss: LinearCrossEntropy) -> None:
        super().__init__()
        self.lm = lm
        self.loss = loss

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        return self.loss(hidden.flatten(0, 1), weight, labels.flatten())


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
