"""`varlen`: the attention backend the loop trains with, registered with transformers by name.

A packed row holds several samples, each of which may attend only to itself. transformers' own
backends get that from position ids that restart: sdpa and eager through a dense [B, 1, S, S]
boolean mask (no flash kernel, and no `enable_gqa`, so the key/value heads are repeated),
flex_attention through a BlockMask; flash_attention_2 from the same `cu_seq_lens_q/k` this
backend takes, at any micro-batch (it flattens the rows and runs FlashAttention's varlen kernel).
This one takes the samples' boundaries as cumulative lengths over the micro-batch's flattened
tokens (`cu_seq_lens_q/k`, computed with the batch on the host: workloads/train/data.py) and runs:
- on CUDA in bf16/fp16: torch's variable-length FlashAttention (`torch.nn.attention.varlen`),
  causal inside each sample, grouped-query heads unrepeated, no mask in memory. It needs sm80 or
  newer: A100, H100/H200, and the 24 GB preset's L4 and A10G;
- on the CPU: sdpa with the block-diagonal causal mask built from the same boundaries over the
  flattened micro-batch, the reference the tests compare with;
- rows of one sequence each (synthetic tokens: no boundaries given): sdpa's causal kernel.
A GPU that cannot take the flash path (fp32 compute, a GPU older than sm80, a torch without the
varlen kernel) is refused with the way out (`masked_on_gpu_refusal`): the CPU's mask would be
(B*S)^2 there, 32768^2 at 16 x 2048, and its attention weights as large per head.
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


def _gpu_capability(query: torch.Tensor) -> Optional[tuple[int, int]]:
    """The compute capability of the GPU holding `query`; None off the GPU."""
    return torch.cuda.get_device_capability(query.device) if query.is_cuda else None


def _fast_path(query: torch.Tensor) -> bool:
    capability = _gpu_capability(query)
    return (
        VARLEN_ATTN is not None
        and capability is not None
        and query.dtype in (torch.bfloat16, torch.float16)
        and capability >= (8, 0)
    )


def masked_on_gpu_refusal(*, dtype: torch.dtype, capability: tuple[int, int], varlen_available: bool,
                          dropout: float) -> str:
    """Why packed rows on this GPU cannot take the flash path, and what to set instead."""
    sdpa = "or attn_implementation='sdpa' (a [micro_batch, 1, seq_len, seq_len] mask per layer)"
    if not varlen_available:
        why, fix = "this torch has no torch.nn.attention.varlen (2.10 or newer)", f"upgrade torch, {sdpa}"
    elif dtype not in (torch.bfloat16, torch.float16):
        why, fix = f"attention runs in {str(dtype).removeprefix('torch.')}", f"set mixed_precision=true, {sdpa}"
    elif capability < (8, 0):
        why, fix = f"the GPU is sm{capability[0]}{capability[1]}, FlashAttention needs sm80 or newer", f"use {sdpa[3:]}"
    else:
        why, fix = f"attention dropout is {dropout:g}", f"train without attention dropout, {sdpa}"
    return (f"attn_implementation={NAME!r} keeps packed samples apart on a GPU with FlashAttention's variable-length "
            f"kernel, which cannot run here ({why}); its masked fallback would build one (micro_batch x seq_len)^2 "
            f"mask: {fix}")


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
    capability = _gpu_capability(query)
    if capability is not None:
        raise ValueError(masked_on_gpu_refusal(dtype=query.dtype, capability=capability,
                                               varlen_available=VARLEN_ATTN is not None, dropout=dropout))
    # One row of all tokens, so that the mask's blocks are the sequences.
    flat = [t.transpose(0, 1).reshape(1, t.shape[1], batch * seq, dim) for t in (query, key, value)]
    mask = block_causal_mask(cu, batch * seq)
    out = F.scaled_dot_product_attention(
        *flat, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != heads
    )
    return out.view(heads, batch, seq, dim).permute(1, 2, 0, 3).contiguous(), None


AttentionInterface.register(NAME, varlen_attention_forward)
