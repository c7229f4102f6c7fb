"""`varlen`: the attention backend the loop trains with, registered with transformers by name.

A packed row holds several samples, each of which may attend only to itself. transformers' own
backends get that from position ids that restart: sdpa and eager through a dense [B, 1, S, S]
boolean mask (no flash kernel, and no `enable_gqa`, so the key/value heads are repeated),
flex_attention through a BlockMask, flash_attention_2 only for a micro-batch of one row. This one
takes the samples' boundaries as cumulative lengths over the micro-batch's flattened tokens
(`cu_seq_lens_q/k`, computed with the batch on the host: workloads/train/data.py) and runs:
- on CUDA in bf16/fp16: torch's variable-length FlashAttention (`torch.nn.attention.varlen`),
  causal inside each sample, grouped-query heads unrepeated, no mask in memory. It needs sm80 or
  newer: A100, H100/H200, and the 24 GB preset's L4 and A10G;
- elsewhere (CPU, fp32): sdpa with the block-diagonal causal mask built from the same boundaries,
  the reference the tests compare with;
- rows of one sequence each (synthetic tokens: no boundaries given): sdpa's causal kernel.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "varlen"


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch without it (< 2.10): the masked reference runs instead
        return None
    return varlen_attn


VARLEN_ATTN = _varlen_attn()
_PARAMS = set(inspect.signature(VARLEN_ATTN).parameters) if VARLEN_ATTN is not None else set()


def cumulative_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 [N + 1]: where each of the N sequences of the flattened rows starts, then the total.
    A sequence starts at every position id 0 (each row starts one: a sample or the padding)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """bool [total, total]: position i sees j when both are in one sequence and j <= i."""
    positions = torch.arange(total, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)
    return (segment[:, None] == segment[None, :]) & (positions[None, :] <= positions[:, None])


def _fast_path(query: torch.Tensor) -> bool:
    return (
        VARLEN_ATTN is not None
        and query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )


def _flash_varlen(q, k, v, cu_seqlens, max_length: int, scaling: Optional[float]) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]."""
    kwargs = {"scale": scaling}
    # torch 2.10/2.11 take is_causal; later releases a (left, right) window, (-1, 0) being causal.
    if "window_size" in _PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _PARAMS:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return VARLEN_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **kwargs)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    max_length_q: Optional[int] = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [B, Hq, S, D], k/v [B, Hk, S, D] in;
    [B, S, Hq, D] out. Causal within each sequence of `cu_seq_lens_q`, or within each row."""
    if sliding_window is not None:
        raise ValueError(f"attn_implementation={NAME!r} has no sliding window: use 'sdpa' for this model")
    batch, heads, seq, dim = query.shape
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != heads,
        )
        return out.transpose(1, 2).contiguous(), None
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    if _fast_path(query) and dropout == 0.0:
        flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
        out = _flash_varlen(*flat, cu, max_length_q or seq, scaling)
        return out.view(batch, seq, heads, dim), None
    # One row of all tokens, so that the mask's blocks are the sequences.
    flat = [t.transpose(0, 1).reshape(1, t.shape[1], batch * seq, dim) for t in (query, key, value)]
    mask = block_causal_mask(cu, batch * seq)
    out = F.scaled_dot_product_attention(
        *flat, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != heads
    )
    return out.view(heads, batch, seq, dim).permute(1, 2, 0, 3).contiguous(), None


AttentionInterface.register(NAME, varlen_attention_forward)
