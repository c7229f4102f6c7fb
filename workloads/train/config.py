"""The training job's typed configuration: frozen dataclasses validated at construction.

A config travels as JSON (the Ray job passes it on the command line), so `TrainConfig.from_dict`
and `to_dict` round-trip, and unknown keys are rejected with the closest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from workloads.train.evaluation_config import EvaluateConfig
from workloads.model_io.architectures import NAMED_ARCHITECTURES
from workloads.train.records import DATA_FORMATS
from workloads.transport.gate import GateConfig

DATA_KINDS = ("synthetic", "jsonl", "hub")
METHODS = ("full", "lora")

DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B"
"""What the GPU presets fine-tune: the base model, from the Hugging Face hub."""

DEFAULT_DATASET = "HuggingFaceH4/ultrachat_200k"
"""What the GPU presets fine-tune on: multi-turn chats (MIT licence), split `train_sft`."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name_or_path: str = "tiny-qwen2"
    """A named architecture built with random weights ("tiny-qwen2" for CPU, "qwen2.5-1.5b" for
    the Qwen2.5-1.5B shape), or a pretrained Hugging Face model: a hub id (`Qwen/Qwen2.5-1.5B`),
    an `s3://bucket/prefix` holding a model folder, or a local folder (a path on the Ray nodes).
    Remote ones are downloaded once per node; the weights go straight into each rank's shards."""

    revision: str = ""
    """The hub revision (branch, tag or commit) of a hub model; empty: its default branch. `submit`
    and `run --local` pin it to the commit it names then (workloads/client/revisions.py)."""

    attn_implementation: str = "varlen"
    """The attention backend: "varlen" (workloads/train/attention.py: packed samples as
    variable-length sequences, no mask; torch's FlashAttention kernels on CUDA) or one of
    transformers' ("sdpa", "eager", "flex_attention", "flash_attention_2", ...)."""

    activation_checkpointing: bool = False
    """Keep only each decoder layer's input through forward and run the layer's forward again in
    backward (torch's non-reentrant checkpoint, applied before compile and FSDP2 as torchtitan
    does): activations shrink to one hidden state per layer and token, for about a third more
    compute. The loss and gradients are those without it."""

    activation_offloading: bool = False
    """With activation_checkpointing: the input each checkpointed layer keeps goes to pinned host
    memory on a side stream during forward and comes back one layer ahead of its recomputation in
    backward (workloads/train/offload.py), so the GPU holds about two layers' inputs instead of
    every layer's. CUDA only (on the CPU nothing moves); the loss and gradients are those without it.
    `plan` and the fit check turn it on where a run would not fit otherwise, and say so."""

    adapter: str = "merge"
    """Where name_or_path is a LoRA run (or its exported model) and method is "lora": "merge" starts
    from its merged weights; "stack" starts from its base model with its adapter loaded beneath the
    new ones and kept frozen (`lora.stacked_adapter`; the reference of a preference objective is
    then the base with that adapter). workloads/model_io/run_model.py finds what a run names."""

    def __post_init__(self) -> None:
        if self.activation_offloading and not self.activation_checkpointing:
            raise ValueError("model.activation_offloading moves what each checkpointed layer keeps to host memory, "
                             "and model.activation_checkpointing is false: set "
                             "model.activation_checkpointing=true as well, or model.activation_offloading=false")
        if self.adapter not in ("merge", "stack"):
            raise ValueError(f"model.adapter is {self.adapter!r}: use 'merge' (a LoRA run's merged weights) or 'stack' "
                             "(its base with its adapter kept beneath the new ones)")
        if not self.name_or_path.strip():
            raise ValueError(
                f"model.name_or_path is empty: use one of {', '.join(NAMED_ARCHITECTURES)}, "
                "a Hugging Face id, an s3:// prefix or a local model folder"
            )

    @property
    def is_named_architecture(self) -> bool:
        return self.name_or_path in NAMED_ARCHITECTURES


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    kind: str = "synthetic"
    """"synthetic": generated sequences a model can learn (a falling loss proves training works);
    "jsonl": records from `path`, a JSONL file (local, or s3://); "hub": records from the hub
    dataset `path`, split `split` (its JSONL or Parquet files). Records are chats (`messages`,
    loss on the assistant tokens only) or plain text, tokenized and packed to seq_len."""

    path: str = ""
    """The JSONL file (kind "jsonl": a local path, uploaded with the job when small, or an s3://
    URI) or the hub dataset id (kind "hub", e.g. HuggingFaceH4/ultrachat_200k)."""

    split: str = "train"
    """The hub dataset's split (kind "hub")."""

    revision: str = ""
    """The hub dataset's revision (kind "hub"); empty: its default branch. Pinned to a commit at
    submission, as model.revision is."""

    format: str = "auto"
    """How a record reads (workloads/train/records.py): "messages" ({"role", "content"} chats),
    "text", "alpaca" (instruction, optional input, output, optional system), "sharegpt"
    (`conversations` of {"from", "value"}); "auto": each record's by its keys, refused where two fit."""

    text_field: str = "text"
    """The key of a plain-text record's text."""

    messages_field: str = "messages"
    """The key of a chat record's list of {"role", "content"} messages."""

    tokenizer: str = ""
    """A tokenizer id or folder; empty means the model's own (which a named architecture lacks)."""

    max_examples: int = 0
    """Read at most this many records (in file order); 0 reads them all."""

    eval_fraction: float = 0.05
    """The share of records held out (a seeded choice) for the eval loss; synthetic data draws its
    eval samples from a separate stream instead."""

    shuffle: bool = True
    """Visit the packed samples in a seeded random order, reshuffled each epoch."""

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(f"data.kind is {self.kind!r}: use one of {', '.join(DATA_KINDS)}")
        if self.kind == "synthetic" and self.path:
            raise ValueError(f'data.path is {self.path!r} but data.kind is "synthetic", which generates its tokens and '
                             'reads no file: set data.kind=jsonl (a JSONL or Parquet file) or data.kind=hub (a hub '
                             'dataset id), or leave data.path empty')
        if self.kind == "jsonl" and not self.path:
            raise ValueError('data.path is empty: kind "jsonl" needs the path (or s3:// URI) of a JSONL file')
        if self.kind == "hub" and "/" not in self.path:
            raise ValueError(f'data.path is {self.path!r}: kind "hub" needs a hub dataset id such as {DEFAULT_DATASET}')
        if self.format not in DATA_FORMATS:
            raise ValueError(f"data.format is {self.format!r}: use one of {', '.join(DATA_FORMATS)}")
        if not self.text_field or not self.messages_field:
            raise ValueError("data.text_field and data.messages_field must name the JSONL keys of text and messages")
        if self.max_examples < 0:
            raise ValueError(f"data.max_examples is {self.max_examples}: use 0 (all) or a positive number")
        if not 0 <= self.eval_fraction <= 0.5:
            raise ValueError(f"data.eval_fraction is {self.eval_fraction}: use a share in [0, 0.5], e.g. 0.05")


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The adapters of `method: lora` (peft's LoRA): each target linear layer W of the decoder gets
    W + (alpha / rank) * B A, A of rank x in and B of out x rank, B starting at zero."""

    rank: int = 16
    """r: the adapters' inner dimension."""

    alpha: float = 32.0
    """The adapters' output is scaled by alpha / rank."""

    dropout: float = 0.0
    """Dropout on each adapter's input (0: none, and no copy of the input is made)."""

    target_modules: tuple[str, ...] = ()
    """Names of the linear modules that get adapters (the last part of their path, e.g. q_proj);
    empty: every linear layer of the decoder layers (for Qwen2: q, k, v, o, gate, up and down)."""

    stacked_adapter: str = ""
    """A peft adapter folder (local or s3://) loaded beneath the trained adapters and kept frozen: an
    SFT run's, which `model.adapter: stack` sets from the run. Empty: none."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank is {self.rank}: use a positive rank such as 16")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha is {self.alpha}: use a positive scale such as 32 (twice the rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout is {self.dropout}: use a probability in [0, 1), e.g. 0.05")
        if not all(isinstance(m, str) and m.strip() for m in self.target_modules):
            raise ValueError(f"lora.target_modules is {list(self.target_modules)}: give module names such as "
                             '["q_proj", "v_proj"], or [] for every linear layer of the decoder')


OBJECTIVES = ("sft", "dpo")
DPO_LOSS_TYPES = ("sigmoid", "ipo")
DPO_REFERENCES = ("model", "precomputed")
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                      "logps/rejected")
"""A preference objective's step metrics (TRL's names): means over the step's pairs; `eval_` + each on
the held-out pairs (workloads/train/preference.py)."""


@dataclass(frozen=True, kw_only=True)
class DpoSettings:
    """Direct preference optimization (`objective: dpo`; workloads/train/preference.py), with TRL's
    names: each record is a prompt with a chosen and a rejected answer, and the loss raises the
    policy's log-probability ratio to the reference of the chosen answer over the rejected one."""

    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta * (log pi - log pi_ref)
    of each answer (for IPO, the regularization tau)."""

    loss_type: str = "sigmoid"
    """"sigmoid": DPO's -log sigmoid(beta * margin); "ipo": IPO's (margin / answer tokens - 1 /
    (2 beta))^2, the margins averaged per answer token as TRL computes it."""

    label_smoothing: float = 0.0
    """cDPO: the share of pairs whose preference is taken to be flipped, so the sigmoid loss is
    -(1 - e) log sigmoid(beta * margin) - e log sigmoid(-beta * margin); 0: plain DPO."""

    rpo_alpha: float = 0.0
    """The weight of an SFT term, the mean negative log-likelihood of the chosen answers' tokens,
    added to the loss (RPO; TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]); 0: none."""

    reference: str = "model"
    """Where the reference log-probabilities come from. "model": computed at each step, by the
    policy with its adapters switched off for method "lora" (no second copy), by a frozen sharded
    copy of the starting model for method "full"; "precomputed": one pass of the starting model
    over every pair before the first step, kept with the run's checkpoints (no reference in memory
    while training; `plan` shows the memory of each)."""

    reference_model: str = ""
    """The model whose log-probabilities are the reference, when it is not the one training starts
    from (TRL's ref_model): a hub id, an s3:// prefix or a model folder, reading text with the
    policy's tokenizer (checked before the run starts). Empty: the starting model (or, for LoRA, the
    policy with its adapters off). A frozen sharded copy of it, or the table it precomputes."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"dpo.beta is {self.beta}: use a positive value such as 0.1")
        if self.reference_model in NAMED_ARCHITECTURES:
            raise ValueError(f"dpo.reference_model is {self.reference_model!r}, a named architecture (random weights): "
                             "give a pretrained model (hub id, s3:// prefix or folder), or leave it empty for the "
                             "starting model")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"dpo.loss_type is {self.loss_type!r}: use one of {', '.join(DPO_LOSS_TYPES)}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing is {self.label_smoothing}: use a share in [0, 0.5), e.g. 0.1")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"dpo.label_smoothing is {self.label_smoothing} but dpo.loss_type is "
                             f"{self.loss_type!r}: label smoothing (cDPO) applies to the sigmoid loss; set one or "
                             "the other")
        if not self.rpo_alpha >= 0:
            raise ValueError(f"dpo.rpo_alpha is {self.rpo_alpha}: use 0 (no SFT term) or a positive weight such as 1")
        if self.reference not in DPO_REFERENCES:
            raise ValueError(f"dpo.reference is {self.reference!r}: use one of {', '.join(DPO_REFERENCES)}")


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """What the run keeps of its checkpoints besides the latest (how often it saves: checkpoint_every)."""

    keep_best: bool = False
    """Keep the model of the lowest eval loss, as HF Trainer's load_best_model_at_end does: every
    evaluation saves a checkpoint (and every checkpoint is evaluated), the one with the lowest eval
    loss so far carries the exported model, Ray Train keeps the best by eval loss beside the latest,
    and the run's model (`run --local`, `export --checkpoint best`) is the best one's. Needs
    eval_every."""


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where rank 0 logs the run (workloads/train/tracking.py): MLflow, when a URI is set. Not a
    hyperparameter: this section is left out of the run's logged parameters."""

    uri: str = ""
    """The MLflow tracking URI: `http(s)://host:port`, `sqlite:///file.db`, or a SageMaker managed
    MLflow tracking server's ARN (with the sagemaker-mlflow plugin). Empty: $MLFLOW_TRACKING_URI
    where rank 0 runs, else no tracking (and MLflow is never imported); "off": no tracking, whatever
    the environment says."""

    experiment: str = ""
    """The MLflow experiment, created when missing; empty: "local". `submit --stack` sets the stack."""

    run_name: str = ""
    """The run's name in the tracker; the client sets the Ray Train run name. A run resumed under the
    same name continues the same tracker run (its id is also kept with each checkpoint)."""

    tags: dict[str, str] = field(default_factory=dict)
    """Tags of the run besides those the loop sets (the client adds stack, image, git commit)."""

    artifact_location: str = ""
    """Where a new experiment keeps its artifacts; empty: the server's default, or, for a sqlite
    store, an `artifacts` folder beside its database file."""

    flush_timeout_s: float = 30.0
    """At the end of the run, how long rank 0 waits for records not yet sent (a tracker that is down)
    before it gives up on them and returns."""

    buffer_records: int = 10_000
    """Records kept while the tracker does not answer; beyond this the oldest step records are
    dropped (and counted in the final warning)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tags, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.tags.items()):
            raise ValueError(f"tracking.tags is {self.tags!r}: use a mapping of strings, e.g. "
                             '--set \'tracking.tags={"team":"ml"}\'')
        if not self.flush_timeout_s >= 0:
            raise ValueError(f"tracking.flush_timeout_s is {self.flush_timeout_s}: use 0 or more seconds")
        if self.buffer_records < 1:
            raise ValueError(f"tracking.buffer_records is {self.buffer_records}: it must be at least 1")

    @property
    def experiment_name(self) -> str:
        return self.experiment or "local"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """What to train."""

    data: DataConfig = field(default_factory=DataConfig)
    """What to train on."""

    method: Literal["full", "lora"] = "full"
    """"full": every weight trains (fp32 master weights and AdamW state for all of them); "lora":
    the model's weights stay frozen (sharded in bf16 with mixed_precision) and only low-rank
    adapters train, in fp32 (`lora`; workloads/train/method.py). Checkpoints then hold the adapters
    and their optimizer state only; the export is the merged model plus the adapter in peft's format."""

    lora: LoraSettings = field(default_factory=LoraSettings)
    """The adapters, with method "lora" (ignored otherwise)."""

    objective: str = "sft"
    """What the loss trains for: "sft", the next-token loss on the records' answers (or whole
    texts); "dpo", preference pairs (`dpo`; records of a prompt, a chosen and a rejected answer)."""

    dpo: DpoSettings = field(default_factory=DpoSettings)
    """The preference loss and its reference, with objective "dpo" (ignored otherwise)."""

    seq_len: int = 64
    """Tokens per sample."""

    micro_batch: int = 8
    """Samples per rank per micro-step (a step trains micro_batch * grad_accum_steps * world size).
    With rows_per_step, `submit` and `plan` pick it from the GPU's memory when it is not set
    (workloads/client/fit.py, `micro_batch_for`)."""

    steps: int = 60
    """Optimizer steps of the whole run (a resumed run continues up to this number)."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""

    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio on the last step."""

    warmup_steps: int = 5
    """Steps of linear warmup from lr / warmup_steps up to lr (a run shorter than its warmup, such
    as a quick benchmark, never leaves it)."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    mixed_precision: bool = False
    """bf16 compute with fp32 master weights, fp32 optimizer state and fp32 gradient reduction.
    Off: everything in fp32 (what CPU runs use)."""

    compile: bool = False
    """torch.compile each decoder layer (before sharding, as torchtitan does)."""

    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered parameters after its forward and gather them again for
    backward. False keeps them until backward: more memory, one all-gather less per layer."""

    parallelism: typing.Literal["auto", "fsdp", "hsdp"] = "auto"
    """How FSDP2 spreads the model over the ranks. "fsdp": shard over every rank (one mesh
    dimension); "hsdp": shard within each node and replicate across nodes, so only a gradient
    all-reduce crosses between nodes; "auto": HSDP on two or more nodes with equal numbers of ranks
    when a node's share of the model state fits in half a device's memory, flat FSDP otherwise
    (workloads/train/parallel.py, `plan_mesh`)."""

    cross_node_reduce_dtype: typing.Literal["bfloat16", "float32"] = "bfloat16"
    """The dtype gradients cross between nodes in, with mixed_precision (without it, everything
    is fp32). Under HSDP the last micro-step of each optimizer step reduces in it, both its in-node
    reduce-scatter and the cross-node all-reduce (FSDP2 has one reduce dtype per reduction); the
    earlier micro-steps reduce in fp32 and their partial sums stay fp32. bf16 halves the bytes on
    the slow link (tests/test_loop_topology.py bounds the effect)."""

    grad_accum_steps: int = 1
    """Micro-steps per optimizer step: each rank runs this many micro-batches and sums their
    gradients before one optimizer step, so a step trains on micro_batch * grad_accum_steps *
    world size samples. Under HSDP only the last micro-step reduces across nodes. Left at 1 with
    rows_per_step, which sets it for the world size the run has."""

    rows_per_step: int = 0
    """Rows (samples) per optimizer step, all ranks together, whatever the world size: each rank then
    trains rows_per_step / world size rows a step, in micro-batches of up to micro_batch rows (the
    largest that divides them), so the recipe (rows per step, steps, learning rate) is the same on 8
    GPUs or 16; a world size that does not divide it is refused before the run starts. The GPU
    presets set 128 (ROWS_PER_STEP). 0: grad_accum_steps micro-steps per rank, and the rows per step
    grow with the world size."""

    fused_linear_ce: bool = True
    """Compute the loss from the final hidden states without materializing the full-vocabulary
    logits (liger-kernel on CUDA when installed, otherwise a chunked implementation)."""

    loss_chunk_size: int = 4096
    """Tokens per chunk of the chunked linear cross-entropy."""

    checkpoint_every: int = 20
    """Save a checkpoint every this many steps and after the last one; 0 disables checkpoints."""

    preemption_check_every: int = 5
    """Ask every this many steps whether a node of the run is being drained (a Spot interruption)
    and save a checkpoint at once when one is (workloads/train/preemption.py); 0 never asks. Each
    ask is a barrier of a few milliseconds (docs/RELIABILITY.md); the drain leaves 95 s."""

    log_every: int = 5
    """Report metrics every this many steps (and on the last one). Only log steps read values
    back from the device."""

    eval_every: int = 0
    """Compute the loss on the held-out data every this many steps (and on the last one), reported
    as `eval_loss`; 0 never does."""

    eval_batches: int = 4
    """Micro-batches per rank in one evaluation at the planned world size, at most (a smaller
    held-out set is used whole); on other world sizes the same held-out samples, in more or fewer."""

    export_model: bool = True
    """Write the trained model as a Hugging Face folder (`model/` in the final checkpoint) at the
    end of a run that saves checkpoints."""

    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The exported weights' dtype; "auto": the pretrained model's own (bfloat16 for Qwen2.5),
    float32 for a model trained from random weights."""

    cache_dir: str = ""
    """Where each node keeps downloaded models and data (shared by its ranks); empty:
    $WORKLOADS_CACHE, else $XDG_CACHE_HOME/workloads (~/.cache/workloads). A folder only the user
    running the ranks may write (workloads/model_io/cache.py refuses another)."""

    seed: int = 0
    """Seeds the random weights and the data order (the same on every rank)."""

    peak_flops: Optional[float] = None
    """Dense bf16 FLOP/s of one accelerator, the denominator of MFU. None: the GPU's own, found by its
    CUDA device name in workloads/gpus.py; a GPU not there reports no MFU. Set it for such a GPU."""

    transport: GateConfig = field(default_factory=GateConfig)
    """The in-band transport gate run before the first step (workloads/transport/gate.py)."""

    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """The experiment tracker rank 0 logs to (off unless a URI is set)."""

    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    """Which checkpoints are kept (`checkpoint.keep_best`)."""

    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """The stage after training: the tuned model and its base on the same tasks, and the gate
    (workloads/evaluate)."""

    def __post_init__(self) -> None:
        positive = ("seq_len", "micro_batch", "steps", "log_every", "loss_chunk_size", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: it must be at least 1")
        non_negative = ("warmup_steps", "weight_decay", "grad_clip", "checkpoint_every", "seed", "eval_every",
                        "preemption_check_every")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is {getattr(self, name)}: it must be 0 or more")
        if not self.lr > 0:
            raise ValueError(f"lr is {self.lr}: use a positive learning rate such as 2e-5")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio is {self.min_lr_ratio}: use a value in [0, 1]")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas is {self.betas}: use two values in [0, 1), e.g. [0.9, 0.95]")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"peak_flops is {self.peak_flops}: use the device's dense bf16 FLOP/s, or null for the "
                             "GPU's own from workloads/gpus.py")
        if self.eval_every and self.data.kind != "synthetic" and self.data.eval_fraction == 0:
            raise ValueError(
                f"eval_every is {self.eval_every} but data.eval_fraction is 0, so nothing is held out: "
                "set data.eval_fraction (e.g. 0.05) or eval_every=0"
            )
        if self.data.kind != "synthetic" and not self.data.tokenizer and self.model.is_named_architecture:
            raise ValueError(
                f"data.tokenizer is empty and model.name_or_path {self.model.name_or_path!r} has no "
                "tokenizer: set data.tokenizer to a tokenizer id or folder"
            )
        if self.checkpoint.keep_best and not self.eval_every:
            raise ValueError("checkpoint.keep_best keeps the checkpoint of the lowest eval loss, and eval_every is 0: "
                             "set eval_every (e.g. 50) and a held-out share (data.eval_fraction)")
        if self.method not in METHODS:
            raise ValueError(f"method is {self.method!r}: use one of {', '.join(METHODS)}")
        self._check_objective()
        self._check_parallelism()

    def _check_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective is {self.objective!r}: use one of {', '.join(OBJECTIVES)}")
        if self.objective != "dpo":
            return
        if self.data.format != "auto":
            raise ValueError(f'data.format is {self.data.format!r} but objective is "dpo", which reads preference '
                             "records (prompt/chosen/rejected, strings or conversations): leave data.format at auto")
        if self.seq_len < 4:
            raise ValueError(f'seq_len is {self.seq_len}: with objective "dpo" a row holds a pair\'s two sequences, '
                             "each up to seq_len / 2 positions: use at least 4 (e.g. 4096)")

    def _check_parallelism(self) -> None:
        if self.parallelism not in ("auto", "fsdp", "hsdp"):
            raise ValueError(f"parallelism is {self.parallelism!r}: use 'auto', 'fsdp' or 'hsdp'")
        if self.cross_node_reduce_dtype not in ("bfloat16", "float32"):
            raise ValueError(
                f"cross_node_reduce_dtype is {self.cross_node_reduce_dtype!r}: use 'bfloat16' or 'float32'"
            )
        if isinstance(self.grad_accum_steps, bool) or self.grad_accum_steps < 1:
            raise ValueError(
                f"grad_accum_steps is {self.grad_accum_steps}: use 1 (no accumulation) or more micro-steps"
            )
        if isinstance(self.rows_per_step, bool) or self.rows_per_step < 0:
            raise ValueError(f"rows_per_step is {self.rows_per_step}: use 0 (grad_accum_steps per rank) or the rows "
                             "of one optimizer step, e.g. 128")
        if self.rows_per_step and self.grad_accum_steps != 1:
            raise ValueError(
                f"grad_accum_steps is {self.grad_accum_steps} but rows_per_step {self.rows_per_step} sets the "
                "accumulation for the world size: set rows_per_step=0 to give grad_accum_steps per rank, or leave "
                "grad_accum_steps out")

    @property
    def samples_per_rank_per_step(self) -> int:
        """Samples each rank trains on per optimizer step (all its micro-steps)."""
        return self.micro_batch * self.grad_accum_steps

    def for_world_size(self, world_size: int) -> TrainConfig:
        """The config as `world_size` ranks run it: with rows_per_step, the micro-batch and micro-steps
        that make those rows on that many ranks (rows_per_step then 0: they say it); unchanged
        without. ValueError, naming the world sizes that would do, where the rows do not divide
        among the ranks."""
        if not self.rows_per_step:
            return self
        from workloads.train.elastic import micro_steps_for_rows

        micro_batch, steps = micro_steps_for_rows(world_size, micro_batch=self.micro_batch,
                                                  rows_per_step=self.rows_per_step)
        return dataclasses.replace(self, micro_batch=micro_batch, grad_accum_steps=steps, rows_per_step=0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return _build(cls, d, prefix="")

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("the config must be a JSON object")
        return cls.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_plain(v) for v in obj]
    return obj


def _build(cls: type, d: Any, *, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {prefix + key!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, name=f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, *, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=f"{name}.")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) == 1:
            return _coerce(options[0], value, name=name)
        return value
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{name} is {value!r}: use one of {', '.join(map(repr, choices))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        args = typing.get_args(hint)
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        return tuple(_coerce(t, v, name=name) for t, v in zip(item_types, value, strict=False))
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value


def with_overrides(cfg: TrainConfig, assignments: list[str]) -> TrainConfig:
    """Apply `key=value` strings (dotted keys for nested fields, values parsed as JSON when they
    parse, else taken as strings): `steps=20`, `model.name_or_path=Qwen/Qwen2.5-1.5B`. A
    grad_accum_steps set without rows_per_step means micro-steps per rank, as it does without a
    preset: it drops the preset's rows_per_step. model.activation_checkpointing=false without
    model.activation_offloading turns offloading off too (it moves what checkpointing keeps)."""
    d = cfg.to_dict()
    keys = {item.partition("=")[0] for item in assignments}
    if "grad_accum_steps" in keys and "rows_per_step" not in keys:
        d["rows_per_step"] = 0
    if "model.activation_checkpointing=false" in assignments and "model.activation_offloading" not in keys:
        d["model"]["activation_offloading"] = False  # nothing is left to offload
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: use key=value, e.g. --set steps=20")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = d
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                dotted = ".".join(parents[: i + 1])
                raise ValueError(f"--set {item!r}: {dotted!r} is not a nested config section")
            node = node[part]
        node[leaf] = value
    return TrainConfig.from_dict(d)


def _demo_cpu() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(name_or_path="tiny-qwen2"),
        data=DataConfig(kind="synthetic"),
        seq_len=64,
        micro_batch=8,
        # The demo's toy chats need about 200 steps before its tiny model answers them right.
        steps=200,
        lr=1e-2,
        warmup_steps=5,
        checkpoint_every=100,
        log_every=20,
        eval_every=50,
        eval_batches=2,
    )


def _demo_cpu_dpo() -> TrainConfig:
    # The demo's DPO variant (`run --local --preset demo-cpu-dpo`): the demo writes the toy model and
    # toy preference pairs whose chosen answer follows a rule (workloads/local/demo.py); on its own,
    # generated token-id pairs. Each sequence is under 40 positions: rows of 128 hold two pairs or so.
    return dataclasses.replace(_demo_cpu(), objective="dpo", seq_len=128, micro_batch=4, steps=60, lr=1e-2,
                               checkpoint_every=30, log_every=10, eval_every=20, eval_batches=4)


def _qwen25_1_5b_synthetic() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(name_or_path="qwen2.5-1.5b"),
        data=DataConfig(kind="synthetic"),
        seq_len=2048,
        micro_batch=16,
        steps=100,
        lr=2e-5,
        warmup_steps=10,
        mixed_precision=True,
        compile=True,
        # 1.5B parameters fit unsharded in bf16 (3 GiB); keeping them through backward saves
        # one all-gather per layer.
        reshard_after_forward=False,
        fused_linear_ce=True,
        checkpoint_every=50,
        log_every=10,
    )


ROWS_PER_STEP = 128
"""Rows (samples) per optimizer step of the GPU fine-tune presets (`rows_per_step`), on any number of
GPUs: the learning rate and step count are tuned for it."""


def _qwen25_1_5b() -> TrainConfig:
    # The Qwen2.5-1.5B fine-tune: the pretrained base model and an instruction dataset, both from
    # the hub (the cluster reaches it through its NAT gateway). 128 rows per step on any cluster:
    # 16 rows per micro-step and one micro-step per rank on 8 GPUs, 8 rows on 16 GPUs.
    return dataclasses.replace(
        _qwen25_1_5b_synthetic(),
        model=ModelConfig(name_or_path=DEFAULT_MODEL),
        # 20,000 conversations are about 11,000 rows of 2,048 tokens: one pass at 100 steps of 128 rows.
        data=DataConfig(kind="hub", path=DEFAULT_DATASET, split="train_sft", max_examples=20_000,
                        eval_fraction=0.02),
        eval_every=25,
        rows_per_step=ROWS_PER_STEP,
    )


def _qwen25_1_5b_24gb() -> TrainConfig:
    # The same fine-tune sized for 24 GB GPUs (g6's L4, g5's A10G): by the H200 runs of
    # docs/PERFORMANCE.md, activations take ~3.8 GiB per 2,048-token sample, and resharding after
    # forward keeps only one layer's bf16 weights gathered at a time. Micro-batches of 2 rows: on the
    # default cluster (2 x 4 GPUs) 8 micro-steps make the 128 rows of a step, as `qwen2.5-1.5b`'s
    # 16 x 1 x 8 do, so both presets take the same learning rate and number of steps over the data
    # (tests/test_loop_config.py ties them), and under HSDP only the last micro-step crosses the
    # network.
    return dataclasses.replace(_qwen25_1_5b(), micro_batch=2, reshard_after_forward=True)


QWEN25_7B_INSTRUCT = "Qwen/Qwen2.5-7B-Instruct"
"""What the 7B presets fine-tune (hub id; its shape with random weights is `qwen2.5-7b`)."""


def _qwen25_7b_lora_24gb() -> TrainConfig:
    # LoRA of Qwen2.5-7B-Instruct on one g6.12xlarge (4 L4, 24 GB): the frozen base in bf16 is 3.8 GB
    # per GPU once sharded over the four, the adapters and their AdamW state a few hundred MB, and
    # with each decoder layer checkpointed micro-batches of 8 rows fit (workloads/sizing/memory.py:
    # 13 GiB per L4). 8 x 4 micro-steps x 4 ranks = 128 rows per step, as the 1.5B presets.
    return dataclasses.replace(
        _qwen25_1_5b(), model=ModelConfig(name_or_path=QWEN25_7B_INSTRUCT, activation_checkpointing=True),
        method="lora", lora=LoraSettings(rank=16, alpha=32.0), micro_batch=8, lr=2e-4, reshard_after_forward=True,
    )


def _qwen25_7b_24gb() -> TrainConfig:
    # The full fine-tune of Qwen2.5-7B-Instruct on 2 x g6.12xlarge (8 L4): fp32 weights, gradients and
    # AdamW state are 16 bytes per parameter, 122 GB, so every rank holds an eighth (flat FSDP over
    # both nodes: a node's share would not leave room), with each layer checkpointed and one
    # 2,048-token row per micro-step: 20 GiB per L4 (workloads/sizing/memory.py). 1 x 16 micro-steps x
    # 8 ranks = 128 rows per step. The tightest preset: the checkpointed layers' inputs wait in host
    # memory (activation_offloading), 0.36 GiB less per L4.
    return dataclasses.replace(
        _qwen25_1_5b(), model=ModelConfig(name_or_path=QWEN25_7B_INSTRUCT, activation_checkpointing=True,
                                          activation_offloading=True),
        micro_batch=1, lr=1e-5, reshard_after_forward=True,
    )


def _qwen25_7b() -> TrainConfig:
    # The full fine-tune of Qwen2.5-7B-Instruct on 80 GB GPUs (8 per node: p5.48xlarge, p4de): an eighth
    # of the model state is 14 GiB, so 4 rows of activations per micro-step fit without checkpointing.
    # 4 x 4 micro-steps x 8 ranks = 128 rows per step.
    return dataclasses.replace(
        _qwen25_1_5b(), model=ModelConfig(name_or_path=QWEN25_7B_INSTRUCT), micro_batch=4, lr=1e-5,
        reshard_after_forward=True,
    )


DEFAULT_PREFERENCE_DATASET = "trl-lib/ultrafeedback_binarized"
"""What the DPO presets train on: UltraFeedback's binarized pairs in TRL's conversational shape (MIT)."""
QWEN25_1_5B_INSTRUCT = "Qwen/Qwen2.5-1.5B-Instruct"
DPO_SEQ_LEN = 4096
"""Rows of the DPO presets: a pair's two sequences share a row, each up to 2,048 positions."""
DPO_ROWS_PER_STEP = 48
"""Rows per optimizer step of the DPO presets: about 140 UltraFeedback pairs (about 2.9 to a row)."""


def _qwen25_1_5b_dpo() -> TrainConfig:
    # DPO of Qwen2.5-1.5B-Instruct (or an SFT run of it: --set model.name_or_path=RUN) on UltraFeedback,
    # full fine-tune with a frozen bf16 copy as the reference. Rows of 4,096 positions hold a pair's
    # two sequences; 8 of them are the 32,768 tokens of the SFT preset's 16 x 2,048. On 80 GB GPUs and,
    # sized by `submit`'s memory model to a smaller micro-batch, on 2 x g6.12xlarge (8 L4): 48 rows per
    # step on either. One pass over 20,000 pairs in about 140 steps; lr 5e-7 and beta 0.1 as the
    # alignment handbook's DPO recipes.
    return dataclasses.replace(
        _qwen25_1_5b(), model=ModelConfig(name_or_path=QWEN25_1_5B_INSTRUCT), objective="dpo",
        dpo=DpoSettings(beta=0.1), data=DataConfig(kind="hub", path=DEFAULT_PREFERENCE_DATASET, split="train",
                                                    max_examples=20_000, eval_fraction=0.02),
        seq_len=DPO_SEQ_LEN, micro_batch=8, rows_per_step=DPO_ROWS_PER_STEP, steps=140, lr=5e-7, warmup_steps=10,
        reshard_after_forward=True, eval_every=25,
    )


def _qwen25_7b_lora_dpo_24gb() -> TrainConfig:
    # LoRA DPO of Qwen2.5-7B-Instruct on one g6.12xlarge (4 L4): the reference is the model with its
    # adapters switched off (no second copy); each decoder layer checkpointed, micro-batches of 4 rows of
    # 4,096 (the 16,384 tokens of the LoRA SFT preset's 8 x 2,048), 3 micro-steps x 4 ranks = 48 rows.
    return dataclasses.replace(
        _qwen25_1_5b_dpo(), model=ModelConfig(name_or_path=QWEN25_7B_INSTRUCT, activation_checkpointing=True),
        method="lora", lora=LoraSettings(rank=16, alpha=32.0), micro_batch=4, lr=5e-6,
    )


PRESETS = {
    "demo-cpu": _demo_cpu,
    "demo-cpu-dpo": _demo_cpu_dpo,
    "qwen2.5-1.5b": _qwen25_1_5b,
    "qwen2.5-1.5b-24gb": _qwen25_1_5b_24gb,
    "qwen2.5-1.5b-synthetic": _qwen25_1_5b_synthetic,
    "qwen2.5-7b": _qwen25_7b,
    "qwen2.5-7b-24gb": _qwen25_7b_24gb,
    "qwen2.5-7b-lora-24gb": _qwen25_7b_lora_24gb,
    "qwen2.5-1.5b-dpo": _qwen25_1_5b_dpo,
    "qwen2.5-7b-lora-dpo-24gb": _qwen25_7b_lora_dpo_24gb,
}
"""demo-cpu: the tiny model on CPU (`make demo`); qwen2.5-1.5b(-24gb): the fine-tune of the
pretrained model on the hub dataset, for 80 GB (24 GB) GPUs; qwen2.5-1.5b-synthetic: the same
shape with random weights on synthetic tokens, for benchmarks and GPU checks without a network;
qwen2.5-7b: the full fine-tune of Qwen2.5-7B-Instruct on 80 GB GPUs; qwen2.5-7b-24gb: the same on
2 x g6.12xlarge (8 x 24 GB); qwen2.5-7b-lora-24gb: its LoRA fine-tune on one g6.12xlarge;
demo-cpu-dpo: the demo's DPO variant; qwen2.5-1.5b-dpo: DPO of Qwen2.5-1.5B-Instruct on UltraFeedback
pairs (full, reference a frozen copy; 80 GB GPUs or 2 x g6.12xlarge); qwen2.5-7b-lora-dpo-24gb: LoRA
DPO of Qwen2.5-7B-Instruct on one g6.12xlarge."""

MODEL_SIZES = ("1.5b", "7b")
"""The model sizes `submit --model-size` chooses presets for."""

LARGE_GPU_GIB = 80
"""GPUs with at least this much memory run the 80 GB presets, smaller ones the 24 GB ones."""

FULL_7B_MIN_RANKS_24GB = 8
"""A full fine-tune of 7B on 24 GB GPUs needs its state sharded at least this many ways."""


def preset_for_gpu(gpu_memory_gib: int | None, *, model_size: str = "1.5b", gpus: int | None = None,
                   method: str | None = None) -> str:
    """The default fine-tune preset for GPUs of this much memory (None: unknown, the 80 GB preset):
    for 7B on smaller GPUs, the preset of `method` when the user set one, else the full fine-tune
    when there are enough GPUs (FULL_7B_MIN_RANKS_24GB), else LoRA."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"model size {model_size!r}: use one of {', '.join(MODEL_SIZES)}")
    large = gpu_memory_gib is None or gpu_memory_gib >= LARGE_GPU_GIB
    if model_size == "1.5b":
        return "qwen2.5-1.5b" if large else "qwen2.5-1.5b-24gb"
    if large:
        return "qwen2.5-7b"
    if method in METHODS:
        return "qwen2.5-7b-24gb" if method == "full" else "qwen2.5-7b-lora-24gb"
    return "qwen2.5-7b-24gb" if (gpus or 0) >= FULL_7B_MIN_RANKS_24GB else "qwen2.5-7b-lora-24gb"


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} (presets: {', '.join(PRESETS)})")
    return PRESETS[name]()
