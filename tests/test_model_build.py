"""Model construction and the FSDP2 layout applied to it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from workloads.train.config import ModelConfig
from workloads.train.loss import LinearCrossEntropy
from workloads.train.model import CausalLMWithLoss, build_causal_lm, named_architecture
from workloads.train.parallel import mixed_precision_policy, parallelize

CPU = torch.device("cpu")


def test_named_architectures_tie_the_embedding_and_use_qwen2_5_rope():
    big = named_architecture("qwen2.5-1.5b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (
        1536,
        28,
        12,
        2,
    )
    assert (big.intermediate_size, big.vocab_size, big.tie_word_embeddings) == (8960, 151936, True)
    assert big.rope_parameters["rope_theta"] == 1e6
    lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=CPU, seed=0)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in lm.parameters())


def test_the_same_seed_gives_the_same_weights_on_every_rank():
    a = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=CPU, seed=3)
    b = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=CPU, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_local_pretrained_folder_loads_with_from_pretrained(tmp_path):
    saved = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=CPU, seed=1)
    saved.save_pretrained(tmp_path / "model")
    loaded = build_causal_lm(ModelConfig(name_or_path=str(tmp_path / "model")), device=CPU, seed=99)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, p), q in zip(saved.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_mixed_precision_policy_is_bf16_compute_fp32_reduce():
    on = mixed_precision_policy(enabled=True)
    assert (on.param_dtype, on.reduce_dtype) == (torch.bfloat16, torch.float32)
    off = mixed_precision_policy(enabled=False)
    assert (off.param_dtype, off.reduce_dtype) == (None, None)


def test_fully_shard_wraps_each_decoder_layer_then_the_root(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=CPU, seed=0)
        model = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="chunked"))
        parallelize(
            model,
            mesh=init_device_mesh("cpu", (1,)),
            compile=False,
            mixed_precision=False,
            reshard_after_forward=True,
        )
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", "lm.model.layers.0", "lm.model.layers.1"]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        # The tied weight stays one parameter, owned by the root unit.
        assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    finally:
        dist.destroy_process_group()


def test_a_large_random_model_is_initialized_on_a_gpu_that_holds_it_twice_over_else_on_the_host():
    from workloads.train.model import init_device

    cuda, gib = torch.device("cuda", 0), 2**30
    qwen7b_fp32 = int(30.5 * gib)
    assert init_device(qwen7b_fp32, cuda, device_memory_bytes=80 * gib) == cuda  # H100: a second, not a minute
    assert init_device(qwen7b_fp32, cuda, device_memory_bytes=24 * gib) == torch.device("cpu")  # L4
    assert init_device(6 * gib, cuda, device_memory_bytes=24 * gib) == cuda  # Qwen2.5-1.5B fits any of them
    assert init_device(qwen7b_fp32, torch.device("cpu")) == torch.device("cpu")
