"""The memory model (workloads/sizing/memory.py) against what the loop really holds, on CPU.

- The terms sharding divides: in gloo processes at world size 1, 2 and 4, each rank's local shards of
  the weights, gradients and AdamW state, and each unit's all-gathered parameters, counted in bytes
  of their storage, equal the model's figures, for a full fine-tune in fp32 and in mixed precision
  and for LoRA.
- The activation inventory: the tensors autograd saves in a real Qwen2 decoder layer (saved-tensor
  hooks), in bf16 and fp32, equal the model's eager figures per token.
- The presets' targets: what the model predicts for them on the cluster they are for.
The compiled inventory and the whole peak are checked on a GPU (workloads/bench/memory_check.py,
docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.sizing.memory import (Architecture, MemorySettings, gradient_bytes, layer_activation_bytes_per_token,
                                     optimizer_bytes, predict, settings_for, unit_gathered_bytes, weight_bytes)
from workloads.client.cluster import free_port
from workloads.model_io.architectures import named_architecture
from workloads.train.config import preset, with_overrides

CONFIGS = {
    "full-fp32": [],
    "full-mp": ["mixed_precision=true"],
    "lora-mp": ["mixed_precision=true", "method=lora", "lora.rank=4"],
    "lora-some": ["method=lora", "lora.rank=3", 'lora.target_modules=["q_proj","down_proj"]'],
}


def config(name: str):
    return with_overrides(preset("demo-cpu"), ["micro_batch=2", *CONFIGS[name]])


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors (views of one buffer count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def worker(rank: int, world: int, port: int, root: Path) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from test_loop_lora import sharded
    from workloads.train.step import accumulate_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {}
        for name in CONFIGS:
            model, optimizer, sync, data = sharded(config(name), rank, world)
            accumulate_gradients(model, [next(data)], sync=sync)
            params = list(model.parameters())
            figures = {"weights": storage_bytes(local(p) for p in params),
                       "gradients": storage_bytes(local(p.grad) for p in params if p.grad is not None)}
            optimizer.step()
            figures["optimizer"] = storage_bytes(t.to_local() for state in optimizer.state.values()
                                                 for t in state.values() if isinstance(t, DTensor) and t.ndim)
            layer = next(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)
            for unit, key in ((layer, "layer"), (model, "root")):
                # What FSDP2 leaves out (a frozen base on one rank) is a plain tensor all along: a
                # gathered copy is a storage that only exists while the unit is unsharded.
                kept = {p.untyped_storage().data_ptr() for p in unit.parameters() if not isinstance(p, DTensor)}
                unit.unshard()
                figures[f"gathered_{key}"] = storage_bytes(p for p in unit.parameters() if not isinstance(p, DTensor)
                                                           and p.untyped_storage().data_ptr() not in kept)
                unit.reshard()
            out[name] = figures
        root.joinpath(f"w{world}-rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, list[dict]]:
    root = tmp_path_factory.mktemp("memory")
    result = {}
    for world in (1, 2, 4):
        run_ranks(worker, args=(world, free_port(), root), nprocs=world)
        result[world] = [json.loads((root / f"w{world}-rank{r}.json").read_text()) for r in range(world)]
    return result


TINY = Architecture.from_config(named_architecture("tiny-qwen2"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_ranks_shards_are_the_models_figures(measured, world, name):
    s = settings_for(config(name), shard_ranks=world, loss="chunked")
    want = {"weights": weight_bytes(TINY, s), "gradients": gradient_bytes(TINY, s),
            "gathered_layer": unit_gathered_bytes(TINY, s, "layer"),
            "gathered_root": unit_gathered_bytes(TINY, s, "root")}
    for rank, figures in enumerate(measured[world]):
        for term, value in want.items():
            assert figures[name][term] == value, (rank, term)
        # AdamW's moments are zeros_like each local shard: the largest shard (rank 0's) is the figure.
        optimizer = optimizer_bytes(TINY, s)
        assert figures[name]["optimizer"] == optimizer if rank == 0 else figures[name]["optimizer"] <= optimizer


def saved_bytes_per_token(arch: Architecture, *, dtype: torch.dtype, tokens: int = 256) -> float:
    """What autograd saves in one eager Qwen2 decoder layer's forward, per token (saved-tensor hooks;
    the weights and the rotary tables, shared by every layer, left out)."""
    from transformers import Qwen2ForCausalLM

    import workloads.train.attention  # noqa: F401  (registers the loop's `varlen` backend)

    config = named_architecture("tiny-qwen2")
    config.hidden_size, config.intermediate_size = arch.hidden_size, arch.intermediate_size
    config.num_attention_heads, config.num_key_value_heads = arch.heads, arch.kv_heads
    config.head_dim, config.num_hidden_layers, config._attn_implementation = arch.head_dim, 1, "varlen"
    lm = Qwen2ForCausalLM(config).to(dtype)
    x = torch.randn(1, tokens, arch.hidden_size, dtype=dtype, requires_grad=True)
    rotary = lm.model.rotary_emb(x, torch.arange(tokens)[None])
    skip = {t.untyped_storage().data_ptr() for t in (*lm.parameters(), *rotary)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm.model.layers[0](x, position_embeddings=rotary, attention_mask=None)
    return sum(saved.values()) / tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden, intermediate, heads, kv_heads", [(256, 512, 4, 2), (256, 1024, 4, 2),
                                                                   (512, 512, 8, 2), (256, 512, 4, 4)])
def test_the_eager_inventory_is_what_autograd_saves(dtype, hidden, intermediate, heads, kv_heads):
    arch = Architecture(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, layers=1, heads=heads,
                        kv_heads=kv_heads, head_dim=64, tied_embeddings=True)
    s = MemorySettings(shard_ranks=1, micro_batch=1, seq_len=256, compile=False,
                       mixed_precision=dtype == torch.bfloat16)
    assert saved_bytes_per_token(arch, dtype=dtype) == layer_activation_bytes_per_token(arch, s)


GIB = 2**30


@pytest.mark.parametrize("name, ranks, at_most_gib", [
    ("qwen2.5-7b-lora-24gb", 4, 21), ("qwen2.5-7b-24gb", 8, 21), ("qwen2.5-1.5b-24gb", 8, 21)])
def test_the_24gb_presets_fit_an_l4_by_the_model(name, ranks, at_most_gib):
    """The 7B presets' targets on the cluster each is for (one or two g6.12xlarge, flat FSDP)."""
    cfg = preset(name).for_world_size(ranks)  # the micro-steps of its rows per step on those ranks
    arch = Architecture.from_config(named_architecture("qwen2.5-7b" if "7b" in name else "qwen2.5-1.5b"))
    prediction = predict(arch, settings_for(cfg, shard_ranks=ranks))
    assert prediction.peak_bytes <= at_most_gib * GIB
    assert cfg.micro_batch * cfg.grad_accum_steps * ranks == 128


def test_checkpointing_lora_and_sharding_each_shrink_their_terms():
    arch = Architecture.from_config(named_architecture("qwen2.5-7b"))
    base = MemorySettings(shard_ranks=1, micro_batch=4, seq_len=2048)
    full = predict(arch, base)
    checkpointed = predict(arch, MemorySettings(**{**full.settings, "activation_checkpointing": True}))
    lora = predict(arch, MemorySettings(**{**full.settings, "method": "lora"}))
    eight = predict(arch, MemorySettings(**{**full.settings, "shard_ranks": 8}))
    assert checkpointed.terms["activations"] < full.terms["activations"] / 10
    assert lora.terms["optimizer"] < full.terms["optimizer"] / 100
    assert lora.terms["weights"] < full.terms["weights"] / 1.9
    assert eight.terms["weights"] == pytest.approx(full.terms["weights"] / 8, rel=1e-3)
    assert eight.terms["activations"] == full.terms["activations"]
    # 7B's untied embedding is a unit of its own, resharded after forward: only the lm_head stays gathered.
    assert unit_gathered_bytes(arch, base, "root") == (arch.vocab_size + 1) * arch.hidden_size * 2


def test_the_loss_term_holds_one_chunk_of_logits_as_liger_cuts_them():
    """liger-kernel 0.8.5's chunks: 512 tokens of a 16 x 2,048 micro-batch of Qwen2.5-1.5B by its default
    bound, 4,096 by the loop's; never more than the micro-batch; the term grows by the chunk's bf16 logits."""
    from workloads.sizing.memory import loss_bytes
    from workloads.train.loss_chunks import LIGER_CHUNK_MEM_CONST, liger_chunk_rows

    shape = dict(tokens=16 * 2048, hidden=1536, vocab=151_936)
    assert liger_chunk_rows(**shape, mem_const=1) == 512
    assert liger_chunk_rows(**shape) == 4096 and LIGER_CHUNK_MEM_CONST == 8
    assert liger_chunk_rows(tokens=1000, hidden=1536, vocab=151_936, mem_const=200) == 1000
    arch = Architecture.from_config(named_architecture("qwen2.5-1.5b"))
    ours = MemorySettings(shard_ranks=1, micro_batch=16, seq_len=2048)
    default = MemorySettings(**{**predict(arch, ours).settings, "liger_chunk_mem_const": 1})
    assert loss_bytes(arch, ours) - loss_bytes(arch, default) == (4096 - 512) * 151_936 * 2


def test_offloading_keeps_two_checkpointed_layer_inputs_on_the_device_and_the_rest_on_the_host():
    """Qwen2.5-7B LoRA at micro-batch 4 (the H100 comparison's shape): checkpointed, every layer's
    input stays (28 x 58.7 MB); offloaded, the layer in backward and the one brought back ahead of it."""
    from workloads.sizing.memory import activation_bytes, offloaded_host_bytes

    arch = Architecture.from_config(named_architecture("qwen2.5-7b"))
    checkpointed = MemorySettings(shard_ranks=1, micro_batch=4, seq_len=2048, method="lora",
                                  activation_checkpointing=True)
    offloaded = MemorySettings(**{**predict(arch, checkpointed).settings, "activation_offloading": True})
    layer_input = 4 * 2048 * arch.hidden_size * 2
    assert activation_bytes(arch, checkpointed) - activation_bytes(arch, offloaded) == (28 - 2) * layer_input
    assert offloaded_host_bytes(arch, offloaded) == 27 * layer_input and offloaded_host_bytes(arch, checkpointed) == 0
    assert predict(arch, checkpointed).peak_bytes - predict(arch, offloaded).peak_bytes == 26 * layer_input
    with pytest.raises(ValueError, match="needs activation_checkpointing"):
        MemorySettings(shard_ranks=1, micro_batch=1, seq_len=8, activation_offloading=True)
