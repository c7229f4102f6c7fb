"""Next-token cross-entropy from hidden states and the output embedding, without full logits.

With a 151,936-token vocabulary the fp32 logits of one micro-batch of 16 x 2048 tokens take
18.5 GiB. Three implementations of the same sum of per-token losses over tokens whose label is not
ignored (the caller divides: the training step by the step's global label count, so that a step is
one batch however it is split into micro-batches and ranks; workloads/train/step.py):
- "liger": liger-kernel's fused Triton kernel (CUDA only, when installed);
- "chunked": `ChunkedLinearCrossEntropy`, plain torch, any device: logits exist one chunk of
  tokens at a time, and only during forward;
- "plain": full logits then `F.cross_entropy`, the reference the others are tested against.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workloads.train.loss_chunks import LIGER_CHUNK_MEM_CONST

IGNORE_INDEX = -100
IMPLEMENTATIONS = ("liger", "chunked", "plain")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of logsumexp(h W^T) - (h W^T)[label], one chunk of tokens at a time.

    Each chunk's logits are formed once: when gradients are wanted, forward also turns them into
    the chunk's share of both gradients (softmax - onehot, times h and W), as liger-kernel does,
    so backward only scales the stored gradients and the lm_head matmul runs three times per
    step instead of four. Logits are upcast to fp32 before the softmax, as the HF loss does, and
    the weight's gradient is summed over the chunks in fp32 (one rounding to the weight's dtype).
    A frozen weight (LoRA's lm_head) gets no gradient, and no [V, H] fp32 buffer for one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, ignore_index: int, with_grads: bool):
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0)
        token_weight = valid.to(torch.float32)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weight_grad = with_grads and ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            h, tgt, w = hidden[start:end], targets[start:end], token_weight[start:end]
            logits = (h @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, tgt[:, None]).squeeze(1)) * w).sum()
            if with_grads:
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(probs.shape[0], device=probs.device), tgt] -= 1.0
                grad_logits = probs.mul_(w[:, None]).to(hidden.dtype)
                grad_hidden[start:end] = grad_logits @ weight
                if weight_grad:
                    grad_weight += (grad_logits.T @ h).float()
        if with_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if weight_grad else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_loss, None if grad_weight is None else grad_weight * grad_loss,
                None, None, None, None)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def choose_implementation(*, fused: bool, device: torch.device) -> str:
    if not fused:
        return "plain"
    if device.type == "cuda" and liger_available():
        return "liger"
    return "chunked"


class LinearCrossEntropy(nn.Module):
    """`forward(hidden [N, H], weight [V, H], labels [N]) -> summed loss over labels != -100`."""

    def __init__(self, *, implementation: str, chunk_size: int = 4096,
                 liger_chunk_mem_const: int = LIGER_CHUNK_MEM_CONST,
                 liger_accum_dtype: Optional[torch.dtype] = torch.float32) -> None:
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown loss implementation {implementation!r}: use one of {IMPLEMENTATIONS}")
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.liger_chunk_mem_const = liger_chunk_mem_const
        # The weight's gradient is summed over liger's chunks in fp32; with None (liger's default)
        # the sum is rounded to bf16 (the gathered weight's dtype) at every chunk.
        self.liger_accum_dtype = liger_accum_dtype
        self._liger = None
        if implementation == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            self._liger = liger_fused_linear_cross_entropy

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._liger is not None:
            return self._liger(hidden, weight, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                               accum_dtype=self.liger_accum_dtype, chunk_mem_const=self.liger_chunk_mem_const)
        if self.implementation == "chunked":
            with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            return ChunkedLinearCrossEntropy.apply(
                hidden, weight, labels, self.chunk_size, IGNORE_INDEX, with_grads
            )
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def extra_repr(self) -> str:
        return f"implementation={self.implementation}, chunk_size={self.chunk_size}"
