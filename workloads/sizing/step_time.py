"""A step-time model of the FSDP2 loop on a cluster of nodes: compute from a measured MFU,
communication from the bytes each collective puts on each link over that link's bandwidth.

    python -m workloads.sizing.step_time [--mfu 0.552] [--inter-gbps 5.0] [--intra-gbps ...]

prints the prediction for 2x g6.12xlarge (docs/PERFORMANCE.md, "Between nodes"). Pure functions;
`workloads.bench.topology` checks the model against emulated two-host runs.

How a step is modelled (one optimizer step of K micro-steps, per rank):
- compute per micro-step C = tokens x FLOPs per token / (MFU x peak), a third forward and two
  thirds backward (the 6N rule's split);
- each FSDP unit (the decoder layers, then the root: embedding, tied lm_head, final norm) moves
  its parameters and gradients through collectives whose time is bytes x (ranks-1)/ranks over the
  link's bus bandwidth (nccl-tests' convention: all-gather and reduce-scatter move (n-1)/n of the
  buffer over each rank's slowest link, all-reduce 2(n-1)/n). Flat FSDP rings over every rank, so
  each collective is as slow as the slower of the in-node link and the node's network share; HSDP
  gathers and reduce-scatters inside the node, and the node's GPUs all-reduce their shards across
  nodes together through its network interface;
- the layers' collectives overlap the phase that issues them (forward: gathers, backward: gathers
  when resharded, reduce-scatters, all-reduces); whatever exceeds the phase's compute is exposed.
  The root's gather runs before the first layer and its reductions after the last one's backward,
  so they are exposed whole.
Left out: latency (messages here are 50 MB and more), the optimizer step and the loop's other
per-step work (inside the measured MFU), and compute slowed by communication kernels.
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

FSDP, HSDP = "fsdp", "hsdp"
BF16_BYTES, FP32_BYTES = 2, 4


@dataclass(frozen=True, kw_only=True)
class Link:
    """A path's bus bandwidth in GB/s (10^9 bytes/s) by message size: measured points (interpolated
    linearly in log size, flat beyond the ends) or one published figure."""

    points: tuple[tuple[int, float], ...]
    """(message bytes, busbw GB/s), sorted by size."""

    def __post_init__(self) -> None:
        if not self.points or any(b <= 0 or s <= 0 for s, b in self.points):
            raise ValueError(f"a link needs positive (size, GB/s) points, got {self.points}")
        if [s for s, _ in self.points] != sorted({s for s, _ in self.points}):
            raise ValueError(f"link points must have distinct sizes in increasing order, got {self.points}")

    @classmethod
    def constant(cls, gbps: float) -> Link:
        return cls(points=((1, gbps),))

    def gbps(self, size_bytes: float) -> float:
        sizes = [s for s, _ in self.points]
        i = bisect.bisect_left(sizes, size_bytes)
        if i == 0:
            return self.points[0][1]
        if i == len(sizes):
            return self.points[-1][1]
        (s0, b0), (s1, b1) = self.points[i - 1], self.points[i]
        t = (math.log(size_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + (b1 - b0) * t


@dataclass(frozen=True, kw_only=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    """Ranks per node (one per GPU)."""
    peak_flops: float
    """Dense bf16 FLOP/s of one GPU."""
    mfu: float
    """Model FLOPs utilization of the loop's compute alone (measured on one host over NVLink,
    where communication is nearly free), carried over to this hardware."""
    intra: Optional[Link] = None
    """Between the GPUs of one node (per GPU); needed when gpus_per_node > 1."""
    inter: Optional[Link] = None
    """Between nodes, per node (all of a node's GPUs share it); needed when nodes > 1."""
    ranks_per_gpu: int = 1
    """Ranks time-sharing one GPU (an emulation on fewer GPUs): each computes at 1/ranks_per_gpu."""
    usd_per_node_hour: Optional[float] = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.ranks_per_gpu < 1:
            raise ValueError(f"need nodes, gpus_per_node, ranks_per_gpu >= 1, got {self}")
        if not 0 < self.mfu <= 1 or self.peak_flops <= 0:
            raise ValueError(f"mfu must be in (0, 1] and peak_flops positive, got {self.mfu}, {self.peak_flops}")
        if self.gpus_per_node > 1 and self.intra is None:
            raise ValueError(f"{self.gpus_per_node} GPUs per node need an intra-node link")
        if self.nodes > 1 and self.inter is None:
            raise ValueError(f"{self.nodes} nodes need an inter-node link")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    layers: int
    params_per_layer: int
    root_params: int
    """Parameters of the root unit: the embedding (tied with the lm_head) and the final norm."""
    flops_per_token: float
    trained_per_layer: Optional[int] = None
    """Parameters per layer whose gradients are reduced (LoRA: the adapters); None: all of them."""
    trained_root: Optional[int] = None
    forward_flops_per_token: Optional[float] = None
    """The forward's share, run again in backward under activation checkpointing; None: a third
    (the 6N rule's split)."""

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.root_params

    @property
    def forward_flops(self) -> float:
        return self.flops_per_token / 3 if self.forward_flops_per_token is None else self.forward_flops_per_token


@dataclass(frozen=True, kw_only=True)
class Strategy:
    label: str
    kind: str
    """"fsdp" (flat) or "hsdp"."""
    micro_batch: int
    seq_len: int
    grad_accum_steps: int = 1
    reshard_after_forward: bool = False
    activation_checkpointing: bool = False
    """The forward runs again in backward: its compute once more per micro-step."""
    cross_node_bytes: int = FP32_BYTES
    """Bytes per gradient element between nodes (4: fp32, 2: bf16); within a node always fp32."""

    def __post_init__(self) -> None:
        if self.kind not in (FSDP, HSDP):
            raise ValueError(f"strategy kind {self.kind!r}: use 'fsdp' or 'hsdp'")
        if min(self.micro_batch, self.seq_len, self.grad_accum_steps) < 1:
            raise ValueError(f"micro_batch, seq_len and grad_accum_steps must be >= 1, got {self}")
        if self.cross_node_bytes not in (BF16_BYTES, FP32_BYTES):
            raise ValueError(f"cross_node_bytes is {self.cross_node_bytes}: use 2 (bf16) or 4 (fp32)")


@dataclass(frozen=True, kw_only=True)
class StepPrediction:
    label: str
    step_s: float
    compute_s: float
    """K micro-steps of compute."""
    exposed_comm_s: float
    """Communication not hidden behind compute, per optimizer step."""
    comm_s: float
    """Every collective's time added up (busy links), per optimizer step."""
    tokens_per_s_per_gpu: float
    usd_per_billion_tokens: Optional[float] = None
    phases: dict = field(default_factory=dict)


def collective_s(op: str, *, size_bytes: float, ranks: int, link: Optional[Link]) -> float:
    """Seconds of one collective over `ranks` whose (larger) buffer is `size_bytes`."""
    if ranks == 1 or size_bytes == 0:
        return 0.0
    assert link is not None, "a collective over several ranks needs a link"
    share = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
    return size_bytes * share / (link.gbps(size_bytes) * 1e9)


def _flat_s(hw: Hardware, op: str, size_bytes: float) -> float:
    """A ring over every rank: as slow as its slowest hop, inside a node or through the network."""
    ranks = hw.ranks
    inside = collective_s(op, size_bytes=size_bytes, ranks=ranks, link=hw.intra) if hw.gpus_per_node > 1 else 0.0
    across = collective_s(op, size_bytes=size_bytes, ranks=ranks, link=hw.inter) if hw.nodes > 1 else 0.0
    return max(inside, across)


def _unit_comm(hw: Hardware, s: Strategy, params: int, *, last_micro_step: bool, resharded: bool,
               trained: Optional[int] = None) -> dict[str, float]:
    """Seconds of one unit's collectives in one micro-step, by phase and link ("inter" carries
    every collective that crosses nodes). `trained`: the parameters whose gradients are reduced
    (default: all)."""
    gather = params * BF16_BYTES
    reduced = params if trained is None else trained
    crosses = hw.nodes > 1
    if s.kind == FSDP:
        reduce_bytes = reduced * (s.cross_node_bytes if crosses else FP32_BYTES)
        key = "inter" if crosses else "intra"
        return {
            f"fwd_{key}": _flat_s(hw, "all_gather", gather),
            f"bwd_{key}": (_flat_s(hw, "all_gather", gather) if resharded else 0.0)
            + _flat_s(hw, "reduce_scatter", reduce_bytes),
        }
    g = hw.gpus_per_node
    # The last micro-step reduces in the cross-node dtype (workloads.train.parallel.GradientSync).
    scatter_bytes = reduced * (s.cross_node_bytes if last_micro_step and crosses else FP32_BYTES)
    bwd_intra = collective_s("reduce_scatter", size_bytes=scatter_bytes, ranks=g, link=hw.intra)
    if resharded:
        bwd_intra += collective_s("all_gather", size_bytes=gather, ranks=g, link=hw.intra)
    bwd_inter = 0.0
    if last_micro_step and crosses:
        # Each GPU all-reduces its 1/g shard with its peers; the node's g GPUs share its network.
        shard = reduced * s.cross_node_bytes / g
        bwd_inter = g * collective_s("all_reduce", size_bytes=shard, ranks=hw.nodes, link=hw.inter)
    return {
        "fwd_intra": collective_s("all_gather", size_bytes=gather, ranks=g, link=hw.intra),
        "bwd_intra": bwd_intra,
        "bwd_inter": bwd_inter,
    }


def _exposed(layers: dict[str, float], root: dict[str, float], *, window: float, phase: str) -> tuple[float, float]:
    """(exposed, total) seconds of one phase: layers' collectives overlap the phase's compute on
    each link; the root's collectives do not overlap anything."""
    per_link = [layers.get(f"{phase}_{k}", 0.0) for k in ("intra", "inter")]
    root_s = sum(root.get(f"{phase}_{k}", 0.0) for k in ("intra", "inter"))
    exposed = max(0.0, max(per_link) - window) + root_s
    return exposed, sum(per_link) + root_s


def predict_step(hw: Hardware, model: ModelShape, s: Strategy) -> StepPrediction:
    tokens = s.micro_batch * s.seq_len
    rate = hw.mfu * hw.peak_flops / hw.ranks_per_gpu
    forward = tokens * model.forward_flops / rate
    backward = tokens * (model.flops_per_token - model.forward_flops) / rate
    if s.activation_checkpointing:
        backward += forward
    compute = forward + backward
    exposed_total = comm_total = 0.0
    phases: dict[str, float] = {}
    for micro in range(s.grad_accum_steps):
        last = micro == s.grad_accum_steps - 1
        unit = _unit_comm(hw, s, model.params_per_layer, last_micro_step=last, resharded=s.reshard_after_forward,
                          trained=model.trained_per_layer)
        layers = {k: v * model.layers for k, v in unit.items()}
        # The root is never resharded after forward (workloads/train/parallel.py).
        root = _unit_comm(hw, s, model.root_params, last_micro_step=last, resharded=False,
                          trained=model.trained_root)
        for phase, window in (("fwd", forward), ("bwd", backward)):
            exposed, total = _exposed(layers, root, window=window, phase=phase)
            exposed_total += exposed
            comm_total += total
            phases[f"{phase}_exposed_s"] = phases.get(f"{phase}_exposed_s", 0.0) + exposed
    step = s.grad_accum_steps * compute + exposed_total
    tokens_per_s = s.grad_accum_steps * tokens / step
    cost = None
    if hw.usd_per_node_hour is not None:
        tokens_per_s_cluster = tokens_per_s * hw.ranks
        cost = hw.nodes * hw.usd_per_node_hour / 3600 / tokens_per_s_cluster * 1e9
    return StepPrediction(
        label=s.label,
        step_s=step,
        compute_s=s.grad_accum_steps * compute,
        exposed_comm_s=exposed_total,
        comm_s=comm_total,
        tokens_per_s_per_gpu=tokens_per_s,
        usd_per_billion_tokens=cost,
        phases=phases,
    )


# --- The target cluster --------------------------------------------------------------------------------

L4_BF16_DENSE_FLOPS = 121e12
"""NVIDIA L4 datasheet: 242 TFLOP/s bf16 with sparsity, 121 dense."""
G6_12XLARGE_NETWORK_GBPS = 40 / 8
"""g6.12xlarge: 40 Gbps network bandwidth (EC2 instance type page), one EFA interface: 5 GB/s."""
L4_PCIE_GBPS = 32.0
"""PCIe Gen4 x16, the L4's host interface: 32 GB/s per direction (L4 datasheet: 64 GB/s both ways).
An upper bound for GPU-to-GPU traffic in the node: g-series instances have no NVLink, and NCCL
moves it through host memory (SHM) where peer-to-peer DMA is not offered."""
MEASURED_H200_MFU = 0.552
"""The loop's MFU on 2x H200 over NVLink at micro-batch 16 (docs/PERFORMANCE.md, 2026-11-30)."""


def model_shape(name_or_path: str, *, seq_len: int) -> ModelShape:
    """A model's FSDP units as the loop wraps them (each decoder layer, then the root), counted on a
    parameter-free (meta) copy of a named architecture or a Hugging Face config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from workloads.train.config import ModelConfig
    from workloads.train.metrics import flops_per_token
    from workloads.train.model import named_architecture, shape_of

    named = ModelConfig(name_or_path=name_or_path).is_named_architecture
    config = named_architecture(name_or_path) if named else AutoConfig.from_pretrained(
        name_or_path, trust_remote_code=False)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    shape = shape_of(lm)
    layers = lm.model.layers
    per_layer = sum(p.numel() for p in layers[0].parameters())
    return ModelShape(
        layers=len(layers),
        params_per_layer=per_layer,
        root_params=shape.n_params - len(layers) * per_layer,
        flops_per_token=flops_per_token(n_params=shape.n_params, n_layers=shape.n_layers, n_heads=shape.n_heads,
                                        head_dim=shape.head_dim, seq_len=seq_len),
    )


def g6_12xlarge_pair(*, mfu: float, inter_gbps: float = G6_12XLARGE_NETWORK_GBPS,
                     intra_gbps: float = L4_PCIE_GBPS, usd_per_node_hour: Optional[float] = None) -> Hardware:
    from infra.instance_types import INSTANCE_TYPES

    g6 = INSTANCE_TYPES["g6.12xlarge"]
    return Hardware(
        nodes=2,
        gpus_per_node=g6.gpus,
        peak_flops=L4_BF16_DENSE_FLOPS,
        mfu=mfu,
        intra=Link.constant(intra_gbps),
        inter=Link.constant(inter_gbps),
        usd_per_node_hour=g6.usd_per_hour if usd_per_node_hour is None else usd_per_node_hour,
    )


def cluster_strategies(*, micro_batch: int = 2, seq_len: int = 2048, grad_accum_steps: int = 8) -> list[Strategy]:
    """The strategies compared for 2x g6.12xlarge, at the `qwen2.5-1.5b-24gb` preset's micro-batch
    (resharding after forward, as it must on 24 GB) and one number of tokens per optimizer step."""
    common = dict(micro_batch=micro_batch, seq_len=seq_len, reshard_after_forward=True)
    k = grad_accum_steps
    return [
        Strategy(label="flat FSDP, fp32 (today's loop)", kind=FSDP, grad_accum_steps=k, **common),
        Strategy(label="HSDP, fp32 between nodes", kind=HSDP, grad_accum_steps=k, **common),
        Strategy(label="HSDP, bf16 between nodes (auto)", kind=HSDP, grad_accum_steps=k,
                 cross_node_bytes=BF16_BYTES, **common),
    ]


def format_predictions(predictions: Sequence[StepPrediction]) -> str:
    lines = [f"{'strategy':<34}{'step s':>9}{'compute s':>11}{'exposed s':>11}{'tok/s/GPU':>11}{'$/1e9 tok':>11}"]
    for p in predictions:
        cost = "-" if p.usd_per_billion_tokens is None else f"{p.usd_per_billion_tokens:,.0f}"
        lines.append(f"{p.label:<34}{p.step_s:>9.3f}{p.compute_s:>11.3f}{p.exposed_comm_s:>11.3f}"
                     f"{p.tokens_per_s_per_gpu:>11,.0f}{cost:>11}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.sizing.step_time", description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=MEASURED_H200_MFU, help=f"default {MEASURED_H200_MFU}")
    parser.add_argument("--inter-gbps", type=float, default=G6_12XLARGE_NETWORK_GBPS,
                        help=f"network GB/s per node (default {G6_12XLARGE_NETWORK_GBPS}: 40 Gbps)")
    parser.add_argument("--intra-gbps", type=float, default=L4_PCIE_GBPS, help=f"default {L4_PCIE_GBPS}")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum-steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        hw = g6_12xlarge_pair(mfu=args.mfu, inter_gbps=args.inter_gbps, intra_gbps=args.intra_gbps)
        model = model_shape("qwen2.5-1.5b", seq_len=args.seq_len)
        predictions = [predict_step(hw, model, s) for s in cluster_strategies(
            micro_batch=args.micro_batch, seq_len=args.seq_len, grad_accum_steps=args.grad_accum_steps)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"2x g6.12xlarge (8x L4), MFU {args.mfu:.3f} of {L4_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s, network "
          f"{args.inter_gbps} GB/s per node, in-node {args.intra_gbps} GB/s per GPU, micro-batch "
          f"{args.micro_batch} x {args.grad_accum_steps} micro-steps x seq {args.seq_len}")
    print(format_predictions(predictions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
