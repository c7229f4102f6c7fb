"""How liger-kernel's fused linear cross-entropy cuts a micro-batch into chunks of logits: the loss
(workloads/train/loss.py) sets it, the memory model (workloads/sizing/memory.py) counts it. No torch
here, so that `plan` and the fit check stay quick to start."""

from __future__ import annotations

import math

LIGER_CHUNK_MEM_CONST = 8
"""liger's transient logits are bounded by this many times the hidden states' elements. Its default,
1, cuts a 16 x 2048 micro-batch of Qwen2.5-1.5B into 64 chunks of 512 tokens; 8 gives 8 chunks of
4096. Each chunk re-reads and re-writes the [V, H] fp32 gradient of the output embedding and launches
its own kernels, so fewer, larger chunks save most of that traffic, for about 1 GiB more of logits
at that size (docs/PERFORMANCE.md has the times)."""


def liger_chunk_rows(*, tokens: int, hidden: int, vocab: int, mem_const: int = LIGER_CHUNK_MEM_CONST) -> int:
    """Tokens per chunk in liger-kernel 0.8.5: next_pow2(ceil(T / ceil(V / (C * H)))), at most T."""
    factor = -(-vocab // (mem_const * hidden))
    return min(tokens, 2 ** math.ceil(math.log2(max(1, -(-tokens // factor)))))
