"""A model out: Hugging Face folders (safetensors, config, generation config, tokenizer) from training.

Two ways in, one writer:
- at the end of a run, `write_weights_from_shards` gathers one parameter at a time from the FSDP2
  shards (every rank takes part, rank 0 writes), so no rank ever holds more than one full tensor on
  the GPU and one output file's worth in host memory;
- on demand, `export_run` consolidates any saved checkpoint (torch.distributed.checkpoint shards,
  local or in S3) the same way, tensor group by tensor group, or copies the folder the run already
  exported.

Every checkpoint folder carries `model/` with the config, generation config and tokenizer
(`ModelMetadata.write`), so any checkpoint can be turned into a loadable model without the
original source.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workloads.files import path_inside
from workloads.model_io.evaluation_file import gate_failed
from workloads.model_io.hf_writer import EXPORT_DTYPES, MAX_SHARD_BYTES, SafetensorsWriter, resolve_dtype
from workloads.model_io.load import INDEX_FILE, file_name, tensor_aliases
from workloads.model_io.lora_base import LoraBase
from workloads.model_io.run_layout import DCP_METADATA, MODEL_DIR, checkpoint_folders
from workloads.model_io.storage import local_location, locate


def log(message: str) -> None:
    print("[export] " + message, flush=True)


# --- writing ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelMetadata:
    """What a Hugging Face folder holds besides the weights."""

    config: object
    """The model's PreTrainedConfig."""
    generation_config: object
    """Its GenerationConfig (end-of-turn tokens included for chat fine-tunes)."""
    tokenizer: Optional[object]
    """The tokenizer trained with, or None when there is none (synthetic tokens)."""
    dtype: torch.dtype
    """The dtype the weights are written in."""

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = self.config.__class__.from_dict(self.config.to_dict())
        config.use_cache = True  # training turns the KV cache off; generation wants it
        config.dtype = self.dtype
        config.save_pretrained(folder)
        self.generation_config.save_pretrained(folder)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)


def generation_config_for(config, *, source: Optional[Path], extra_eos: list[int]):
    """The source folder's generation config (else one derived from the model config), with
    `extra_eos` (a chat template's end-of-turn token) added to its end tokens."""
    from transformers import GenerationConfig

    if source is not None and (source / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(source)
    else:
        generation = GenerationConfig.from_model_config(config)
    eos = generation.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    for token in extra_eos:
        if token not in eos:
            eos.append(token)
    if eos:
        generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    return generation


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter: a collective for a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name."""
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    return state


def write_tensors(tensors: Iterator[tuple[str, torch.Tensor]], writer: Optional[SafetensorsWriter], *,
                  dtype: torch.dtype) -> int:
    """Every rank runs through `tensors` (their gathers are collectives); the writing rank, the one
    with a `writer`, adds each in `dtype`. Returns the bytes written (0 on other ranks)."""
    with torch.no_grad():
        for name, full in tensors:
            if writer is not None:
                writer.add(name, full.detach().to(device="cpu", dtype=dtype))
            del full
    if writer is None:
        return 0
    writer.close()
    return writer.total_bytes


def write_weights_from_shards(lm: nn.Module, folder: Path, *, dtype: torch.dtype, writer_rank: bool) -> int:
    """Gather each distinct parameter (and persistent buffer) of the sharded `lm` in turn and, on the
    writing rank, add it to the folder's safetensors files in `dtype`. Every rank must call this
    (each gather is a collective). Returns the bytes written (0 on other ranks)."""
    state = named_tensors(lm)
    return write_tensors(((file_name(n), gathered(state[n])) for n in tensor_aliases(lm)),
                         SafetensorsWriter(folder) if writer_rank else None, dtype=dtype)


# --- consolidating a saved checkpoint -----------------------------------------------------------


def _meta_model(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _checkpoint_prefix(names: list[str], stored: dict) -> str:
    """The prefix under which the checkpoint keeps the Hugging Face model's tensors ("model.lm."):
    the one prefix that, for every model tensor, names a stored tensor."""
    probe = names[0]
    for key in stored:
        if key.endswith(probe):
            prefix = key[: -len(probe)]
            if all(prefix + n in stored for n in names):
                return prefix
    raise ValueError(
        f"the checkpoint holds no tensors of this model (looked for {probe!r} under any prefix): its "
        f"{MODEL_DIR}/config.json does not describe the trained model"
    )


def _groups(names: list[str], sizes: dict[str, int], limit: int) -> Iterator[list[str]]:
    group, total = [], 0
    for name in names:
        if group and total + sizes[name] > limit:
            yield group
            group, total = [], 0
        group.append(name)
        total += sizes[name]
    if group:
        yield group


def consolidate(checkpoint: Path, out: Path, *, dtype_choice: str = "auto", base: Optional[LoraBase] = None,
                submitted: Optional[LoraBase] = None) -> torch.dtype:
    """Write the Hugging Face folder `out` from the local checkpoint folder `checkpoint` (its DCP
    shards and its `model/` metadata), reading one output file's worth of tensors at a time. A LoRA
    checkpoint's adapters are merged into `base` (the user's) or else `submitted` (its run's base as
    submitted; workloads/model_io/lora_export.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers import AutoConfig

    from workloads.model_io import lora_export
    from workloads.model_io.safe_checkpoint import SafeFileSystemReader, read_checkpoint_metadata

    meta_dir = path_inside(checkpoint, MODEL_DIR)
    if not (checkpoint / DCP_METADATA).is_file():
        raise ValueError(f"{checkpoint} is not a complete checkpoint folder (no {DCP_METADATA})")
    if not path_inside(meta_dir, "config.json").is_file():
        raise ValueError(
            f"{checkpoint} has no {MODEL_DIR}/config.json (saved before checkpoints carried one): it cannot "
            "be exported without knowing the model's architecture"
        )
    if lora_export.is_lora_checkpoint(checkpoint):
        return lora_export.consolidate_lora(checkpoint, out, dtype_choice=dtype_choice, base=base,
                                            submitted=submitted)
    config = AutoConfig.from_pretrained(meta_dir, trust_remote_code=False)
    dtype = resolve_dtype(dtype_choice, config)
    model = _meta_model(config)
    names = list(tensor_aliases(model))
    stored = {
        key: value
        for key, value in read_checkpoint_metadata(checkpoint).state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }
    prefix = _checkpoint_prefix(names, stored)
    shapes = dict(model.state_dict(keep_vars=True).items())
    for name in names:
        if list(stored[prefix + name].size) != list(shapes[name].shape):
            raise ValueError(
                f"checkpoint tensor {prefix + name} has shape {list(stored[prefix + name].size)}, "
                f"{MODEL_DIR}/config.json gives {list(shapes[name].shape)}"
            )
    out.mkdir(parents=True, exist_ok=True)
    metadata = local_location(meta_dir)  # links refused, never followed (workloads/files.py)
    metadata.copy_to(local_location(out), names=[n for n in metadata.files() if "/" not in n and not n.endswith(
        (".safetensors", ".py")) and n != INDEX_FILE])
    config.dtype = dtype
    config.save_pretrained(out)
    sizes = {n: stored[prefix + n].size.numel() * stored[prefix + n].properties.dtype.itemsize for n in names}
    writer = SafetensorsWriter(out)
    for group in _groups(names, sizes, MAX_SHARD_BYTES):
        state = {prefix + n: torch.empty(stored[prefix + n].size, dtype=stored[prefix + n].properties.dtype)
                 for n in group}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
        for n in group:
            writer.add(n, state[prefix + n].to(dtype))
        del state
    writer.close()
    return dtype


# --- a run's checkpoints, local or in S3 ---------------------------------------------------------


BEST = "best"
"""`--checkpoint best`: the run's checkpoint of the lowest eval loss (`checkpoint.keep_best`)."""


def best_checkpoint(source, folders: list[str]) -> str:
    """The folder, among a run's complete checkpoints, whose progress.json records the lowest eval
    loss (the newest of equals); ValueError when none records one. A checkpoint whose model missed
    its evaluation gate is never the best (workloads/evaluate)."""
    from workloads.train.checkpoint import PROGRESS_FILE

    scored = []
    for index, folder in enumerate(folders):
        if gate_failed(source.join(folder)):
            continue
        try:
            loss = json.loads(source.join(folder, PROGRESS_FILE).read_bytes()).get("eval_loss")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(loss, (int, float)):
            scored.append((float(loss), -index, folder))
    if not scored:
        raise ValueError(f"no checkpoint of {source.uri} records an eval loss: train with "
                         "checkpoint.keep_best=true (and eval_every) to keep the best one")
    return min(scored)[2]


@dataclass(frozen=True, kw_only=True)
class Exported:
    checkpoint: str
    """The checkpoint exported (URI)."""
    out: str
    """The Hugging Face folder written (URI)."""
    how: str
    """"copied" (the run had exported it) or "consolidated" (from the checkpoint's shards)."""
    dtype: str
    local_folder: Optional[Path]
    """A local copy of the folder written (the folder itself when `out` is local), or None once gone."""


def export_run(run: str, *, out: Optional[str] = None, checkpoint: Optional[str] = None, dtype: str = "auto",
               from_shards: bool = False, overwrite: bool = False, keep_local: Optional[Path] = None,
               base: Optional[LoraBase] = None,
               submitted_base: Callable[[str], Optional[LoraBase]] = lambda checkpoint_uri: None) -> Exported:
    """Export a checkpoint of the run at `run` (a local folder or an s3:// prefix; a run folder, a
    folder of runs' storage, or one checkpoint folder) as a Hugging Face folder at `out` (default:
    `model/` next to the checkpoints). The newest checkpoint unless `checkpoint` names one.

    When the checkpoint already holds the run's own export and no other dtype is asked for, the
    folder is copied; otherwise it is consolidated from the shards (a LoRA run's adapters merged into
    `base`, else into the base its run was submitted with, `submitted_base(checkpoint URI)`).
    `keep_local`: for a remote `out`, also keep the written folder there (to load it afterwards)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(EXPORT_DTYPES)}")
    source = locate(run)
    files = source.files()
    if not files:
        raise ValueError(f"{run}: nothing is stored there (a run folder, local or s3://, holds checkpoint folders)")
    folders = checkpoint_folders(files)
    if not folders:
        raise ValueError(f"{run} holds no complete checkpoint (no folder with a {DCP_METADATA} file)")
    if checkpoint == BEST:
        chosen = best_checkpoint(source, folders)
    elif checkpoint is not None:
        matches = [f for f in folders if f == checkpoint or f.rpartition("/")[2] == checkpoint]
        if not matches:
            names = ", ".join(f.rpartition("/")[2] for f in folders[-5:])
            raise ValueError(f"{run} has no checkpoint {checkpoint!r} (newest: {names})")
        chosen = matches[-1]
    else:
        chosen = folders[-1]
    container = chosen.rpartition("/")[0]
    if chosen:
        default_out = source.join(container, MODEL_DIR)
    else:  # RUN is a checkpoint folder: next to it
        default_out = locate(run.rstrip("/").rpartition("/")[0] or ".").join(MODEL_DIR)
    dest = locate(out) if out else default_out
    if dest.files():
        if not overwrite:
            raise ValueError(f"{dest.uri} already holds files: pass --overwrite to replace them, or choose --out")
        dest.clear()
    ckpt = source.join(chosen)
    ckpt_files = {n[len(chosen) + 1 :] if chosen else n: s for n, s in files.items()
                  if not chosen or n.startswith(chosen + "/")}
    exported = [n for n in ckpt_files if n.startswith(f"{MODEL_DIR}/") and n.endswith(".safetensors")]
    log(f"checkpoint {ckpt.uri}")
    started = time.monotonic()
    if exported and not from_shards and dtype == "auto":
        model_files = ckpt.join(MODEL_DIR)
        model_files.copy_to(dest, names=[n for n in model_files.files() if not n.endswith(".py")])
        how = "copied"
        written = json.loads(ckpt.join(MODEL_DIR, "config.json").read_bytes()).get("dtype", "")
    else:
        with tempfile.TemporaryDirectory(prefix="export-") as tmp:
            if ckpt.remote:
                local = Path(tmp) / "checkpoint"
                wanted = [n for n in ckpt_files if not (n.startswith(f"{MODEL_DIR}/") and n.endswith(".safetensors"))]
                log(f"downloading {len(wanted)} files ({sum(ckpt_files[n] for n in wanted) / 2**30:.2f} GiB)")
                ckpt.download(local, names=wanted)
            else:
                local = Path(ckpt.path)
            target = Path(tmp) / MODEL_DIR if dest.remote else Path(dest.path)
            written = str(consolidate(local, target, dtype_choice=dtype, base=base,
                                      submitted=submitted_base(ckpt.uri))).removeprefix("torch.")
            if dest.remote:
                dest.upload_from(target)
                if keep_local is not None:
                    shutil.copytree(target, keep_local, dirs_exist_ok=True)
        how = "consolidated"
    if not dest.remote:
        local_folder: Optional[Path] = Path(dest.path)
    elif keep_local is not None:
        if how == "copied":
            dest.download(keep_local)
        local_folder = keep_local
    else:
        local_folder = None
    log(f"{how} into {dest.uri} in {time.monotonic() - started:.1f} s")
    return Exported(checkpoint=ckpt.uri, out=dest.uri, how=how, dtype=written, local_folder=local_folder)


# --- using an exported folder -------------------------------------------------------------------


class ChatModel:
    """An exported folder loaded once with from_pretrained, answering conversations greedily: through
    the tokenizer's chat template when it has one (as training rendered the chats), else on the
    messages' text joined by newlines. Generation stops at the folder's generation config's end tokens
    (a chat fine-tune's end-of-turn token among them). The folder's own Python code (config.json's
    `auto_map`) runs only with `trust_remote_code`: left unset, transformers would ask on standard
    input, which may be a conversation."""

    def __init__(self, folder: Path, *, trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              trust_remote_code=trust_remote_code).to(self.device)
        except ValueError as exc:
            if trust_remote_code or "trust_remote_code" not in str(exc):
                raise
            raise ValueError(f"{folder} asks to run its own code (auto_map in its config.json or "
                             "tokenizer_config.json), which was not run: pass --trust-remote-code if you trust "
                             "that folder's *.py files") from None
        self.model.eval()

    def reply(self, messages: list[dict], *, max_new_tokens: int = 24) -> str:
        tokenizer = self.tokenizer
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
        ids = ids.to(self.device)
        with torch.no_grad():
            output = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                         do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()


def greedy_generate(folder: Path, prompt: Union[str, list[dict]], *, max_new_tokens: int = 24,
                    trust_remote_code: bool = False) -> str:
    """Load the folder and answer `prompt` greedily (`ChatModel`): a string as one user turn, a list
    of {"role", "content"} messages as that conversation (its system prompt and earlier turns)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return ChatModel(folder, trust_remote_code=trust_remote_code).reply(messages, max_new_tokens=max_new_tokens)
