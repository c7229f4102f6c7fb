"""Apply per-block torch.compile and FSDP2 to the model, in one fixed order.

Order (as torchtitan's parallelize): compile each decoder layer, then `fully_shard` each decoder
layer, then `fully_shard` the root. The root unit owns what is left: the embedding, the final norm
and the lm_head, which Qwen2.5 ties to the embedding, so the tied weight is one parameter of one
unit, gathered once for both uses and its two gradient contributions summed before the
reduce-scatter.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from workloads.train.model import CausalLMWithLoss


def mixed_precision_policy(*, enabled: bool) -> MixedPrecisionPolicy:
    """bf16 compute on bf16 copies of the fp32 master weights, gradients reduced in fp32."""
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(
    model: CausalLMWithLoss,
    *,
    mesh: DeviceMesh,
    compile: bool,
    mixed_precision: bool,
    reshard_after_forward: bool,
) -> CausalLMWithLoss:
    layers = model.decoder_layers
    if compile:
        for name, layer in list(layers.named_children()):
            layers.register_module(name, torch.compile(layer))
    mp = mixed_precision_policy(enabled=mixed_precision)
    blocks = list(layers.children())
    for i, block in enumerate(blocks):
        # Backward starts with the last layer, so resharding it after forward only to gather it
        # again at once would be wasted work.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last)
    # The root's parameters (embedding, norm, lm_head) are needed again by the loss at the very
    # start of backward, so they stay gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model
