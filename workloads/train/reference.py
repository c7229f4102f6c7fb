"""The reference model of a preference objective: each pair's log-probabilities under the model
training started from (workloads/train/preference.py divides the policy's by them).

Three ways to get them (`dpo.reference` and the method choose):
- `AdaptersOff` (method "lora", reference "model"): the policy itself with its LoRA adapters
  switched off, a forward without gradients before the policy's own; no second copy of anything.
- `FrozenCopy` (method "full", reference "model"): a copy of the starting model, frozen and sharded
  as the policy is (bf16 under mixed precision: half the policy's fp32 weights, no gradient or
  optimizer state), one forward without gradients per micro-batch.
- `PrecomputedReference` (reference "precomputed"): one pass of the starting model over every pair,
  training and held-out, before the first step; the table (two fp32 numbers per pair) is kept in
  every checkpoint (REFERENCE_FILE), so a resumed run reads it instead of the changed policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from workloads.train.config import TrainConfig
from workloads.train.logprobs import CausalLMWithLogProbs, TokenLogProbs
from workloads.train.model import build_causal_lm, causal_lm_on_meta, load_pretrained, model_config
from workloads.train.pairs import PairBatch
from workloads.train.parallel import parallelize

REFERENCE_FILE = "reference_logps.safetensors"
"""In a checkpoint folder: the precomputed reference log-probabilities ("logps": [pairs, 2], chosen
then rejected, NaN for a pair the data no longer holds)."""


def pair_sums(token_logps: torch.Tensor, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, 2] log-probabilities, [P, 2] answer tokens) of the batch's pairs, chosen then rejected:
    the per-token log-probabilities summed over each sequence's answer."""
    size = batch.rows * batch.slots * 2
    valid = batch.sequence >= 0
    index = batch.sequence.clamp(min=0)
    logps = torch.zeros(size, dtype=torch.float32, device=token_logps.device).index_add(
        0, index, token_logps * valid)
    tokens = torch.zeros(size, dtype=torch.float32, device=token_logps.device).index_add(0, index, valid.float())
    return logps.view(-1, 2).index_select(0, batch.pair_index), tokens.view(-1, 2).index_select(0, batch.pair_index)


def forward_pairs(model: nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's pair log-probabilities and answer tokens for the batch."""
    return pair_sums(model(batch.input_ids, batch.labels, batch.position_ids, label_index=batch.label_index,
                           **batch.attention()), batch)


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward (the root's and the last layer's,
    kept for a backward that a model without gradients never runs)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Reference(Protocol):
    kind: str

    def logps(self, batch: PairBatch) -> torch.Tensor:
        """[P, 2] fp32 reference log-probabilities of the batch's pairs (no gradient)."""

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        """What a checkpoint keeps of it (nothing, but a precomputed table)."""


class AdaptersOff:
    kind = "adapters-off"

    def __init__(self, model: nn.Module, *, untrained) -> None:
        self.model = model
        self.untrained = untrained
        """A context in which the model computes as it started (the method's `untrained`)."""

    def logps(self, batch: PairBatch) -> torch.Tensor:
        with torch.no_grad(), self.untrained(self.model.lm):
            return forward_pairs(self.model, batch)[0]

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        return None


class FrozenCopy:
    kind = "frozen-copy"

    def __init__(self, model: CausalLMWithLogProbs) -> None:
        self.model = model

    def logps(self, batch: PairBatch) -> torch.Tensor:
        with torch.no_grad():
            out = forward_pairs(self.model, batch)[0]
        reshard(self.model)
        return out

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        return None


def frozen_copy(cfg: TrainConfig, *, policy: nn.Module, pretrained: Optional[Path], device: torch.device,
                loss: TokenLogProbs) -> FrozenCopy:
    """The starting model again, frozen, sharded over the policy's mesh (bf16 under mixed
    precision), every layer resharded after its forward; filled from the pretrained folder (or the
    same seed's random weights)."""
    if pretrained is None:
        lm = build_causal_lm(cfg.model, device=device, seed=cfg.seed)
    else:
        lm = causal_lm_on_meta(model_config(cfg.model, pretrained=pretrained))
    lm.requires_grad_(False)
    if cfg.mixed_precision:
        for param in lm.parameters():
            param.data = param.data.to(torch.bfloat16)
    mesh = next(p for p in policy.parameters()).device_mesh
    model = parallelize(CausalLMWithLogProbs(lm, loss=loss), mesh=mesh, compile=cfg.compile,
                        mixed_precision=cfg.mixed_precision, reshard_after_forward=True)
    if pretrained is not None:
        load_pretrained(model.lm, pretrained, device=device)
    model.eval()
    return FrozenCopy(model)


class PrecomputedReference:
    kind = "precomputed"

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        """[pairs, 2] fp32 on the device, indexed by pair number."""

    def logps(self, batch: PairBatch) -> torch.Tensor:
        return self.table.index_select(0, batch.pair_ids)

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        if writer_rank:
            from safetensors.torch import save_file

            save_file({"logps": self.table.cpu().contiguous()}, str(folder / REFERENCE_FILE))


def precompute(model: nn.Module, batches: Iterable[PairBatch], *, pairs: int, device: torch.device
               ) -> PrecomputedReference:
    """One pass of `model`, before its first step, over this rank's `batches` (every rank the same
    number: each is a collective), the results gathered into one table on every rank; `pairs`: the
    largest pair number + 1."""
    ids, values = [], []
    model.eval()
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            ids.append(batch.pair_ids)
            values.append(forward_pairs(model, batch)[0])
    model.train()
    mine = (torch.cat(ids).cpu(), torch.cat(values).float().cpu())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    table = torch.full((pairs, 2), float("nan"))
    for pair_ids, logps in everyone:
        table[pair_ids] = logps
    return PrecomputedReference(table.to(device))


def load_precomputed(folder: Path, *, device: torch.device) -> PrecomputedReference:
    """The table a checkpoint kept; ValueError where it kept none."""
    path = folder / REFERENCE_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {folder} holds no precomputed reference log-probabilities ({REFERENCE_FILE}): "
                         'it was trained with dpo.reference="model"; resume it with that, or start a new run')
    from safetensors.torch import load_file

    return PrecomputedReference(load_file(str(path))["logps"].to(device))
