"""`python -m workloads.bench.kernels --out DIR`: the two kernels the real fine-tune changed, alone.

On one CUDA device, at the `qwen2.5-1.5b` preset's shapes (micro-batch 16 x 2,048 tokens, 12 query
and 2 key/value heads of 128, hidden 1,536, vocabulary 151,936), bf16:

- attention on a packed micro-batch of generated chats (workloads/bench/chats.py) and on rows of one
  sequence: the `varlen` backend's FlashAttention path against its masked reference (the largest
  difference of outputs and input gradients, relative to their scale), and the forward+backward
  time of each path;
- the linear cross-entropy: liger with the tied weight's gradient accumulated in fp32 (what the
  loop runs) and in bf16 (liger's default), and the chunked implementation; the forward+backward
  time of each, and the cost of liger's host sync (it reads the label count with `.item()` every
  call): the time a call adds behind queued work beyond its own, where no sync would add none.

Writes DIR/kernels.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from workloads.bench.chats import conversation_lengths
from workloads.train.attention import VARLEN_ATTN, block_causal_mask, cumulative_lengths, varlen_attention_forward
from workloads.train.loss import LinearCrossEntropy, liger_available
from workloads.train.loss_chunks import LIGER_CHUNK_MEM_CONST, liger_chunk_rows
from workloads.train.packing import best_fit_decreasing

ROWS, SEQ, HEADS, KV_HEADS, HEAD_DIM = 16, 2048, 12, 2, 128
HIDDEN, VOCAB = 1536, 151_936


def time_ms(fn: Callable[[], object], *, repeats: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of `fn` (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 3)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((got.float() - want).abs().max() / want.abs().max())


def packed_positions(*, seed: int = 0) -> torch.Tensor:
    """[ROWS, SEQ] position ids of generated chats packed best-fit, as the loop packs them."""
    lengths = [min(n - 1, SEQ) for n in conversation_lengths(ROWS * 4, seed=seed)]
    rows = []
    for row in best_fit_decreasing(lengths, capacity=SEQ)[:ROWS]:
        positions = [p for i in row for p in range(lengths[i])]
        rows.append(positions + list(range(SEQ - len(positions))))
    return torch.tensor(rows)


def attention_figures(device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)

    def qkv():
        q = torch.randn(ROWS, HEADS, SEQ, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(ROWS, KV_HEADS, SEQ, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(ROWS, KV_HEADS, SEQ, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        return [t.requires_grad_() for t in (q, k, v)]

    positions = packed_positions()
    cu = cumulative_lengths(positions).to(device)
    q, k, v = qkv()
    grad_out = torch.randn(ROWS, SEQ, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

    def run(**kwargs):
        out, _ = varlen_attention_forward(None, q, k, v, None, scaling=HEAD_DIM**-0.5, **kwargs)
        (out * grad_out).sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return out.detach(), grads

    fast_out, fast_grads = run(cu_seq_lens_q=cu, max_length_q=SEQ)
    # The masked reference in fp32 on one row at a time (a [T, T] mask of all 32,768 tokens would
    # not fit), each row's sequences restated from 0.
    ref_out, ref_grads = [], [[], [], []]
    for row in range(ROWS):
        rq, rk, rv = (t.detach()[row : row + 1].float().requires_grad_() for t in (q, k, v))
        mask = block_causal_mask(cumulative_lengths(positions[row : row + 1]).to(device), SEQ)
        out = torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, attn_mask=mask, scale=HEAD_DIM**-0.5,
                                                               enable_gqa=True)
        out = out.transpose(1, 2)
        (out * grad_out[row : row + 1].float()).sum().backward()
        ref_out.append(out.detach())
        for i, t in enumerate((rq, rk, rv)):
            ref_grads[i].append(t.grad)

    errors = {"output": relative_error(fast_out, torch.cat(ref_out))}
    for name, got, want in zip(("grad_q", "grad_k", "grad_v"), fast_grads, ref_grads):
        errors[name] = relative_error(got, torch.cat(want))
    sequences = cu.numel() - 1
    return {
        "varlen_kernel": VARLEN_ATTN is not None,
        "sequences_in_micro_batch": sequences,
        "max_relative_error_vs_fp32_masked": {k: round(v, 5) for k, v in errors.items()},
        "packed_varlen_fwd_bwd_ms": time_ms(lambda: run(cu_seq_lens_q=cu, max_length_q=SEQ)),
        "unpacked_sdpa_causal_fwd_bwd_ms": time_ms(lambda: run()),
    }


def loss_figures(device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = (torch.randn(ROWS * SEQ, HIDDEN, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    labels = torch.randint(VOCAB, (ROWS * SEQ,), device=device, generator=gen)
    labels[torch.rand(ROWS * SEQ, device=device, generator=gen) < 0.25] = -100  # prompts and padding
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def call(loss):
        def go():
            loss(h, w, labels).backward()
            h.grad = w.grad = None
        return go

    figures: dict = {}
    impls: dict[str, LinearCrossEntropy] = {"chunked": LinearCrossEntropy(implementation="chunked")}
    if liger_available():
        impls["liger_fp32_accumulation"] = LinearCrossEntropy(implementation="liger")
        # liger's defaults: the gradient sums in the weight's dtype; logits in chunks of ~BT x H.
        impls["liger_bf16_accumulation"] = LinearCrossEntropy(implementation="liger", liger_accum_dtype=None)
        impls["liger_fp32_accumulation_default_chunks"] = LinearCrossEntropy(
            implementation="liger", liger_chunk_mem_const=1)
    for name, loss in impls.items():
        figures[f"{name}_fwd_bwd_ms"] = time_ms(call(loss))
    if liger_available():
        figures["fp32_accumulation_cost_ms"] = round(
            figures["liger_fp32_accumulation_fwd_bwd_ms"] - figures["liger_bf16_accumulation_fwd_bwd_ms"], 3)
        figures["liger_chunk_tokens_default_vs_ours"] = [
            liger_chunk_rows(tokens=ROWS * SEQ, hidden=HIDDEN, vocab=VOCAB, mem_const=c)
            for c in (1, LIGER_CHUNK_MEM_CONST)]
        figures["max_relative_error_vs_fp32"] = liger_errors(h, w, labels, impls["liger_fp32_accumulation"])
        # Queued work ahead of the call: without a host sync the call's kernels queue behind it at
        # once; with one, the host waits for it and the GPU idles while the call's kernels launch.
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=gen)
        queued = lambda: [a @ a for _ in range(8)]  # noqa: E731
        liger = call(impls["liger_fp32_accumulation"])
        together = time_ms(lambda: (queued(), liger()))
        figures["liger_host_sync_cost_ms"] = round(together - time_ms(queued) - figures[
            "liger_fp32_accumulation_fwd_bwd_ms"], 3)
    return figures


def liger_errors(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, liger: LinearCrossEntropy) -> dict:
    """The fused loss and its gradients against full fp32 logits and F.cross_entropy on the same
    bf16 inputs: max relative error of each."""
    def loss_and_grads(loss, h, w):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        value = loss(h, w, labels)
        value.backward()
        return value.detach().float(), h.grad.float(), w.grad.float()

    got = loss_and_grads(liger, hidden, weight)
    want = loss_and_grads(LinearCrossEntropy(implementation="plain"), hidden.float(), weight.float())
    names = ("loss", "grad_hidden", "grad_weight")
    return {name: round(relative_error(a, b), 6) for name, a, b in zip(names, got, want)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for kernels.json")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "attention": attention_figures(device),
        "loss": loss_figures(device),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
