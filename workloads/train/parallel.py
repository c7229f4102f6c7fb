"""Apply per-block torch.compile and FSDP2 to the model, in one fixed order, on a mesh that follows
the nodes the ranks run on.

Order (as torchtitan's parallelize): activation checkpointing of each decoder layer (when asked
for), then compile each decoder layer, then `fully_shard` each decoder layer, then the input
embedding when it is not tied to the output one, then the root. The root unit owns what is left:
the final norm and the lm_head, which Qwen2.5-1.5B ties to the embedding, so the tied weight is one
parameter of one unit, gathered once for both uses and its two gradient contributions summed
before the reduce-scatter. An untied embedding (Qwen2.5-7B: 545M parameters each) is a unit of its
own, resharded after forward: it is not needed again until the very end of backward.

Between nodes the links are slow (one EFA interface per g6.12xlarge against PCIe inside it), so
`plan_mesh` picks HSDP across nodes where it fits (docs/PERFORMANCE.md has the step-time model),
and `GradientSync` keeps gradient accumulation from crossing nodes on every micro-step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from workloads.train import offload
from workloads.train.model import CausalLMWithLoss


def mixed_precision_policy(*, enabled: bool, reduce_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """bf16 compute on bf16 copies of the fp32 master weights, gradients reduced in `reduce_dtype`
    (fp32 unless flat FSDP's reduce-scatter crosses nodes in bf16, see `reduction_plan`)."""
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


def parallelize(
    model: CausalLMWithLoss,
    *,
    mesh: DeviceMesh,
    compile: bool,
    mixed_precision: bool,
    reshard_after_forward: bool,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    activation_offloading: bool = False,
) -> CausalLMWithLoss:
    layers = model.decoder_layers
    if activation_checkpointing:
        # Non-reentrant: inputs that need no gradient (a frozen embedding's output) are fine, and
        # FSDP2's hooks on the wrapper gather the layer again for the recomputation. The RNG state
        # is not restored for it: the layers draw no random numbers (no dropout in training, and
        # LoRA dropout defaults to 0; with it on, the recomputed mask differs from the first).
        for name, layer in list(layers.named_children()):
            layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
    if compile:
        for name, layer in list(layers.named_children()):
            layers.register_module(name, torch.compile(layer))
    mp = mixed_precision_policy(enabled=mixed_precision, reduce_dtype=reduce_dtype)
    ignored = frozen_outside_fsdp(model, mesh=mesh)
    blocks = list(layers.children())
    for i, block in enumerate(blocks):
        # Backward starts with the last layer, so resharding it after forward only to gather it
        # again at once would be wasted work.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last,
                    ignored_params=ignored)
    if activation_offloading:
        # After fully_shard: each layer's hooks then run after FSDP2 has gathered its parameters.
        offload.install(blocks, device_type=mesh.device_type)
    embedding = model.lm.get_input_embeddings()
    if embedding.weight is not model.lm.get_output_embeddings().weight and embedding.weight not in ignored:
        fully_shard(embedding, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    # The root's parameters (embedding, norm, lm_head) are needed again by the loss at the very
    # start of backward, so they stay gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    return model


def frozen_outside_fsdp(model: nn.Module, *, mesh: DeviceMesh) -> set[nn.Parameter]:
    """The frozen parameters (LoRA's base) when the mesh shards over one rank: FSDP2 would still
    all-gather them, on one rank a copy of each unit in use (the 7B's root alone is its 1.02 GiB
    lm_head, held all step) and the time of copying it in and out, for no memory saved. Left out of
    FSDP2 they are plain tensors on the device, used in place. Over more ranks sharding them is what
    makes a large base fit, so none is left out there."""
    if mesh.size(mesh.ndim - 1) != 1:
        return set()
    ignored = {p for p in model.parameters() if not p.requires_grad}
    if ignored and mesh.device_type != "cpu":
        # FSDP2 moves what it manages to the mesh's device; what it ignores stays where it was built
        # (a base too large to build on the GPU is built on the host). `.data` keeps tied weights tied.
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
        for param in ignored:
            if param.device.type not in ("meta", device.type):
                param.data = param.data.to(device)
    return ignored


# --- Topology: flat FSDP or HSDP, chosen from the nodes the ranks run on ---------------------------

MODEL_STATE_BYTES_PER_PARAM = 16
"""fp32 weight, fp32 gradient and AdamW's two fp32 moments: what each trained parameter costs the
rank that holds its shard (a frozen one costs its own bytes: workloads/train/memory.py)."""

def model_state_bytes(model: nn.Module) -> int:
    """The whole model's weights, gradients and optimizer state, before sharding: 16 bytes per trained
    parameter (MODEL_STATE_BYTES_PER_PARAM), a frozen one's own bytes."""
    return sum(p.numel() * (MODEL_STATE_BYTES_PER_PARAM if p.requires_grad else p.element_size())
               for p in model.parameters())


HSDP_STATE_FRACTION = 0.5
"""`auto` picks HSDP only when a node's share of the model state (sharded over that node's ranks
alone) takes at most this fraction of a device's memory; the rest is left for activations and
gathered bf16 layers. Beyond it, flat FSDP's sharding over every rank is what makes the model fit."""


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """How the ranks are arranged for FSDP2, as plain data (tested without processes)."""

    kind: str
    """"fsdp": one mesh dimension over every rank; "hsdp": (replicate across nodes, shard within a
    node), so parameters are gathered and gradients reduce-scattered inside a node and only an
    all-reduce of each node's gradient shard crosses between nodes."""
    ranks: tuple[tuple[int, ...], ...]
    """The mesh as rows of global ranks: one row for "fsdp"; one row per node for "hsdp"."""
    nodes: int
    """Nodes the ranks run on."""
    reason: str
    """Why this kind was chosen, for the run's summary."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.ranks[0]),) if self.kind == "fsdp" else (len(self.ranks), len(self.ranks[0]))

    @property
    def is_hsdp(self) -> bool:
        return self.kind == "hsdp"


def plan_mesh(
    *,
    requested: str,
    node_of_rank: Sequence[int],
    model_state_bytes: int,
    device_memory_bytes: Optional[int],
) -> MeshPlan:
    """The mesh for `requested` ("auto", "fsdp" or "hsdp") given each rank's node index.

    Nodes are told apart by the launcher's node rank (torchrun's GROUP_RANK, Ray Train's node rank);
    ranks need not be numbered node by node. "auto" is flat FSDP on one node, or when nodes hold
    different numbers of ranks, or when a node's share of the model state would not fit (see
    HSDP_STATE_FRACTION); HSDP otherwise. `model_state_bytes`: the whole model's weights, gradients
    and optimizer state before sharding."""
    world = len(node_of_rank)
    flat = (tuple(range(world)),)
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    rows = tuple(tuple(by_node[node]) for node in sorted(by_node))
    sizes = sorted({len(row) for row in rows})
    layout = f"{len(rows)} node(s) x {'/'.join(map(str, sizes))} rank(s)"
    if requested == "fsdp":
        return MeshPlan(kind="fsdp", ranks=flat, nodes=len(rows), reason=f"parallelism=fsdp on {layout}")
    if len(sizes) > 1:
        if requested == "hsdp":
            raise ValueError(
                f"parallelism is 'hsdp' but the nodes hold different numbers of ranks ({layout}): "
                "HSDP needs the same number on every node; use 'fsdp' or 'auto'"
            )
        return MeshPlan(
            kind="fsdp", ranks=flat, nodes=len(rows), reason=f"auto: nodes hold different numbers of ranks ({layout})"
        )
    if requested == "hsdp":
        return MeshPlan(kind="hsdp", ranks=rows, nodes=len(rows), reason=f"parallelism=hsdp on {layout}")
    if len(rows) == 1:
        return MeshPlan(kind="fsdp", ranks=flat, nodes=len(rows), reason=f"auto: one node ({layout})")
    per_rank = model_state_bytes / sizes[0]
    if device_memory_bytes is not None and per_rank > HSDP_STATE_FRACTION * device_memory_bytes:
        return MeshPlan(
            kind="fsdp",
            ranks=flat,
            nodes=len(rows),
            reason=f"auto: sharded over one node's {sizes[0]} rank(s) the model state would take "
            f"{per_rank / 2**30:.1f} GiB per rank, more than {HSDP_STATE_FRACTION:.0%} of "
            f"{device_memory_bytes / 2**30:.1f} GiB ({layout})",
        )
    return MeshPlan(
        kind="hsdp", ranks=rows, nodes=len(rows), reason=f"auto: {layout}, shard within a node, replicate across nodes"
    )


def build_mesh(plan: MeshPlan, *, device_type: str) -> DeviceMesh:
    """Every rank calls this with the same plan (it creates the process groups of each dimension)."""
    names = ("fsdp",) if plan.kind == "fsdp" else ("replicate", "shard")
    layout = torch.tensor(plan.ranks[0] if plan.kind == "fsdp" else plan.ranks, dtype=torch.int64)
    return DeviceMesh(device_type, layout, mesh_dim_names=names)


# --- Gradient accumulation: which reductions each micro-step's backward runs ------------------------


@dataclass(frozen=True, kw_only=True)
class GradientSync:
    """Set before each micro-step's backward.

    Under HSDP every micro-step reduce-scatters its gradients within the node (fast links, and the
    gradients stay sharded), but only the last one all-reduces across nodes: FSDP2 keeps the
    earlier micro-steps' node-reduced shards and adds them in before that all-reduce. With
    `cross_node_dtype` set, the partial sums of the earlier micro-steps stay in fp32 and only the
    last micro-step reduces in that dtype (its in-node reduce-scatter too: one dtype per
    reduction), so the gradient crosses nodes in it once per optimizer step. Flat FSDP has no
    separate cross-node stage: each micro-step reduce-scatters over every rank (skipping that would
    keep whole unsharded gradients on every rank)."""

    hsdp: bool = False
    cross_node_dtype: Optional[torch.dtype] = None
    """The dtype the last micro-step reduces in under HSDP; None keeps the policy's fp32."""

    def before_backward(self, model: nn.Module, *, last: bool) -> None:
        if not self.hsdp:
            return
        assert isinstance(model, FSDPModule)
        model.set_requires_all_reduce(last)
        if self.cross_node_dtype is not None:
            set_reduce_dtype(model, self.cross_node_dtype if last else torch.float32)


def set_reduce_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The dtype FSDP2 reduces gradients in, for every unit under `model`, from the next backward on.

    FSDP2 fixes it per unit from the MixedPrecisionPolicy at its first forward and has no public
    setter; its parameter groups read `_reduce_dtype` at every reduction (torch 2.4 to 2.13; a unit
    has one group, `_fsdp_param_group`, up to the versions that added a list of them)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in (state._fsdp_param_group,) if g is not None]
        for group in groups:
            if not hasattr(group, "_reduce_dtype"):
                raise RuntimeError(
                    f"torch {torch.__version__}: FSDP2 has no per-unit reduce dtype to switch; "
                    "set cross_node_reduce_dtype=float32"
                )
            group._reduce_dtype = dtype


def reduction_plan(
    plan: MeshPlan, *, mixed_precision: bool, cross_node_dtype: torch.dtype
) -> tuple[torch.dtype, GradientSync]:
    """(the MixedPrecisionPolicy's reduce dtype, the per-micro-step sync) for a mesh plan.

    Between nodes gradients travel in `cross_node_dtype` when mixed precision is on: under HSDP the
    last micro-step reduces in it, its in-node reduce-scatter as well as the all-reduce across nodes
    (FSDP2 has one reduce dtype per reduction), the earlier micro-steps in fp32; under flat FSDP on
    several nodes every reduce-scatter crosses nodes, so it runs in that dtype (the fp32 sharded
    gradients still accumulate in fp32). On one node, or without mixed precision, everything is fp32."""
    crosses = mixed_precision and plan.nodes > 1 and cross_node_dtype != torch.float32
    if plan.is_hsdp:
        return torch.float32, GradientSync(hsdp=True, cross_node_dtype=cross_node_dtype if crosses else None)
    return (cross_node_dtype if crosses else torch.float32), GradientSync()
