"""A memory model of the training loop: the peak GPU memory one rank allocates, predicted before
anything starts, from the quantities the loop itself uses.

Pure functions over an `Architecture` (a decoder-only transformer's shape) and `MemorySettings`
(method, sharding, micro-batch, sequence length, checkpointing, precision, loss). The terms:

- weights: every parameter's local shard, FSDP2-padded (its first dimension rounded up to a multiple
  of the shard group): fp32 for what trains, and under mixed precision bf16 for what a method
  freezes (LoRA's base);
- gradients and AdamW state: 4 and 8 bytes per trained parameter's shard;
- gathered parameters: FSDP2's all-gather outputs in the compute dtype: the root unit (final norm,
  lm_head, a tied embedding) for the whole step, every decoder layer when they are not resharded
  after forward, else the layer in use and the one prefetched (on one rank, a frozen base is not
  FSDP2's and is never gathered);
- activations: the bytes each decoder layer keeps per token for backward (an inventory of the
  tensors autograd saves, with and without torch.compile's fusion), times the layers, or with
  activation checkpointing one hidden state per layer plus one layer's whole inventory while it
  is recomputed; with activation offloading too, two layers' hidden states stay (the one recomputed
  and the one brought back ahead of it, workloads/train/offload.py), the others wait in host memory;
- the loss: the fused/chunked linear cross-entropy's gradient buffers and one chunk of logits, or
  the whole logits for the plain one;
- transients of backward: one layer's unsharded gradients and the fp32 reduce-scatter buffer, and
  the gradients of its MLP's activations;
- a preference objective's reference (`objective: dpo`): a full fine-tune's frozen copy of the
  model, sharded in the compute dtype, for the whole run; nothing for LoRA (the policy with its
  adapters off) or a precomputed reference. Its forward, without gradients, holds less than the
  policy's backward does. A row holds a pair's two sequences: the tokens of a micro-batch are its
  rows' positions, whatever they hold.

The peak is the larger of the start of backward (activations whole, the loss's buffers made, the last
layer's gradients being formed) and the optimizer step. Measured peaks on the H200 check it
(docs/PERFORMANCE.md, "Memory"); CPU tests check the sharded terms against each rank's local shards
and the eager inventory against autograd's saved tensors (tests/test_memory_model.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from workloads.train.loss_chunks import LIGER_CHUNK_MEM_CONST, liger_chunk_rows

GIB = 2**30
FP32, BF16 = 4, 2

CUDA_CONTEXT_GIB = 0.6
"""What a process's CUDA context, cuBLAS/cuDNN workspaces and NCCL take outside PyTorch's allocator
(about 500-600 MiB on an H200 with NCCL initialized); left out of the allocated peak, kept as
headroom by the fit check."""
ALLOCATOR_SLACK = 0.05
"""The caching allocator reserves more than the peak it hands out (blocks split and rounded): the fit
check keeps this share of the predicted peak free as well."""

# Bytes each decoder layer keeps per token for backward, per unit of the hidden size H, the
# intermediate size I and the key/value width KV (kv heads x head dim), by compute dtype.
# Eager: the tensors autograd saves in a Qwen2 decoder layer, counted with saved-tensor hooks
# (tests/test_memory_model.py checks them): in bf16, RMSNorm's fp32 upcast, its bf16 output and
# the projections' input (twice), q, the attention output, and the MLP's gate, SiLU, up and
# product; in fp32 the upcast is the layer's input itself, which is then kept. Compiled (torch.compile per layer, what
# the GPU presets run): the partitioner recomputes the norms' and SiLU's pointwise work but keeps
# more of the layer's inputs in their attention (varlen) layout; calibrated on one measured peak
# (Qwen2.5-1.5B, micro-batch 16, one H200: docs/PERFORMANCE.md, "Memory") and checked on others.
SAVED_BYTES = {
    ("eager", BF16): {"H": 20.0, "I": 8.0, "KV": 4.0},
    ("eager", FP32): {"H": 32.0, "I": 16.0, "KV": 8.0},
    ("compiled", BF16): {"H": 16.0, "I": 6.0, "KV": 4.0},
    ("compiled", FP32): {"H": 32.0, "I": 16.0, "KV": 8.0},
}
ATTENTION_LSE_BYTES_PER_HEAD = 4
"""The attention kernels' fp32 log-sum-exp per head and token, kept for their backward."""
NORM_RSQRT_BYTES = 8
"""The two RMSNorms' fp32 reciprocal square roots per token."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """A Qwen2-style decoder's shape (what the memory and step-time models need)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = True

    @classmethod
    def from_config(cls, config) -> Architecture:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, layers=config.num_hidden_layers,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=bool(getattr(config, "attention_bias", True)))

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Each decoder layer's linear modules: name -> (out features, in features, has bias)."""
        h, q, kv, i = self.hidden_size, self.heads * self.head_dim, self.kv_width, self.intermediate_size
        bias = self.qkv_bias
        return {"q_proj": (q, h, bias), "k_proj": (kv, h, bias), "v_proj": (kv, h, bias), "o_proj": (h, q, False),
                "gate_proj": (i, h, False), "up_proj": (i, h, False), "down_proj": (h, i, False)}

    @property
    def layer_params(self) -> int:
        return sum(o * i + (o if b else 0) for o, i, b in self.linears().values()) + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + lm_head + self.hidden_size


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """What of a run decides its memory, per rank."""

    shard_ranks: int
    """Ranks each parameter is sharded over: the world size under flat FSDP, a node's ranks under HSDP."""
    micro_batch: int
    seq_len: int
    method: str = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ()
    """Adapted linear modules (empty: all of them)."""
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False
    activation_offloading: bool = False
    """With checkpointing: the layers' inputs wait in host memory but two (workloads/train/offload.py)."""
    mixed_precision: bool = True
    compile: bool = True
    loss: str = "liger"
    """"liger", "chunked" or "plain" (workloads/train/loss.py)."""
    loss_chunk_size: int = 4096
    liger_chunk_mem_const: int = LIGER_CHUNK_MEM_CONST
    """liger's chunk bound (workloads/train/loss_chunks.py); runs recorded before it was set ran 1."""
    frozen_in_fsdp: bool = False
    """FSDP2 holds the frozen parameters on a one-rank mesh too (the loop until 2026-12-05, as the
    memory records of that time measured it); the loop leaves them out since (parallel.py's
    frozen_outside_fsdp)."""
    reshard_after_forward: bool = True
    grad_accum_steps: int = 1
    objective: str = "sft"
    """"sft", or "dpo" (per-token log-probabilities instead of the loss, and a reference)."""
    reference: str = "model"
    """With objective "dpo": "model" (a frozen copy for method "full", the policy itself for
    "lora") or "precomputed"."""

    def __post_init__(self) -> None:
        if min(self.shard_ranks, self.micro_batch, self.seq_len, self.grad_accum_steps) < 1:
            raise ValueError(f"shard_ranks, micro_batch, seq_len and grad_accum_steps must be >= 1: {self}")
        if self.method not in ("full", "lora"):
            raise ValueError(f"method {self.method!r}: use 'full' or 'lora'")
        if self.loss not in ("liger", "chunked", "plain"):
            raise ValueError(f"loss {self.loss!r}: use 'liger', 'chunked' or 'plain'")
        if self.activation_offloading and not self.activation_checkpointing:
            raise ValueError("activation_offloading moves the checkpointed layers' inputs: it needs "
                             "activation_checkpointing")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def compute_bytes(self) -> int:
        return BF16 if self.mixed_precision else FP32


@dataclass(frozen=True)
class Param:
    """One parameter as FSDP2 holds it."""

    unit: str
    """"layer", "embedding" (an untied input embedding's own unit) or "root"."""
    shape: tuple[int, ...]
    trained: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameters(arch: Architecture, s: MemorySettings) -> list[Param]:
    """One decoder layer's parameters (unit "layer"), then the embedding's and the root's."""
    lora = s.method == "lora"
    targets = set(s.lora_targets) or set(arch.linears())
    out = []
    for name, (o, i, bias) in arch.linears().items():
        out.append(Param("layer", (o, i), not lora))
        if bias:
            out.append(Param("layer", (o,), not lora))
        if lora and name in targets:
            out += [Param("layer", (s.lora_rank, i), True), Param("layer", (o, s.lora_rank), True)]
    out += [Param("layer", (arch.hidden_size,), not lora)] * 2
    embedding = Param("root" if arch.tied_embeddings else "embedding", (arch.vocab_size, arch.hidden_size), not lora)
    out.append(embedding)
    if not arch.tied_embeddings:
        out.append(Param("root", (arch.vocab_size, arch.hidden_size), not lora))
    out.append(Param("root", (arch.hidden_size,), not lora))
    return out


def padded_numel(param: Param, shard_ranks: int) -> int:
    """Elements of one rank's shard as FSDP2 allocates it: dim 0 split in `shard_ranks` chunks of
    ceil(dim0 / shard_ranks) rows (the largest chunk, rank 0's)."""
    rows = -(-param.shape[0] // shard_ranks)
    return rows * math.prod(param.shape[1:])


def _each(arch: Architecture, s: MemorySettings) -> list[tuple[Param, int]]:
    """Each distinct parameter with how many there are (the layer's once per layer)."""
    return [(p, arch.layers if p.unit == "layer" else 1) for p in parameters(arch, s)]


def weight_bytes(arch: Architecture, s: MemorySettings) -> int:
    """This rank's shards of the weights: fp32 where trained, the compute dtype where frozen."""
    return sum(n * padded_numel(p, s.shard_ranks) * (FP32 if p.trained else s.compute_bytes)
               for p, n in _each(arch, s))


def gradient_bytes(arch: Architecture, s: MemorySettings) -> int:
    """This rank's fp32 gradient shards (trained parameters only)."""
    return sum(n * padded_numel(p, s.shard_ranks) * FP32 for p, n in _each(arch, s) if p.trained)


def optimizer_bytes(arch: Architecture, s: MemorySettings) -> int:
    """AdamW's two fp32 moments per trained parameter's shard."""
    return 2 * gradient_bytes(arch, s)


def unit_gathered_bytes(arch: Architecture, s: MemorySettings, unit: str) -> int:
    """One unit's all-gather output (a layer: one of them), in the compute dtype: the padded
    unsharded size. Sharded over one rank a frozen parameter is outside FSDP2 (parallel.py's
    frozen_outside_fsdp): used in place, never gathered."""
    return sum(padded_numel(p, s.shard_ranks) * s.shard_ranks * s.compute_bytes
               for p in parameters(arch, s)
               if p.unit == unit and (p.trained or s.shard_ranks > 1 or s.frozen_in_fsdp))


def gathered_bytes(arch: Architecture, s: MemorySettings) -> int:
    """Parameters gathered at the end of forward: the root for the whole step, and every layer, or,
    resharded after forward, the last layer (kept for backward) and the one being gathered."""
    layers = 2 if s.reshard_after_forward else arch.layers
    return unit_gathered_bytes(arch, s, "root") + layers * unit_gathered_bytes(arch, s, "layer")


def layer_activation_bytes_per_token(arch: Architecture, s: MemorySettings) -> float:
    """Bytes one decoder layer keeps per token for backward (its whole inventory)."""
    coefficients = SAVED_BYTES[("compiled" if s.compile else "eager", s.compute_bytes)]
    units = {"H": arch.hidden_size, "I": arch.intermediate_size, "KV": arch.kv_width}
    saved = (sum(coefficients[k] * units[k] for k in units) + ATTENTION_LSE_BYTES_PER_HEAD * arch.heads
             + NORM_RSQRT_BYTES)
    if s.method == "lora":
        targets = set(s.lora_targets) or set(arch.linears())
        # A(x) per adapter (rank values); with dropout, also the dropped-out copy of x.
        saved += len(targets) * s.lora_rank * s.compute_bytes
        if s.lora_dropout > 0:
            saved += sum(arch.linears()[t][1] for t in targets) * s.compute_bytes
    return saved


def activation_bytes(arch: Architecture, s: MemorySettings) -> int:
    """What forward leaves for backward at its end: every layer's inventory, or with checkpointing
    each layer's input and one layer's inventory (the recomputation in backward); plus the final
    norm's output."""
    per_layer = layer_activation_bytes_per_token(arch, s) * s.tokens
    hidden = arch.hidden_size * s.compute_bytes * s.tokens
    if s.activation_checkpointing:
        layers = layers_on_device(arch, s) * hidden + per_layer
    else:
        layers = arch.layers * per_layer
    return int(layers + hidden)


OFFLOADED_LAYERS_ON_DEVICE = 2
"""With offloading, the checkpointed layers' inputs on the GPU at once: the layer in backward (the
last one's is never offloaded: its backward comes first) and the one brought back ahead of it."""


def layers_on_device(arch: Architecture, s: MemorySettings) -> int:
    """Checkpointed layers whose input is on the device at the start of backward."""
    return min(arch.layers, OFFLOADED_LAYERS_ON_DEVICE) if s.activation_offloading else arch.layers


def offloaded_host_bytes(arch: Architecture, s: MemorySettings) -> int:
    """Pinned host memory one rank holds for its offloaded layer inputs (every layer's but the last)."""
    if not s.activation_offloading:
        return 0
    return (arch.layers - 1) * arch.hidden_size * s.compute_bytes * s.tokens


def loss_bytes(arch: Architecture, s: MemorySettings) -> int:
    """The loss's buffers at the end of forward: the gradient of the hidden states (and of a
    trained lm_head, accumulated in fp32) computed in forward by the fused/chunked kernels, and one
    chunk of logits; the plain loss keeps the fp32 logits and their softmax. A preference
    objective's log-probabilities (workloads/train/logprobs.py): the same gradient buffers (formed
    at the start of backward for a trained lm_head), a chunk's fp32 logits and their gradient in
    the compute dtype."""
    v, h, t = arch.vocab_size, arch.hidden_size, s.tokens
    lm_head_trained = s.method == "full"
    if s.loss == "plain":
        return 3 * t * v * FP32
    if s.objective == "dpo":
        chunk = min(t, s.loss_chunk_size)
        return (t * h * s.compute_bytes + (v * h * FP32 if lm_head_trained else 0)
                + chunk * v * (FP32 + s.compute_bytes))
    grad_hidden = t * h * s.compute_bytes
    grad_weight = v * h * FP32 if lm_head_trained else 0
    if s.loss == "liger":
        # One buffer of a chunk's logits, in the input dtype.
        chunk = liger_chunk_rows(tokens=t, hidden=h, vocab=v, mem_const=s.liger_chunk_mem_const)
        return grad_hidden + grad_weight + chunk * v * s.compute_bytes
    chunk = min(t, s.loss_chunk_size)
    return grad_hidden + grad_weight + 2 * chunk * v * FP32


MLP_BACKWARD_TENSORS = 3
"""[tokens, intermediate] tensors the MLP's backward holds at once: the gradient of the down
projection's input, then of the gate and up projections' outputs (the first out-of-memory of a
checkpointed 7B run asked for exactly one of them: 16,384 x 18,944 in bf16, 592 MiB)."""


def reference_bytes(arch: Architecture, s: MemorySettings) -> int:
    """A full fine-tune's frozen reference copy under objective "dpo": every parameter's shard in
    the compute dtype; none otherwise."""
    if s.objective != "dpo" or s.method != "full" or s.reference != "model":
        return 0
    return sum(n * padded_numel(p, s.shard_ranks) * s.compute_bytes for p, n in _each(arch, s))


def backward_transient_bytes(arch: Architecture, s: MemorySettings) -> int:
    """The backward of one layer, on top of what forward left: its unsharded gradients in the compute
    dtype and the fp32 reduce-scatter input made from them (trained parameters only), and the
    activations' gradients inside its MLP."""
    trained = sum(padded_numel(p, s.shard_ranks) * s.shard_ranks for p in parameters(arch, s)
                  if p.unit == "layer" and p.trained)
    activation_grads = MLP_BACKWARD_TENSORS * s.tokens * arch.intermediate_size * s.compute_bytes
    return trained * (s.compute_bytes + FP32) + activation_grads


@dataclass(frozen=True)
class MemoryPrediction:
    terms: dict[str, int]
    """Bytes by term (weights, gradients, optimizer, gathered, activations, loss, backward)."""
    peak_bytes: int
    """The predicted peak of allocated memory on one rank."""
    phase: str
    """Where the peak falls: "backward" (its first layer, before it frees activations) or "step"."""
    settings: dict = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def needed_gib(self) -> float:
        """What a GPU must have for it: the peak, the allocator's slack and the CUDA context."""
        return self.peak_gib * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_GIB


def predict(arch: Architecture, s: MemorySettings) -> MemoryPrediction:
    terms = {
        "weights": weight_bytes(arch, s),
        "gradients": gradient_bytes(arch, s),
        "optimizer": optimizer_bytes(arch, s),
        "gathered": gathered_bytes(arch, s),
        "activations": activation_bytes(arch, s),
        "loss": loss_bytes(arch, s),
        "backward": backward_transient_bytes(arch, s),
        "reference": reference_bytes(arch, s),
    }
    persistent = terms["weights"] + terms["optimizer"] + terms["reference"]
    # Gradients are None between steps (zero_grad(set_to_none)); with accumulation the earlier
    # micro-steps' sharded gradients are held through the later ones' forward.
    held_gradients = terms["gradients"] if s.grad_accum_steps > 1 else 0
    forward = (persistent + held_gradients + terms["gathered"] + terms["activations"] + terms["loss"]
               + terms["backward"])
    step = persistent + terms["gradients"] + terms["gradients"] // 4  # fused AdamW's foreach temporaries
    phase = "backward" if forward >= step else "step"
    return MemoryPrediction(terms=terms, peak_bytes=max(forward, step), phase=phase, settings=asdict(s))


def settings_for(cfg, *, shard_ranks: int, loss: Optional[str] = None) -> MemorySettings:
    """The memory settings of a TrainConfig (workloads.train.config) on a shard group of that size;
    `loss`: the implementation it will run (liger on CUDA when installed; default: the fused one
    the config asks for on a GPU)."""
    implementation = loss or ("liger" if cfg.fused_linear_ce else "plain")
    return MemorySettings(
        shard_ranks=shard_ranks, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len, method=cfg.method,
        lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.target_modules), lora_dropout=cfg.lora.dropout,
        activation_checkpointing=cfg.model.activation_checkpointing,
        activation_offloading=cfg.model.activation_offloading, mixed_precision=cfg.mixed_precision,
        compile=cfg.compile, loss=implementation, loss_chunk_size=cfg.loss_chunk_size,
        reshard_after_forward=cfg.reshard_after_forward, grad_accum_steps=cfg.grad_accum_steps,
        objective=cfg.objective, reference=cfg.dpo.reference,
    )
