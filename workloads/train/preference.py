"""Direct preference optimization (`objective: dpo`): the objective the loop calls, its loss and
its metrics, with TRL's definitions (trl 1.16.0 `DPOTrainer`, which tests/test_dpo_trl.py runs
beside this one).

Each pair is a prompt with a chosen answer c and a rejected one r; log pi(a) is the policy's
log-probability of answer a summed over its tokens, log pi_ref(a) the reference's
(workloads/train/reference.py). The rewards are beta * (log pi(a) - log pi_ref(a)), the margin
their difference; per pair:
- "sigmoid": -(1 - e) log sigmoid(beta * margin') - e log sigmoid(-beta * margin'), margin' the
  difference of the log-ratios, e `label_smoothing` (cDPO; 0: DPO);
- "ipo": (margin'_per_token - 1 / (2 beta))^2, each log-ratio divided by its answer's tokens.
The step's loss is the mean over every pair of the step, all micro-batches and ranks together
(the pair count is summed before the first forward, as the SFT step sums its labels), plus
`rpo_alpha` times the mean negative log-likelihood of every chosen answer token of the step.

Metrics, as TRL logs them, means over the step's pairs: rewards/chosen, rewards/rejected,
rewards/accuracies (the chosen reward strictly above the rejected), rewards/margins, logps/chosen,
logps/rejected; the same with `eval_` on the held-out pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workloads.train.config import PREFERENCE_METRICS, DpoSettings, TrainConfig
from workloads.train.data import Data
from workloads.train.logprobs import CausalLMWithLogProbs, TokenLogProbs
from workloads.train.optim import clip_grad_norm, set_lr
from workloads.train.pairs import (PairBatch, all_pair_batches, eval_pair_batches, load_pair_data, pair_batches,
                                   synthetic_pair_data)
from workloads.train.parallel import GradientSync
from workloads.train import reference as references

METRICS = PREFERENCE_METRICS
"""The step record's preference metrics (TRL's names), means over the step's pairs."""


@dataclass(frozen=True)
class PairTerms:
    losses: torch.Tensor
    """[P] each pair's preference loss."""
    chosen_nll: torch.Tensor
    """The summed negative log-likelihood of the chosen answers' tokens (the SFT term's numerator)."""
    metric_sums: torch.Tensor
    """[len(METRICS)] sums over the pairs."""


def preference_terms(policy: torch.Tensor, reference: torch.Tensor, answer_tokens: torch.Tensor,
                     settings: DpoSettings) -> PairTerms:
    """`policy`, `reference`: [P, 2] log-probabilities (chosen, rejected); `answer_tokens`: [P, 2]."""
    beta = settings.beta
    logratios = policy - reference
    margin = logratios[:, 0] - logratios[:, 1]
    if settings.loss_type == "ipo":
        per_token = logratios / answer_tokens.clamp(min=1.0)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    else:
        e = settings.label_smoothing
        losses = -(1 - e) * F.logsigmoid(beta * margin) - e * F.logsigmoid(-beta * margin)
    rewards = beta * logratios.detach()
    metrics = torch.stack([rewards[:, 0], rewards[:, 1], (rewards[:, 0] > rewards[:, 1]).float(),
                           rewards[:, 0] - rewards[:, 1], policy[:, 0].detach(), policy[:, 1].detach()])
    return PairTerms(losses=losses, chosen_nll=-policy[:, 0].sum(), metric_sums=metrics.sum(dim=1))


def step_counts(micro_batches: list[PairBatch]) -> torch.Tensor:
    """int64 [pairs, chosen answer tokens] of the whole step, all ranks together (a collective)."""
    device = micro_batches[0].input_ids.device
    counts = torch.stack([torch.tensor(sum(b.pairs for b in micro_batches), device=device),
                          sum(((b.sequence >= 0) & (b.sequence % 2 == 0)).sum() for b in micro_batches)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def reference_model_folder(spec: str, *, cache_dir: str, tokenizer) -> Path:
    """`dpo.reference_model`'s local folder (fetched once per node); ValueError where it reads text
    with another tokenizer than the policy's (`tokenizer`; None for synthetic token ids)."""
    from workloads.model_io.sources import fetch_model
    from workloads.train.encode import load_tokenizer, tokenizer_difference
    from workloads.train.paths import resolve_path

    folder = fetch_model(resolve_path(spec, field="dpo.reference_model", hub_id_allowed=True), cache_dir=cache_dir,
                         what="dpo.reference_model")
    if tokenizer is not None:
        difference = tokenizer_difference(tokenizer, load_tokenizer(str(folder)))
        if difference:
            raise ValueError(f"dpo.reference_model {spec!r} does not read text as the policy does: {difference}. The "
                             "reference scores the policy's tokens: give a model with the policy's tokenizer (its "
                             "base, or a fine-tune of it), or leave dpo.reference_model empty")
    return folder


class PreferenceObjective:
    """The loop's objective for `objective: dpo` (workloads/train/objective.py has the protocol)."""

    name = "dpo"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.settings = cfg.dpo
        self.reference: Optional[references.Reference] = None
        self.reference_folder: Optional[Path] = None
        """`dpo.reference_model`'s local folder, fetched with the data (its tokenizer checked there)."""
        self._last: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # What a batch holds.
    def build_data(self, cfg: TrainConfig, *, vocab_size: int, model_name_or_path: str, eval_rows: int = 0,
                   cache_dir: str = "") -> Data:
        if cfg.data.kind == "synthetic":
            data = synthetic_pair_data(seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=vocab_size,
                                       eval_fraction=cfg.data.eval_fraction if cfg.eval_every else 0.0,
                                       shuffle=cfg.data.shuffle)
        else:
            data = load_pair_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=vocab_size,
                                  tokenizer_name=cfg.data.tokenizer or model_name_or_path, cache_dir=cache_dir)
        if self.settings.reference_model:
            self.reference_folder = reference_model_folder(self.settings.reference_model, cache_dir=cache_dir,
                                                           tokenizer=data.tokenizer)
        return data

    def batches(self, source, *, position: int, micro_batch: int, rank: int, world_size: int,
                pin_memory: bool = False) -> Iterator[PairBatch]:
        return pair_batches(source, position=position, micro_batch=micro_batch, rank=rank, world_size=world_size,
                            pin_memory=pin_memory)

    def eval_batches(self, source, *, rows: int, micro_batch: int, rank: int, world_size: int,
                     max_rows: int) -> list[PairBatch]:
        return eval_pair_batches(source, rows=rows, micro_batch=micro_batch, rank=rank, world_size=world_size,
                                 max_rows=max_rows)

    # The model and its reference.
    def log_probs(self) -> TokenLogProbs:
        return TokenLogProbs(implementation="chunked" if self.cfg.fused_linear_ce else "plain",
                             chunk_size=self.cfg.loss_chunk_size)

    def wrap(self, lm: nn.Module, *, device: torch.device) -> CausalLMWithLogProbs:
        return CausalLMWithLogProbs(lm, loss=self.log_probs())

    def prepare(self, model: nn.Module, *, method, data: Data, pretrained: Optional[Path], device: torch.device,
                resume_from: Optional[Path], rank: int, world_size: int) -> None:
        """Set up the reference before the first step: the precomputed table (computed by the
        starting model, or read from the checkpoint a resumed run starts from), the policy without
        its adapters, or a frozen copy."""
        if self.settings.reference == "precomputed":
            if resume_from is not None:
                self.reference = references.load_precomputed(resume_from, device=device)
                return
            sources = [s for s in (data.train, data.eval) if s is not None]
            batches = [b for s in sources for b in all_pair_batches(s, micro_batch=self.cfg.micro_batch, rank=rank,
                                                                     world_size=world_size)]
            pairs = 1 + max(int(s.rows.pair_ids.max()) for s in sources)
            if self.reference_folder is None:
                self.reference = references.precompute(model, batches, pairs=pairs, device=device)
                return
            # Another model's log-probabilities: its frozen copy for the one pass, then freed.
            copy = references.frozen_copy(self.cfg, policy=model, pretrained=self.reference_folder, device=device,
                                          loss=self.log_probs())
            self.reference = references.precompute(copy.model, batches, pairs=pairs, device=device)
            del copy
            if device.type == "cuda":
                torch.cuda.empty_cache()
        elif self.reference_folder is not None:
            self.reference = references.frozen_copy(self.cfg, policy=model, pretrained=self.reference_folder,
                                                     device=device, loss=self.log_probs())
        elif method.untrained(model.lm) is not None:
            self.reference = references.AdaptersOff(model, untrained=method.untrained)
        else:
            self.reference = references.frozen_copy(self.cfg, policy=model, pretrained=pretrained, device=device,
                                                     loss=self.log_probs())

    # One optimizer step.
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[PairBatch], *, lr: float,
             grad_clip: float, sync: GradientSync = GradientSync()) -> tuple[torch.Tensor, torch.Tensor]:
        """As the SFT step (workloads/train/step.py): each micro-batch's backward starts from its
        share of the step's loss times the world size, which FSDP2's average over ranks divides
        away; returns (this rank's share of the loss times the world size, grad norm)."""
        assert self.reference is not None, "prepare() sets the reference before the first step"
        set_lr(optimizer, lr)
        world = dist.get_world_size() if dist.is_initialized() else 1
        counts = step_counts(micro_batches)
        device = micro_batches[0].input_ids.device
        loss = torch.zeros((), device=device)
        sums = torch.zeros(len(METRICS), device=device)
        for i, batch in enumerate(micro_batches):
            reference = self.reference.logps(batch)
            policy, tokens = references.forward_pairs(model, batch)
            terms = preference_terms(policy, reference, tokens, self.settings)
            micro = terms.losses.sum() / counts[0]
            if self.settings.rpo_alpha:
                micro = micro + self.settings.rpo_alpha * terms.chosen_nll / counts[1].clamp(min=1)
            micro = micro * world
            sync.before_backward(model, last=i == len(micro_batches) - 1)
            micro.backward()
            loss += micro.detach()
            sums += terms.metric_sums
        grad_norm = clip_grad_norm(model, max_norm=grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._last = (sums, counts)
        return loss.detach(), grad_norm.detach()

    def step_metrics(self) -> dict:
        """The last step's metrics, every rank's pairs together (a collective: every rank calls it)."""
        assert self._last is not None
        sums, counts = self._last
        total = sums.detach().double().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return dict(zip(METRICS, (total / counts[0].clamp(min=1)).tolist()))

    def evaluate(self, model: nn.Module, held_out: list[PairBatch], *, device: torch.device) -> dict:
        """The loss and metrics over every held-out pair, all ranks together (a collective)."""
        assert self.reference is not None
        # pairs, summed pair losses, chosen tokens' NLL, chosen tokens, then the metrics' sums
        totals = torch.zeros(4 + len(METRICS), dtype=torch.float64, device=device)
        model.eval()
        with torch.no_grad():
            for batch in held_out:
                batch = batch.to(device)
                reference = self.reference.logps(batch)
                policy, tokens = references.forward_pairs(model, batch)
                terms = preference_terms(policy, reference, tokens, self.settings)
                counts = torch.stack([torch.tensor(float(batch.pairs), device=device), terms.losses.sum(),
                                      terms.chosen_nll, tokens[:, 0].sum()])
                totals += torch.cat([counts, terms.metric_sums]).double()
        model.train()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        pairs = totals[0].clamp(min=1)
        loss = totals[1] / pairs
        if self.settings.rpo_alpha:
            loss = loss + self.settings.rpo_alpha * totals[2] / totals[3].clamp(min=1)
        return {"eval_loss": loss.item(),
                **{f"eval_{name}": value for name, value in zip(METRICS, (totals[4:] / pairs).tolist())}}

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        if self.reference is not None:
            self.reference.save(folder, writer_rank=writer_rank)

    def describe(self) -> dict:
        return {"objective": self.name, "dpo": dataclasses.asdict(self.settings),
                "reference": None if self.reference is None else self.reference.kind}

    def extra_flops_per_token(self, *, n_params: int, n_layers: int, n_heads: int, head_dim: int,
                              seq_len: int) -> float:
        """The reference's forward per trained token (2 per weight, a third of attention's
        training FLOPs); none when precomputed."""
        if self.settings.reference == "precomputed":
            return 0.0
        return 2.0 * n_params + 4.0 * n_layers * n_heads * head_dim * seq_len
