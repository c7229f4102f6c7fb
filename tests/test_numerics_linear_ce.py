"""No numerics hidden in a speed-up: the chunked linear cross-entropy (the loss the tuned loop
uses wherever liger-kernel is absent) against full logits + F.cross_entropy, in fp32 on CPU.

Tolerance: 1e-5 relative (and 1e-6 absolute) on the loss and on both gradients. Chunking only
changes the order of fp32 sums, which moves results by a few ulps (~1e-7 relative)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workloads.train.config import ModelConfig
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy, choose_implementation
from workloads.train.model import CausalLMWithLoss, build_causal_lm

TOL = dict(rtol=1e-5, atol=1e-6)


def reference(hidden, weight, labels):
    """The summed loss over labels not ignored: what every implementation returns (callers divide)."""
    return F.cross_entropy(F.linear(hidden, weight), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def loss_and_grads(fn, hidden, weight, labels):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("ignored", [0, 9])
def test_chunked_matches_full_logits_loss_and_gradients(chunk_size, ignored):
    gen = torch.Generator().manual_seed(chunk_size + ignored)
    n, hidden_size, vocab = 37, 16, 101
    hidden = torch.randn(n, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.3
    labels = torch.randint(vocab, (n,), generator=gen)
    labels[torch.randperm(n, generator=gen)[:ignored]] = IGNORE_INDEX
    chunked = LinearCrossEntropy(implementation="chunked", chunk_size=chunk_size)

    got = loss_and_grads(chunked, hidden, weight, labels)
    want = loss_and_grads(reference, hidden, weight, labels)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    if ignored:
        assert got[1][labels == IGNORE_INDEX].abs().max().item() == 0.0


def test_a_scaled_upstream_gradient_scales_both_gradients():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(12, 8, generator=gen), torch.randn(30, 8, generator=gen)
    labels = torch.randint(30, (12,), generator=gen)
    chunked = LinearCrossEntropy(implementation="chunked", chunk_size=5)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (3.0 * chunked(h1, w1, labels)).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (3.0 * reference(h2, w2, labels)).backward()
    torch.testing.assert_close(h1.grad, h2.grad, **TOL)
    torch.testing.assert_close(w1.grad, w2.grad, **TOL)


def test_without_autograd_only_the_loss_is_computed():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(10, 8, generator=gen), torch.randn(30, 8, generator=gen)
    labels = torch.randint(30, (10,), generator=gen)
    with torch.no_grad():
        loss = LinearCrossEntropy(implementation="chunked", chunk_size=3)(hidden, weight, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, labels), **TOL)


def test_model_loss_through_the_tied_embedding_matches_the_hf_logits():
    """The whole model: loss from hidden states + tied weight (what training uses) against the HF
    model's own fp32 logits, and the gradient that reaches the tied embedding/lm_head weight."""
    torch.manual_seed(0)
    x = torch.randint(512, (2, 17))
    inputs, labels = x[:, :-1], x[:, 1:]

    lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=torch.device("cpu"), seed=0)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    tuned = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="chunked", chunk_size=5))
    loss = tuned(inputs, labels)
    loss.backward()
    tuned_grad = lm.lm_head.weight.grad.clone()

    ref_lm = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=torch.device("cpu"), seed=0)
    logits = ref_lm(input_ids=inputs).logits.float()
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(tuned_grad, ref_lm.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    # Both uses of the tied weight contribute: the input-embedding rows of the batch's tokens too.
    assert tuned_grad[inputs.unique()].abs().sum() > 0


def test_implementation_choice():
    cpu = torch.device("cpu")
    assert choose_implementation(fused=False, device=cpu) == "plain"
    assert choose_implementation(fused=True, device=cpu) == "chunked"
    with pytest.raises(ValueError, match="unknown loss implementation"):
        LinearCrossEntropy(implementation="fast")
