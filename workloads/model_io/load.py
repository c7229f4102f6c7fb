"""Fill an FSDP2-sharded model straight from a Hugging Face folder's safetensors files.

The model is built with its parameters on the meta device (`parameters_on_meta`: no memory, and
buffers such as rotary frequencies still computed for real), sharded with FSDP2, then
`materialize` allocates each rank's own shards and `fill_from_safetensors` reads into them only the
slice of every tensor that the rank holds (safetensors slices come from a memory-mapped file). No
rank ever holds a full copy of the model, on the GPU or in host memory: the largest transient host
buffer is one rank's slice of one tensor.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from workloads.files import key_parts

INDEX_FILE = "model.safetensors.index.json"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real.

    Every parameter is registered through `nn.Module.register_parameter`, so moving it there covers
    any architecture. A parameter already on meta is kept as it is, so tying (`lm_head.weight =
    embed_tokens.weight`) still shares one object.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(module: nn.Module, *, device: torch.device) -> None:
    """Allocate the meta parameters (each rank: its shards only) on `device`, uninitialized; buffers
    keep the values they were built with."""
    saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    aliases = tensor_aliases(module)
    module.to_empty(device=device)
    # to_empty gives each module its own new parameter, which unties a tied weight that is a plain
    # tensor (one FSDP2 leaves out: a frozen base on one rank); FSDP2 keeps its own parameters tied.
    for owner, names in aliases.items():
        if owner in saved:
            continue
        param = module.get_parameter(owner)
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            holder = module.get_submodule(parent)
            if holder._parameters[attr] is not param:
                holder._parameters[attr] = param
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(saved[name])


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index when there is one)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        # Lexically inside only: a user's own folder may link its files elsewhere (a hub cache's
        # snapshot links into its blobs); the cache's copies of remote folders hold no links.
        return {name: folder.joinpath(*key_parts(file)) for name, file in weight_map.items()}
    mapping: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            mapping.update((name, path) for name in f.keys())
    return mapping


WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")
"""What torch.compile's wrapper and activation checkpointing's wrapper add to the names of the
parameters of the modules they wrap."""


def file_name(name: str) -> str:
    """A parameter's name as a Hugging Face file has it: without the wrappers' prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def persistent_buffer_names(module: nn.Module) -> list[str]:
    names = []
    for prefix, owner in module.named_modules():
        for name in owner._buffers:
            if owner._buffers[name] is not None and name not in owner._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def tensor_aliases(module: nn.Module) -> dict[str, list[str]]:
    """The name of each distinct parameter and persistent buffer (as `named_parameters` gives it,
    so with torch.compile's `_orig_mod.` where layers are compiled) -> every name it is known by,
    tied ones included (`lm_head.weight` for a tied embedding)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        aliases.setdefault(owner, []).append(name)
    for name in persistent_buffer_names(module):
        aliases[name] = [name]
    return aliases


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds and where it sits in the full tensor."""
    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()
        where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        local = tensor.to_local()
        assert tuple(local.shape) == tuple(chunk.sizes), (local.shape, chunk.sizes)
        return local, where
    return tensor, tuple(slice(0, s) for s in tensor.shape)


@dataclass(frozen=True, kw_only=True)
class LoadStats:
    tensors: int
    """Tensors filled."""
    bytes_read: int
    """Bytes this rank read from the files (its slices only)."""
    seconds: float
    unused: list[str] = field(default_factory=list)
    """Tensors in the files the model has no place for."""


def _copy_local(target: torch.Tensor, read) -> int:
    """Copy this rank's part of `target` from `read(slices)` (the full tensor's values at those
    slices), converted to the target's dtype; returns the bytes read."""
    local, where = _local_part(target)
    if local.numel() == 0:
        return 0
    part = read(where)
    local.copy_(part.to(dtype=local.dtype))
    return part.numel() * part.element_size()


def _targets(module: nn.Module) -> dict[str, torch.Tensor]:
    targets = dict(module.named_parameters())
    targets.update((name, module.get_buffer(name)) for name in persistent_buffer_names(module))
    return targets


def fill_from_safetensors(module: nn.Module, folder: Path, *, name_in_files=file_name) -> LoadStats:
    """Copy each parameter's (local shard of its) tensor from the folder's safetensors files, converted
    to the parameter's dtype. `name_in_files` maps a parameter's name to the files' name for it, or
    to None for a parameter the files do not hold (a fine-tuning method's adapters). ValueError when
    the files lack a tensor or hold one of another shape."""
    started = time.monotonic()
    files = weight_files(folder)
    aliases = {name: [n for n in (name_in_files(a) for a in names) if n is not None]
               for name, names in tensor_aliases(module).items()}
    aliases = {name: names for name, names in aliases.items() if names}
    targets = _targets(module)
    stored: dict[str, str] = {}
    missing = []
    for name, names in aliases.items():
        found = next((n for n in names if n in files), None)
        if found is None:
            missing.append(names[0])
        else:
            stored[name] = found
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"{folder} lacks {len(missing)} tensor(s) the model needs ({shown}): its config.json and weights "
            "do not match"
        )
    used = {n for names in aliases.values() for n in names}
    bytes_read = 0
    with ExitStack() as stack, torch.no_grad():
        handles = {path: stack.enter_context(safe_open(path, framework="pt")) for path in set(files.values())}
        for name, key in stored.items():
            target = targets[name]
            sliced = handles[files[key]].get_slice(key)
            if list(sliced.get_shape()) != list(target.shape):
                raise ValueError(
                    f"{folder}: tensor {key} has shape {list(sliced.get_shape())}, the model expects "
                    f"{list(target.shape)}: its config.json and weights do not match"
                )
            bytes_read += _copy_local(target, lambda where, s=sliced: s[where])
    return LoadStats(tensors=len(stored), bytes_read=bytes_read, seconds=time.monotonic() - started,
                     unused=sorted(set(files) - used))


def fill_from_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each named full tensor's (local shard) into the module's parameter of that file name."""
    targets = {file_name(name): tensor for name, tensor in _targets(module).items()}
    with torch.no_grad():
        for name, full in tensors.items():
            target = targets[name]
            assert tuple(full.shape) == tuple(target.shape), (name, full.shape, target.shape)
            _copy_local(target, lambda where, f=full: f[where])
