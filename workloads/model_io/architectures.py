"""Architectures known by name: built from a config (random weights, no download)."""

from __future__ import annotations

NAMED_ARCHITECTURES = ("tiny-qwen2", "qwen2.5-1.5b", "qwen2.5-7b")
""""tiny-qwen2" for CPU runs, "qwen2.5-1.5b" and "qwen2.5-7b" for the shapes of Qwen2.5-1.5B and
Qwen2.5-7B (their config.json on the hub: 7B has untied input and output embeddings)."""


def named_architecture(name: str, *, vocab_size: int | None = None):
    """The Qwen2Config of a named architecture (optionally with another vocabulary size)."""
    from transformers import Qwen2Config

    common = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        use_cache=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    if name == "tiny-qwen2":
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     tie_word_embeddings=True)
    elif name == "qwen2.5-1.5b":
        shape = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                     tie_word_embeddings=True)
    elif name == "qwen2.5-7b":
        shape = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                     tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown architecture {name!r}: use one of {', '.join(NAMED_ARCHITECTURES)}")
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    return Qwen2Config(**shape, **common)
