"""FLOPs per token, MFU and tokens/s, each against a figure found another way: the model's own
matmuls counted by torch's FLOP counter, published parameter counts, and hand arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2ForCausalLM

from workloads.train.data import Batch, Sample
from workloads.train.loop import Throughput
from workloads.train.metrics import (H100_BF16_DENSE_FLOPS, device_mfu, flops_per_token, mfu, peak_memory_gib,
                                     tokens_per_s)
from workloads.train.model import named_architecture, shape_of

SEQ_LEN = 2048


@pytest.fixture(scope="module")
def qwen_1_5b():
    config = named_architecture("qwen2.5-1.5b")
    config._attn_implementation = "eager"  # attention as plain matmuls, which the counter sees
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def qwen_1_5b_shape(qwen_1_5b):
    return shape_of(qwen_1_5b)


def test_qwen2_5_1_5b_shape_counts_the_tied_embedding_once(qwen_1_5b_shape):
    s = qwen_1_5b_shape
    assert (s.n_layers, s.n_heads, s.head_dim, s.vocab_size) == (28, 12, 128, 151936)
    # Qwen2.5-1.5B's published parameter count (tied embedding counted once).
    assert s.n_params == 1_543_714_304


def test_flops_per_token_is_what_the_models_matmuls_do(qwen_1_5b, qwen_1_5b_shape):
    """One forward and backward of the real architecture on meta tensors (shapes only, no memory),
    its matmuls counted by torch.utils.flop_counter. Eager attention computes the full T x T score
    matrix, as the formula's 12*L*H*Q*T term assumes."""
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta")
    full_mask = torch.zeros(1, 1, SEQ_LEN, SEQ_LEN, device="meta")  # additive: nothing masked
    with FlopCounterMode(display=False) as counter:
        qwen_1_5b(input_ids=ids, labels=ids, attention_mask=full_mask, use_cache=False).loss.backward()
    counted = counter.get_total_flops() / SEQ_LEN
    s = qwen_1_5b_shape
    formula = flops_per_token(
        n_params=s.n_params, n_layers=s.n_layers, n_heads=s.n_heads, head_dim=s.head_dim, seq_len=SEQ_LEN
    )
    # The formula's 6N also counts the norm weights and biases, which take part in no matmul.
    not_in_a_matmul = sum(p.numel() for p in qwen_1_5b.parameters() if p.ndim < 2)
    # Two norms a layer, the final norm, the q/k/v biases.
    assert not_in_a_matmul == 28 * 2 * 1536 + 1536 + 28 * (1536 + 256 + 256)
    assert formula - counted == 6 * not_in_a_matmul
    assert round(formula / 1e9, 2) == 10.32  # the figure DESIGN.md quotes at T=2048


def test_mfu_of_the_measured_fsdp2_run():
    # DESIGN.md: 39,933 tokens/s/GPU at 10.32 GFLOP/token is 41.7% of 989 TFLOP/s.
    assert (
        round(mfu(tokens_per_s=39_933, flops_per_token=10.32e9, peak_flops=H100_BF16_DENSE_FLOPS), 3) == 0.417
    )


def test_mfu_is_reported_on_a_cuda_device():
    # 39,933 tokens/s x 10.32 GFLOP = 412.1 TFLOP/s, 41.67% of 989 TFLOP/s. The device object is all
    # that is looked at, so no GPU is needed to build one.
    cuda = torch.device("cuda", 0)
    assert device_mfu(cuda, tokens_per_s=39_933, flops_per_token=10.32e9, peak_flops=989e12) == 0.4167
    assert device_mfu(torch.device("cpu"), tokens_per_s=39_933, flops_per_token=10.32e9, peak_flops=989e12) is None


def test_tokens_per_s():
    assert tokens_per_s(tokens=10 * 16 * 2048, seconds=8.0) == 40_960.0
    assert tokens_per_s(tokens=1000, seconds=0.5) == 2_000.0  # a window under 1 s
    assert tokens_per_s(tokens=0, seconds=0.0) == 0.0


def test_peak_memory_on_cpu_is_the_resident_set():
    assert 0.001 < peak_memory_gib(torch.device("cpu")) < 1024


def test_peak_memory_units(monkeypatch):
    # CUDA reports bytes; Linux's ru_maxrss is in KiB, macOS's in bytes.
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: {"cuda:1": 3 * 2**30}[str(device)])
    assert peak_memory_gib(torch.device("cuda", 1)) == 3.0
    usage = type("Usage", (), {"ru_maxrss": 2 * 2**30})()
    monkeypatch.setattr("workloads.train.metrics.resource.getrusage", lambda who: usage)
    monkeypatch.setattr("workloads.train.metrics.sys.platform", "linux")
    assert peak_memory_gib(torch.device("cpu")) == 2 * 2**10
    monkeypatch.setattr("workloads.train.metrics.sys.platform", "darwin")
    assert peak_memory_gib(torch.device("cpu")) == 2.0


def test_the_throughput_mean_leaves_out_the_warm_up_window():
    throughput = Throughput(windows=[1_000.0, 40_000.0, 42_000.0])  # the first one compiled
    assert throughput.mean() == 41_000.0
    assert Throughput(windows=[3_000.0]).mean() == 3_000.0  # a run with one window has only that
    assert Throughput().mean() is None


def test_a_throughput_window_counts_example_tokens_not_padding(monkeypatch):
    monkeypatch.setattr("workloads.train.loop.time.perf_counter", lambda: 102.0)
    throughput = Throughput(started=100.0)
    ids = torch.zeros(8, 2048, dtype=torch.int64)
    # Two steps of two micro-batches of 8 rows; the packed ones hold 15,000 example positions of 16,384.
    for _ in range(2):
        throughput.add([Batch(input_ids=ids, labels=ids, example_tokens=8 * 2048),
                        Batch(input_ids=ids, labels=ids, example_tokens=15_000)])
    assert throughput.close_window() == 2 * (8 * 2048 + 15_000) / 2.0
    assert throughput.close_window(tokens=1_000.0) == 500.0  # the mean over ranks, when the loop has it
    assert throughput.padding_share() == round(1 - (8 * 2048 + 15_000) / (2 * 8 * 2048), 4)
    throughput.restart()
    assert throughput.tokens == 0
    assert throughput.padding_share() == round(1 - (8 * 2048 + 15_000) / (2 * 8 * 2048), 4)  # over the run


def test_a_batch_counts_its_example_tokens_and_finds_its_sequences():
    packed = [Sample(input_ids=torch.zeros(6, dtype=torch.int64), labels=torch.zeros(6, dtype=torch.int64),
                     position_ids=torch.tensor(p), example_tokens=n)
              for p, n in (([0, 1, 2, 3, 0, 1], 6), ([0, 1, 2, 0, 1, 2], 3))]
    batch = Batch.stack(packed)
    assert batch.example_tokens == 9
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 9, 12]
    assert batch.attention()["max_length_q"] == 6
    synthetic = Batch.stack([Sample(input_ids=torch.zeros(6, dtype=torch.int64), labels=torch.zeros(6))] * 3)
    assert (synthetic.example_tokens, synthetic.cu_seqlens, synthetic.attention()) == (18, None, {})
