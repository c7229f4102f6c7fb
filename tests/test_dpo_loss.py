"""The per-token log-probabilities without full logits, and the preference losses written out."""

from __future__ import annotations

import math

import pytest
import torch

from workloads.train.config import DpoSettings
from workloads.train.logprobs import TokenLogProbs
from workloads.train.loss import IGNORE_INDEX
from workloads.train.preference import METRICS, preference_terms


def _inputs(*, seed: int = 0, tokens: int = 37, hidden: int = 16, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.3
    labels = torch.randint(vocab, (tokens,), generator=gen)
    labels[::3] = IGNORE_INDEX
    upstream = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return h, w, labels, upstream


@pytest.mark.parametrize("weight_trains", [True, False])
def test_chunked_log_probs_and_their_gradients_equal_full_logits(weight_trains):
    h, w, labels, upstream = _inputs()
    grads = {}
    for implementation in ("plain", "chunked"):
        hidden = h.clone().requires_grad_(True)
        weight = w.clone().requires_grad_(weight_trains)
        # Chunks of 8 tokens: several, the last one short.
        out = TokenLogProbs(implementation=implementation, chunk_size=8)(hidden, weight, labels)
        (out.double() * upstream).sum().backward()
        grads[implementation] = (out.detach(), hidden.grad, weight.grad)
    (plain, plain_h, plain_w), (chunked, chunked_h, chunked_w) = grads["plain"], grads["chunked"]
    assert (chunked[labels == IGNORE_INDEX] == 0).all()
    # The kernels compute logits in fp32 (as the loop's do): agreement to fp32's precision.
    torch.testing.assert_close(chunked.double(), plain.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_h, plain_h, rtol=1e-4, atol=1e-5)
    if weight_trains:
        torch.testing.assert_close(chunked_w, plain_w, rtol=1e-4, atol=1e-5)
    else:
        assert chunked_w is None and plain_w is None


def test_the_losses_are_the_papers_and_trls():
    policy = torch.tensor([[-10.0, -12.0], [-20.0, -15.0], [-7.0, -7.5]], dtype=torch.float64)
    reference = torch.tensor([[-11.0, -11.0], [-19.0, -16.0], [-7.0, -7.5]], dtype=torch.float64)
    tokens = torch.tensor([[4.0, 5.0], [10.0, 2.0], [3.0, 3.0]], dtype=torch.float64)
    beta, e = 0.2, 0.1
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for i, ((pc, pr), (rc, rr), (nc, nr)) in enumerate(zip(policy.tolist(), reference.tolist(), tokens.tolist())):
        margin = (pc - rc) - (pr - rr)
        dpo = -math.log(sigmoid(beta * margin))
        cdpo = -(1 - e) * math.log(sigmoid(beta * margin)) - e * math.log(sigmoid(-beta * margin))
        ipo = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
        for settings, want in ((DpoSettings(beta=beta), dpo), (DpoSettings(beta=beta, label_smoothing=e), cdpo),
                               (DpoSettings(beta=beta, loss_type="ipo"), ipo)):
            got = preference_terms(policy, reference, tokens, settings).losses[i].item()
            assert got == pytest.approx(want, rel=1e-12), (settings, i)
    terms = preference_terms(policy, reference, tokens, DpoSettings(beta=beta))
    metrics = dict(zip(METRICS, terms.metric_sums.tolist()))
    # Rewards are beta * log-ratios; a tie (the third pair) is not a win.
    assert metrics["rewards/chosen"] == pytest.approx(beta * (1 - 1 + 0))
    assert metrics["rewards/rejected"] == pytest.approx(beta * (-1 + 1 + 0))
    assert metrics["rewards/accuracies"] == 1.0  # only the first pair's chosen reward is higher
    assert metrics["rewards/margins"] == pytest.approx(beta * ((1 + 1) + (-1 - 1) + 0))
    assert metrics["logps/chosen"] == -37.0 and terms.chosen_nll.item() == 37.0
