"""Where a profiled window's device time goes, by category: the base model's GEMMs, LoRA's small
GEMMs, attention, the fused loss, casts and copies, compiled pointwise work, the optimizer, NCCL
(FSDP2's all-gathers and reduce-scatters), and the rest; with the top kernels by device time.

Each kernel is attributed to the operator that launched it (torch.profiler links them when the
profile records shapes): a matrix multiply one of whose operands has a dimension no larger than
`LORA_RANK_MAX` is LoRA's (x A^T, (x A^T) B^T and their gradients: one side is the rank); kernels
launched outside an operator (Triton kernels of compiled layers and of liger-kernel) are named by
their kernel names. Pure functions over (operator, shapes, kernel) triples, so the CPU tests check
the rules and the GPU run only feeds them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

CATEGORIES = ("gemm", "lora-gemm", "attention", "loss", "cast-copy", "compiled-pointwise", "norm-activation",
              "optimizer", "nccl", "other")
LORA_RANK_MAX = 64
"""A matmul operand dimension at or below this is taken for a LoRA rank (the model's dimensions are
hundreds or thousands)."""

_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
             "aten::_scaled_mm")
_ATTENTION_MARKS = ("flash", "fmha", "attention", "flex_attention", "sdpa", "cudnn_generated_fort_native_sdpa")
_LOSS_MARKS = ("cross_entropy", "liger", "fused_linear", "log_softmax", "nll_loss")
_COPY_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
             "aten::fill_", "aten::zero_", "aten::zeros", "aten::empty_strided")
_OPTIMIZER_MARKS = ("adam", "_foreach_", "multi_tensor_apply", "optimizer", "clip_grad")
_NORM_ACT_MARKS = ("rms_norm", "rmsnorm", "silu", "swiglu", "layer_norm", "rope", "rotary")


def is_lora_gemm(shapes: Sequence[Sequence[int]]) -> bool:
    """Whether a matmul's operand shapes have a rank-sized dimension (see LORA_RANK_MAX)."""
    dims = [d for shape in shapes[:3] for d in shape[-2:] if isinstance(d, int)]
    return bool(dims) and 0 < min(dims) <= LORA_RANK_MAX


def categorize(*, kernel: str, op: Optional[str] = None, shapes: Sequence[Sequence[int]] = ()) -> str:
    """The category of one kernel, from the operator that launched it (None: launched outside one)
    and that operator's input shapes."""
    name, low_op = kernel.lower(), (op or "").lower()
    if name.startswith("nccl") or "nccl" in low_op or "c10d::" in low_op:
        return "nccl"
    if any(m in low_op or m in name for m in _OPTIMIZER_MARKS):
        return "optimizer"
    if any(m in name or m in low_op for m in _LOSS_MARKS):
        return "loss"
    if any(m in name or m in low_op for m in _ATTENTION_MARKS):
        return "attention"
    if op in _GEMM_OPS or (op is None and ("gemm" in name or "nvjet" in name or "xmma" in name or "cutlass" in name)):
        return "lora-gemm" if op in _GEMM_OPS and is_lora_gemm(shapes) else "gemm"
    if op in _COPY_OPS or "copy" in name or "cast" in name or name.startswith("memcpy") or name.startswith("memset"):
        return "cast-copy"
    if name.startswith("triton_"):  # inductor's fused kernels of a compiled layer, whatever they fuse
        return "compiled-pointwise"
    if any(m in name or m in low_op for m in _NORM_ACT_MARKS):
        return "norm-activation"
    return "other"


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One kernel's device time and what launched it."""

    kernel: str
    seconds: float
    op: Optional[str] = None
    shapes: tuple = ()


def launches(events: Iterable) -> list[Launch]:
    """From a profile's events (`profile.events()`, recorded with shapes): each operator's kernels,
    attributed to its innermost operator, and the device kernels no operator launched."""
    out: list[Launch] = []
    linked: defaultdict[str, float] = defaultdict(float)
    device_total: defaultdict[str, float] = defaultdict(float)
    for event in events:
        kernels = getattr(event, "kernels", None) or []
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            # A range on the device's timeline that is a name, not a kernel (a compiled graph's `## Call
            # CompiledFxGraph ... ##`, a record_function): the kernels inside it count by themselves.
            if not getattr(event, "is_user_annotation", False) and not event.name.startswith("## "):
                device_total[event.name] += (event.time_range.end - event.time_range.start) / 1e6
            continue
        # The innermost operator: its children launched no kernel of their own.
        children = getattr(event, "cpu_children", []) or []
        if any(getattr(c, "kernels", None) for c in children):
            continue
        shapes = tuple(tuple(s) for s in (getattr(event, "input_shapes", None) or []) if isinstance(s, (list, tuple)))
        for kernel in kernels:
            out.append(Launch(kernel=kernel.name, seconds=kernel.duration / 1e6, op=event.name, shapes=shapes))
            linked[kernel.name] += kernel.duration / 1e6
    for name, total in device_total.items():
        rest = total - linked.get(name, 0.0)
        if rest > 1e-9:
            out.append(Launch(kernel=name, seconds=rest))
    return out


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    steps: int
    seconds: dict[str, float]
    """Device seconds per step, by category."""
    top: list[tuple[str, str, float]]
    """(kernel, category, device seconds per step), largest first."""

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict:
        total = self.total or 1.0
        return {"steps": self.steps, "device_s_per_step": round(self.total, 4),
                "categories": {k: {"s_per_step": round(v, 4), "share": round(v / total, 4)}
                               for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])},
                "top_kernels": [{"kernel": k[:120], "category": c, "s_per_step": round(s, 5)} for k, c, s in self.top]}

    def table(self) -> str:
        total = self.total or 1.0
        lines = [f"device time per step {self.total * 1e3:,.1f} ms over {self.steps} step(s)",
                 f"{'category':<20} {'ms/step':>10} {'share':>7}"]
        lines += [f"{k:<20} {v * 1e3:>10,.2f} {v / total:>7.1%}"
                  for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        lines += ["", f"{'top kernels':<90} {'category':<18} {'ms/step':>8}"]
        lines += [f"{k[:90]:<90} {c:<18} {s * 1e3:>8,.2f}" for k, c, s in self.top]
        return "\n".join(lines)


def breakdown(items: Iterable[Launch], *, steps: int, top: int = 15) -> Breakdown:
    seconds = {c: 0.0 for c in CATEGORIES}
    by_kernel: defaultdict[tuple[str, str], float] = defaultdict(float)
    for item in items:
        category = categorize(kernel=item.kernel, op=item.op, shapes=item.shapes)
        seconds[category] += item.seconds / steps
        by_kernel[(item.kernel, category)] += item.seconds / steps
    ranked = sorted(((k, c, s) for (k, c), s in by_kernel.items()), key=lambda t: -t[2])[:top]
    return Breakdown(steps=steps, seconds={k: v for k, v in seconds.items() if v > 0}, top=ranked)
