"""Per-token log-probabilities of the labels from the final hidden states, without full logits.

What preference objectives need from the model: log p(label | context) at every label position
(0 elsewhere), summed per sequence by the objective (workloads/train/preference.py). Two
implementations of the same values:
- "chunked": logits exist one chunk of tokens at a time (a [chunk, V] fp32 buffer, V the
  vocabulary). With the output embedding frozen (LoRA), forward also forms each token's gradient
  of its log-probability with respect to its hidden state, W[label] - softmax(h W^T) W, so backward
  only scales it by the upstream gradient: one matmul less than forming logits again. With the
  output embedding trained (a full fine-tune) backward forms each chunk's logits again and both
  gradients from them, the embedding's summed in fp32 (one rounding to its dtype), as
  ChunkedLinearCrossEntropy does (workloads/train/loss.py).
- "plain": full logits, log_softmax and gather: the reference the other is tested against.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from workloads.train.loss import IGNORE_INDEX

IMPLEMENTATIONS = ("chunked", "plain")


class ChunkedTokenLogProbs(torch.autograd.Function):
    """log_softmax(h W^T)[label] for every token (0 where the label is ignored), in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, with_grads: bool):
        valid = labels != IGNORE_INDEX
        targets = labels.masked_fill(~valid, 0)
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        frozen_weight = not ctx.needs_input_grad[1]
        basis = torch.empty_like(hidden) if with_grads and frozen_weight else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = (hidden[start:end] @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            out[start:end] = (logits.gather(1, targets[start:end, None]).squeeze(1) - lse) * valid[start:end]
            if basis is not None:
                # d logp / d h = W[label] - softmax(h W^T) W, for the valid tokens (0 for the others).
                probs = logits.sub_(lse[:, None]).exp_().to(hidden.dtype)
                rows = weight[targets[start:end]] - probs @ weight
                basis[start:end] = rows * valid[start:end, None].to(hidden.dtype)
        ctx.chunk_size = chunk_size
        if with_grads:
            ctx.save_for_backward(hidden if basis is None else basis, weight if basis is None else None,
                                  targets, valid)
            ctx.frozen_weight = basis is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight, targets, valid = ctx.saved_tensors
        if ctx.frozen_weight:
            return saved * grad_out[:, None].to(saved.dtype), None, None, None, None
        hidden = saved
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad_out.float() * valid
        rows = torch.arange(min(ctx.chunk_size, hidden.shape[0]), device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            logits = (h @ weight.T).float()
            probs = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
            # d logp / d logits = onehot(label) - softmax, times each token's upstream gradient.
            g = scale[start:end]
            grad_logits = probs.mul_(-g[:, None])
            grad_logits[rows[: h.shape[0]], targets[start:end]] += g
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            grad_weight += (grad_logits.T @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


class TokenLogProbs(nn.Module):
    """`forward(hidden [N, H], weight [V, H], labels [N]) -> [N]` fp32 log-probabilities of the
    labels (0 where ignored)."""

    def __init__(self, *, implementation: str, chunk_size: int = 4096) -> None:
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown log-prob implementation {implementation!r}: use one of {IMPLEMENTATIONS}")
        self.implementation = implementation
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.implementation == "chunked":
            with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            return ChunkedTokenLogProbs.apply(hidden, weight, labels, self.chunk_size, with_grads)
        valid = labels != IGNORE_INDEX
        logps = F.log_softmax(F.linear(hidden, weight).float(), dim=-1)
        return logps.gather(1, labels.masked_fill(~valid, 0)[:, None]).squeeze(1) * valid

    def extra_repr(self) -> str:
        return f"implementation={self.implementation}, chunk_size={self.chunk_size}"


class CausalLMWithLogProbs(nn.Module):
    """`forward(input_ids, labels, position_ids=None, **attention) -> [B * S]` fp32 log-probabilities
    of the labels (0 where ignored): the module FSDP2 shards for a preference objective, so that its
    root unit gathers the output embedding for them, as CausalLMWithLoss does for the SFT loss."""

    def __init__(self, lm: PreTrainedModel, *, loss: TokenLogProbs) -> None:
        super().__init__()
        self.lm = lm
        self.loss = loss

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                *, label_index: Optional[torch.Tensor] = None, **attention) -> torch.Tensor:
        """`label_index`: the flat positions whose log-probabilities count (found on the host with the
        batch); only they go through the output embedding. A preference pair's prompt, most of its
        tokens, needs none."""
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **attention).last_hidden_state.flatten(0, 1)
        weight, labels = self.lm.get_output_embeddings().weight, labels.flatten()
        if label_index is None:
            return self.loss(hidden, weight, labels)
        picked = self.loss(hidden.index_select(0, label_index), weight, labels.index_select(0, label_index))
        return torch.zeros(labels.shape[0], dtype=picked.dtype, device=picked.device).index_copy(0, label_index, picked)
