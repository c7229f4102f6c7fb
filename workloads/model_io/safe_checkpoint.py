"""Reading a torch.distributed.checkpoint folder without running anything it holds.

A DCP folder's `.metadata` is a pickle (FileSystemReader.read_metadata calls pickle.load on it), and
the default load planner calls `torch.load(weights_only=False)` on every BYTE_IO item it loads. Any
job can write under the checkpoint bucket's prefix, so `python -m workloads export`, run on a machine
that holds admin credentials, must not unpickle what a job wrote. Here:

- the metadata is unpickled by a restricted unpickler (the `pickle` module's own way of restricting
  globals) that builds only DCP's metadata classes, `torch.Size`, torch dtypes and layouts, and
  paths; any other global, a callable that would run on load, is refused before it is looked up;
- the files the metadata points into must lie inside the checkpoint folder, reached through no
  symbolic link (workloads/files.py's `path_inside`);
- BYTE_IO items (pickled Python objects: the optimizer's hyperparameters, the loop's counters) are
  never read: an export needs tensors only, which DCP reads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from workloads.files import path_inside

METADATA_FILE = ".metadata"

ALLOWED_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    # copyreg's reduction of a torch.layout: a lookup among torch's layouts by name.
    "torch.serialization": {"_get_layout"},
    # StorageMeta.checkpoint_id, as the saving process named the folder.
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
}
"""The globals a DCP `.metadata` refers to (torch 2.13's DCP, checked on the checkpoints this project
saves), besides torch's dtypes, which pickle by name (`torch.float32`)."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint that asks to run code, or to read outside its folder, on load."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, *, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_CLASSES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.source}: refused: its {METADATA_FILE} would load {module}.{name}, which is no part of a "
            f"checkpoint's metadata (a pickle that runs code on load); nothing of it was run")


def read_checkpoint_metadata(folder: Path) -> Metadata:
    """The DCP metadata of the checkpoint `folder`, read without running anything it holds.
    UnsafeCheckpoint when it would, or when its data lies outside the folder."""
    path = Path(folder) / METADATA_FILE
    with path.open("rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream, source=path).load()
        except UnsafeCheckpoint:
            raise
        except Exception as exc:  # a truncated or foreign file
            raise ValueError(f"{path}: not a checkpoint's metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path}: refused: it holds a {type(metadata).__name__}, not a checkpoint's metadata")
    for info in (metadata.storage_data or {}).values():
        try:
            path_inside(Path(folder), str(info.relative_path))
        except ValueError as exc:
            raise UnsafeCheckpoint(f"{path}: refused: it points outside the checkpoint ({exc})") from None
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata read by `read_checkpoint_metadata`, and no BYTE_IO
    item read at all: `dcp.load(state, storage_reader=SafeFileSystemReader(folder))` loads tensors
    only."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.folder = Path(folder)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_checkpoint_metadata(self.folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        pickled = [item.storage_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled:
            raise UnsafeCheckpoint(f"{self.folder}: refused to read {pickled[0]!r}, a pickled object, not a tensor")
        return super().read_data(plan, planner)
