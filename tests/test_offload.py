"""Activation offloading (workloads/train/offload.py) on the CPU: which saved tensors qualify, the
order of the copies out and back, and that the loss and gradients are bit for bit those without it.

No CUDA here, so the offloader runs with the CPU standing in for the device and a copier that clones
(what CudaCopier does with streams and pinned buffers, minus the streams): the bookkeeping, the
prefetch order and the exactness are the real ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from workloads.train import offload
from workloads.train.config import ModelConfig, preset, with_overrides
from workloads.train.loss import LinearCrossEntropy
from workloads.train.model import CausalLMWithLoss, build_causal_lm
from workloads.train.offload import ActivationOffloader, next_prefetch, qualifies


class CloningCopier:
    """Copies by cloning, synchronously; counts what each side of a stream copier would do."""

    def __init__(self) -> None:
        self.to_host_bytes = 0
        self.to_device_bytes = 0
        self.released: list[int] = []
        self.waited: list[int] = []
        self._tokens = 0

    def to_host(self, tensor):
        self.to_host_bytes += tensor.numel() * tensor.element_size()
        self._tokens += 1
        return tensor.detach().clone(), self._tokens

    def release_device(self, token):
        self.released.append(token)

    def to_device(self, host):
        self.to_device_bytes += host.numel() * host.element_size()
        return host.clone()

    def mark_fetched(self):
        self._tokens += 1
        return self._tokens

    def wait_ready(self, token):
        self.waited.append(token)


def test_only_large_activations_on_the_device_qualify_never_parameters_or_their_views():
    big = torch.zeros(256, 1024)  # 1 MiB in fp32
    weight = nn.Parameter(torch.zeros(512, 1024))
    storages = {weight.untyped_storage().data_ptr()}

    def judged(tensor, *, device_type="cpu", min_bytes=offload.MIN_OFFLOAD_BYTES):
        return qualifies(tensor, device_type=device_type, min_bytes=min_bytes, parameter_storages=storages)

    assert judged(big)
    assert not judged(big[:-1])  # one row under the threshold
    assert not judged(big, device_type="cuda")  # not on the accelerator the offloader serves
    assert not judged(weight)
    assert not judged(weight.detach()) and not judged(weight.view(-1)) and not judged(weight.t())
    assert judged(torch.zeros(4, 4), min_bytes=64)


def test_backward_brings_back_the_nearest_earlier_layer_still_on_the_host():
    assert next_prefetch([0, 1, 2], current=3) == 2
    assert next_prefetch([0, 1], current=2) == 1
    assert next_prefetch([0, 2], current=2) == 0  # a layer's own group is fetched on demand, not prefetched
    assert next_prefetch([], current=5) is None
    assert next_prefetch([4], current=3) is None  # nothing before it: backward is done with the earlier ones


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def blocks_loss(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x.pow(2).mean()


def checkpointed(width: int, layers: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(checkpoint_wrapper(Block(width), preserve_rng_state=False) for _ in range(layers))


def test_each_layer_but_the_last_goes_out_in_forward_and_comes_back_one_layer_ahead_in_backward():
    width, layers, tokens = 64, 4, 1024  # a layer's input: 256 KiB in fp32
    events: list[tuple[str, int]] = []
    copier = CloningCopier()
    blocks = checkpointed(width, layers)
    offloader = ActivationOffloader(layers=layers, copier=copier, device_type="cpu", min_bytes=64 * 1024,
                                    events=events)
    offload.attach(offloader, list(blocks))
    x = torch.randn(tokens, width, requires_grad=True)
    loss = blocks_loss(blocks, x)
    assert events == [("offload", 0), ("offload", 1), ("offload", 2)]
    loss.backward()
    # The last layer's input stayed; its unpack starts layer 2's copy back, layer 2's starts layer 1's...
    assert events[3:] == [("fetch", 2), ("unpack", 2), ("fetch", 1), ("unpack", 1), ("fetch", 0), ("unpack", 0)]
    # Nothing is held once backward is done, and what went out came back, once.
    assert offloader.groups == {}
    layer_input = tokens * width * 4
    assert copier.to_host_bytes == copier.to_device_bytes == 3 * layer_input
    # Every copy out was waited on before its device memory was let go; each group's copies back once.
    assert len(copier.released) == 3 and len(copier.waited) == 3


def test_offloading_leaves_the_loss_and_gradients_bit_for_bit_unchanged_with_accumulation():
    width, layers = 64, 4
    plain, offloaded = checkpointed(width, layers), checkpointed(width, layers)
    offload.attach(ActivationOffloader(layers=layers, copier=CloningCopier(), device_type="cpu", min_bytes=1),
                   list(offloaded))
    torch.manual_seed(1)
    micro_batches = [torch.randn(512, width) for _ in range(2)]
    losses = {}
    for name, blocks in (("plain", plain), ("offloaded", offloaded)):
        losses[name] = [blocks_loss(blocks, x).detach() for x in micro_batches for _ in [None]]
        for x in micro_batches:  # two micro-steps accumulate into the same gradients
            blocks_loss(blocks, x).backward()
    assert all(torch.equal(a, b) for a, b in zip(losses["plain"], losses["offloaded"]))
    for (name, p), (_, q) in zip(plain.named_parameters(), offloaded.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_qwen2_model_gives_the_same_loss_and_gradients_with_its_layers_offloaded():
    """The tiny Qwen2 architecture, each decoder layer checkpointed, with and without offloading;
    an evaluation (no gradient) between the steps leaves nothing behind."""
    cfg = with_overrides(preset("demo-cpu"), ["model.activation_checkpointing=true"])
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 64))
    results = []
    for offloaded in (False, True):
        lm = build_causal_lm(cfg.model, device=torch.device("cpu"), seed=0)
        model = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="chunked", chunk_size=32))
        layers = model.decoder_layers
        for name, layer in list(layers.named_children()):
            layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
        copier = CloningCopier()
        if offloaded:
            offload.attach(ActivationOffloader(layers=len(layers), copier=copier, device_type="cpu", min_bytes=1),
                           list(layers.children()))
        loss = model(tokens, tokens)
        loss.backward()
        with torch.no_grad():
            model(tokens, tokens)
        loss2 = model(tokens.flip(1), tokens.flip(1))
        loss2.backward()
        results.append((loss.detach(), loss2.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                        copier.to_host_bytes))
    (loss_a, loss2_a, grads_a, moved_a), (loss_b, loss2_b, grads_b, moved_b) = results
    assert moved_a == 0 and moved_b > 0
    assert torch.equal(loss_a, loss_b) and torch.equal(loss2_a, loss2_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_on_the_cpu_nothing_is_installed():
    blocks = checkpointed(8, 2)
    assert offload.install(list(blocks), device_type="cpu") is None
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in blocks)


def test_offloading_needs_checkpointing():
    with pytest.raises(ValueError, match="model.activation_checkpointing=true"):
        ModelConfig(activation_offloading=True)
    assert ModelConfig(activation_checkpointing=True, activation_offloading=True).activation_offloading
    cfg = with_overrides(preset("qwen2.5-7b-24gb"), ["model.activation_offloading=true"])
    assert dataclasses.replace(cfg).model.activation_offloading


def test_turning_checkpointing_off_turns_offloading_off_unless_set():
    cfg = preset("qwen2.5-7b-24gb")
    assert cfg.model.activation_offloading
    off = with_overrides(cfg, ["model.activation_checkpointing=false"])
    assert not off.model.activation_checkpointing and not off.model.activation_offloading
    with pytest.raises(ValueError, match="model.activation_offloading"):
        with_overrides(cfg, ["model.activation_checkpointing=false", "model.activation_offloading=true"])
