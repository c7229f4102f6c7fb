"""FLOPs per token, MFU and tokens/s."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from workloads.train.metrics import H100_BF16_DENSE_FLOPS, flops_per_token, mfu, peak_memory_gib, tokens_per_s
from workloads.train.model import named_architecture, shape_of


@pytest.fixture(scope="module")
def qwen_1_5b_shape():
    with torch.device("meta"):
        lm = Qwen2ForCausalLM(named_architecture("qwen2.5-1.5b"))
    return shape_of(lm)


def test_qwen2_5_1_5b_shape_counts_the_tied_embedding_once(qwen_1_5b_shape):
    s = qwen_1_5b_shape
    assert (s.n_layers, s.n_heads, s.head_dim, s.vocab_size) == (28, 12, 128, 151936)
    # Qwen2.5-1.5B's published parameter count (tied embedding counted once).
    assert s.n_params == 1_543_714_304


def test_flops_per_token_at_2048_is_10_32_gflop(qwen_1_5b_shape):
    s = qwen_1_5b_shape
    f = flops_per_token(
        n_params=s.n_params, n_layers=s.n_layers, n_heads=s.n_heads, head_dim=s.head_dim, seq_len=2048
    )
    assert f == 6 * 1_543_714_304 + 12 * 28 * 12 * 128 * 2048
    assert round(f / 1e9, 2) == 10.32


def test_mfu_of_the_measured_fsdp2_run():
    # DESIGN.md: 39,933 tokens/s/GPU at 10.32 GFLOP/token is 41.7% of 989 TFLOP/s.
    assert (
        round(mfu(tokens_per_s=39_933, flops_per_token=10.32e9, peak_flops=H100_BF16_DENSE_FLOPS), 3) == 0.417
    )


def test_tokens_per_s():
    assert tokens_per_s(steps=10, micro_batch=16, seq_len=2048, seconds=8.0) == 40_960.0
    assert tokens_per_s(steps=0, micro_batch=16, seq_len=2048, seconds=0.0) == 0.0


def test_peak_memory_on_cpu_is_the_resident_set():
    assert 0.001 < peak_memory_gib(torch.device("cpu")) < 1024
