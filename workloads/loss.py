"""Next-token cross-entropy from hidden states and the output embedding, without full logits.

With a 151,936-token vocabulary the fp32 logits of one micro-batch of 16 x 2048 tokens take
18.5 GiB. Three implementations of the same mean loss over tokens whose label is not ignored:
- "liger": liger-kernel's fused Triton kernel (CUDA only, when installed);
- "chunked": `ChunkedLinearCrossEntropy`, plain torch, any device: logits exist one chunk of
  tokens at a time, in forward and again (recomputed) in backward;
- "plain": full logits then `F.cross_entropy`, the reference the others are tested against.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
IMPLEMENTATIONS = ("liger", "chunked", "plain")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over valid tokens of logsumexp(h W^T) - (h W^T)[label], chunk by chunk.

    Forward keeps only the per-token logsumexp; backward recomputes each chunk's logits to form
    softmax - onehot. Logits are upcast to fp32 before the softmax, as the HF loss does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, ignore_index: int):
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = (hidden[start:end] @ weight.T).float()
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            target_logit[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1)
        n_valid = valid.sum().clamp(min=1)
        loss = ((lse - target_logit) * valid).sum() / n_valid
        ctx.save_for_backward(hidden, weight, targets, valid, lse, n_valid)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, valid, lse, n_valid = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        token_scale = valid * (grad_loss / n_valid)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            probs = torch.exp((h @ weight.T).float() - lse[start:end, None])
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, targets[start:end]] -= 1.0
            grad_logits = (probs * token_scale[start:end, None]).to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += (grad_logits.T @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def choose_implementation(*, fused: bool, device: torch.device) -> str:
    if not fused:
        return "plain"
    if device.type == "cuda" and liger_available():
        return "liger"
    return "chunked"


class LinearCrossEntropy(nn.Module):
    """`forward(hidden [N, H], weight [V, H], labels [N]) -> mean loss over labels != -100`."""

    def __init__(self, *, implementation: str, chunk_size: int = 4096) -> None:
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown loss implementation {implementation!r}: use one of {IMPLEMENTATIONS}")
        self.implementation = implementation
        self.chunk_size = chunk_size
        self._liger = None
        if implementation == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            self._liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._liger is not None:
            return self._liger(weight, hidden, labels)
        if self.implementation == "chunked":
            return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, self.chunk_size, IGNORE_INDEX)
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)

    def extra_repr(self) -> str:
        return f"implementation={self.implementation}, chunk_size={self.chunk_size}"
