"""Activation offloading: what each checkpointed decoder layer saves goes to pinned host memory during
forward and comes back ahead of its recomputation in backward, overlapped with compute.

With per-layer activation checkpointing a layer saves only its inputs (the hidden states entering it,
one [tokens, hidden] tensor; under torch.compile also the small tensors its graph needs again). These
saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) move each such tensor that qualifies
(`qualifies`: on the accelerator, at least `min_bytes`, not a parameter's storage) to the host on a
side stream, and in backward bring a layer's tensors back on that stream one layer ahead: when layer i's
tensors are unpacked, layer i-1's copies start, so they travel while layer i is recomputed and its
gradients computed. The GPU then holds about two layers' inputs (the one recomputed and the one
prefetched) instead of every layer's (workloads/sizing/memory.py counts it so).

The design follows torchtune's `OffloadActivations` (training/_activation_offloading.py): pinned host
buffers, a device-to-host stream, events so that the compute stream waits only where it must (before it
reuses memory a copy still reads, and before it uses a tensor a copy writes). It is written here rather
than taken from torchtune, whose offloading comes with the whole package (torchao, its models and
recipes) and handles any saved tensor of any module; here the unit is the checkpointed layer, which is
what makes the one-layer-ahead prefetch exact. Memory that a copy writes is allocated on the compute
stream and the side stream waits for the compute stream before writing it, so no `record_stream` is
needed. Nothing is offloaded on the CPU: there the hooks are not installed (`install`), and the loss
and gradients are those without offloading whatever the device (the copies are exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: moving them costs more in launches and
synchronization than they hold (a layer's input at 2,048 tokens of hidden size 3,584 is 14 MiB; its
sequence boundaries and rotary tables under compile are kilobytes to a few MiB)."""


def qualifies(tensor: torch.Tensor, *, device_type: str, min_bytes: int, parameter_storages: set[int]) -> bool:
    """Whether a saved tensor is moved to the host: an activation on the accelerator of at least
    `min_bytes`; never a parameter (a compiled layer saves its gathered weights as well: they are
    gathered again for backward, copying them would only cost bandwidth and memory), nor a view of one
    (`parameter_storages`: the data pointers of the layer's parameters' storages)."""
    if tensor.device.type != device_type or isinstance(tensor, nn.Parameter):
        return False
    if tensor.numel() * tensor.element_size() < min_bytes:
        return False
    return tensor.untyped_storage().data_ptr() not in parameter_storages


class Copier(Protocol):
    """How tensors travel between the device and the host (CUDA streams; a synchronous one in tests)."""

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying `tensor` to the host: (the host copy, a token `release_device` waits on)."""

    def release_device(self, token: object) -> None:
        """Before the device memory a `to_host` copy reads can be reused by the compute stream."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Start copying a host tensor back: the device tensor, valid once `wait_ready` is called."""

    def mark_fetched(self) -> object:
        """After a group of `to_device` copies: a token for `wait_ready`."""

    def wait_ready(self, token: object) -> None:
        """Make the compute stream wait for the copies of a `mark_fetched` token."""


class CudaCopier:
    """Copies on a side stream into pinned host buffers (the caching host allocator keeps them across
    steps) and back; events order the two streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        compute = torch.cuda.current_stream(self.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.side.wait_stream(compute)  # the tensor is written by work queued on the compute stream
        with torch.cuda.stream(self.side):
            host.copy_(tensor, non_blocking=True)
        return host, self.side.record_event()

    def release_device(self, token: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        # Allocated on the compute stream, so its memory is ordered with the compute stream's uses;
        # the side stream waits for those before it writes.
        device_tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            device_tensor.copy_(host, non_blocking=True)
        return device_tensor

    def mark_fetched(self) -> object:
        return self.side.record_event()

    def wait_ready(self, token: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)


@dataclass
class _Group:
    """One layer's offloaded tensors, from its forward until its backward has unpacked them all."""

    host: dict[int, torch.Tensor] = field(default_factory=dict)
    """Host copies, by key, until unpacked."""
    in_flight: list[object] = field(default_factory=list)
    """Tokens of the copies out, with the device tensors they read kept alive (`_InFlight`)."""
    fetched: dict[int, torch.Tensor] = field(default_factory=dict)
    """Device copies brought back, by key, until unpacked."""
    ready: object = None
    """The token of the copies back, waited on at the group's first unpack."""


Packed = tuple[int, int]
"""(layer index, key): what autograd holds for an offloaded tensor."""


class ActivationOffloader:
    """The offloading state of one model of `layers` decoder layers. Layer i's forward runs under
    `begin_layer(i)` ... `end_layer()` with `hooks()` entered; what it saves and `qualifies` is copied
    to the host (group i). The last layer's tensors stay: its backward comes first. In backward a
    group is fetched at the latest when one of its tensors is unpacked, and the next one backward
    needs (`next_prefetch`) starts then; an unpack of a tensor kept on the device (the last layer's
    input) starts the first group's fetch.

    `events`, when given, records ("offload", layer), ("fetch", layer) and ("unpack", layer) in order:
    what the tests check the prefetch order by."""

    def __init__(self, *, layers: int, copier: Copier, device_type: str, min_bytes: int = MIN_OFFLOAD_BYTES,
                 events: Optional[list[tuple[str, int]]] = None) -> None:
        self.layers, self.copier, self.device_type, self.min_bytes = layers, copier, device_type, min_bytes
        self.groups: dict[int, _Group] = {}
        self.events = events
        self._next_key = 0
        self._layer: Optional[int] = None
        self._parameter_storages: set[int] = set()

    def _record(self, what: str, layer: int) -> None:
        if self.events is not None:
            self.events.append((what, layer))

    def begin_layer(self, layer: int, parameters: Sequence[torch.Tensor]) -> None:
        """Layer `layer`'s forward starts. The copies out of the layers before it have had a layer's
        forward to finish: the compute stream may reuse what they read from here on."""
        if layer == 0:
            self._let_go_of_all()  # a new forward (an evaluation, or a forward whose backward never ran)
        for group in self.groups.values():
            self._release(group)
        self._layer = layer
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters if p.device.type != "meta"}

    def end_layer(self) -> None:
        self._layer = None

    def _release(self, group: _Group) -> None:
        for token in group.in_flight:
            self.copier.release_device(token.token)
        group.in_flight.clear()

    def _let_go_of_all(self) -> None:
        for group in self.groups.values():
            self._release(group)
        self.groups.clear()

    def pack(self, tensor: torch.Tensor) -> object:
        layer = self._layer
        if layer is None or layer == self.layers - 1 or not qualifies(
                tensor, device_type=self.device_type, min_bytes=self.min_bytes,
                parameter_storages=self._parameter_storages):
            return tensor
        group = self.groups.setdefault(layer, _Group())
        key, self._next_key = self._next_key, self._next_key + 1
        host, token = self.copier.to_host(tensor)
        group.host[key] = host
        # The device tensor lives until the next layer begins: freed now, its memory could be
        # overwritten by the compute stream while the copy still reads it.
        group.in_flight.append(_InFlight(tensor=tensor, token=token))
        self._record("offload", layer)
        return (layer, key)

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):  # kept on the device: backward has reached the layers
            if not any(g.fetched for g in self.groups.values()):
                self._prefetch(current=self.layers)
            return packed
        layer, key = packed
        group = self.groups[layer]
        if key not in group.fetched:
            self._fetch(layer)  # not prefetched: backward waits for this copy
        self._record("unpack", layer)
        self._prefetch(current=layer)
        if group.ready is not None:
            self.copier.wait_ready(group.ready)
            group.ready = None
        tensor = group.fetched.pop(key)
        del group.host[key]
        if not group.host:
            self._release(group)
            del self.groups[layer]
        return tensor

    def _prefetch(self, *, current: int) -> None:
        unfetched = sorted(i for i, g in self.groups.items() if any(k not in g.fetched for k in g.host))
        following = next_prefetch(unfetched, current=current)
        if following is not None:
            self._fetch(following)

    def _fetch(self, layer: int) -> None:
        group = self.groups[layer]
        for key, host in group.host.items():
            if key not in group.fetched:
                group.fetched[key] = self.copier.to_device(host)
        group.ready = self.copier.mark_fetched()
        self._record("fetch", layer)

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, self.unpack)


@dataclass(frozen=True)
class _InFlight:
    tensor: torch.Tensor
    token: object


def next_prefetch(unfetched: Sequence[int], *, current: int) -> Optional[int]:
    """The layer to bring back next while layer `current` is in backward: the nearest one before it
    (backward runs the layers in reverse) whose tensors are still on the host; None when none is."""
    earlier = [i for i in unfetched if i < current]
    return max(earlier) if earlier else None


def install(layers: Sequence[nn.Module], *, device_type: str,
            copier_for: Callable[[torch.device], Copier] = CudaCopier) -> Optional[ActivationOffloader]:
    """Offload what each of `layers` (checkpointed decoder layers, in forward order, already sharded)
    saves, on the current CUDA device; on any other device type nothing is installed (None). Hooks on
    each layer enter the saved-tensor hooks around its forward (after FSDP2's pre-forward hook has
    gathered its parameters), so the module tree and its parameter names stay as they are."""
    if device_type != "cuda":
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    offloader = ActivationOffloader(layers=len(layers), copier=copier_for(device), device_type=device_type)
    attach(offloader, layers)
    return offloader


def attach(offloader: ActivationOffloader, layers: Sequence[nn.Module]) -> None:
    """Register the forward hooks that run each layer's forward under the offloader's saved-tensor hooks."""
    for index, layer in enumerate(layers):
        contexts: list[saved_tensors_hooks] = []

        def enter(module: nn.Module, args, *, index: int = index, contexts: list = contexts) -> None:
            offloader.begin_layer(index, list(module.parameters()))
            context = offloader.hooks()
            context.__enter__()
            contexts.append(context)

        def leave(module: nn.Module, args, output, *, contexts: list = contexts) -> None:
            if contexts:
                contexts.pop().__exit__(None, None, None)
            offloader.end_layer()

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave, always_call=True)
