"""Where a pretrained model or a data file comes from, fetched into the node cache when remote.

A model is named by one string: a local folder, an `s3://bucket/prefix` holding a Hugging Face
model folder, or a hub id (`Qwen/Qwen2.5-1.5B`). A data file is a local path or an s3:// URI; a
hub dataset is an id and a split. Remote sources are fetched once per node (workloads/model_io/
cache.py). Every mistake (an unknown id, an unreadable prefix, a folder that is not a model) is a
ValueError naming the source and the fix, raised before any training step.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import re
import time
from pathlib import Path
from typing import Iterator, Literal, Optional

from workloads.files import path_inside
from workloads.model_io.cache import cache_root, entry_name, fill_once
from workloads.model_io.storage import Location, is_s3, locate

LOG_PREFIX = "[model-io] "

MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
"""Files of a model folder worth fetching: config, weights (safetensors only), tokenizer."""

DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
"""Data files a hub dataset split may consist of."""

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

JOB_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the `workloads` package: in a Ray job, its working_dir as unpacked on this
node, where files sent with the job are (workloads/client/datapaths.py)."""

SourceKind = Literal["local", "s3", "hub"]


def log(message: str) -> None:
    print(LOG_PREFIX + message, flush=True)


def source_kind(spec: str, *, what: str) -> SourceKind:
    """How `spec` is reached: an s3:// URI, an existing or explicitly local path, or a hub id."""
    if is_s3(spec):
        return "s3"
    if spec.startswith(("/", "./", "../", "~")) or Path(spec).expanduser().exists():
        return "local"
    if HUB_ID.match(spec):
        return "hub"
    raise ValueError(
        f"{what} {spec!r} is neither an existing local path, an s3:// URI nor a Hugging Face hub id "
        "(ORG/NAME)"
    )


def check_model_folder(folder: Path, *, spec: str, what: str) -> Path:
    if not folder.is_dir():
        raise ValueError(f"{what} {spec!r} is not a folder: point it at a Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{what} {spec!r} has no config.json: it is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"{what} {spec!r} has no .safetensors weights (only safetensors are loaded): "
            "convert it with save_pretrained(..., safe_serialization=True)"
        )
    return folder


def _listing_key(files: dict[str, int]) -> str:
    return hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:12]


def _fetch_s3_folder(location: Location, *, names: list[str], files: dict[str, int], cache_dir: str) -> Path:
    def fill(target: Path) -> None:
        size = sum(files[n] for n in names)
        log(f"downloading {len(names)} files ({size / 2**30:.2f} GiB) from {location.uri} into the node cache")
        started = time.monotonic()
        location.download(target, names=names)
        log(f"downloaded {location.uri} in {time.monotonic() - started:.1f} s")

    # The listing (names and sizes) is part of the entry's name: a changed folder is fetched again.
    return fill_once(cache_root(cache_dir), entry_name("s3", location.uri, _listing_key(files)), fill).path


@contextlib.contextmanager
def _hub_errors(repo_id: str, *, repo_type: Literal["model", "dataset"], revision: str) -> Iterator[None]:
    """The hub's errors inside the block as ValueErrors that say what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HTTPError,  # the HTTP client's own errors (a refused connection), which it does not wrap
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"hub {repo_type} {repo_id!r}"
    instead = "or use a local folder or an s3:// copy" if repo_type == "model" else "or use a JSONL file"
    try:
        yield
    except GatedRepoError:
        raise ValueError(f"{what} is gated: accept its terms on the hub and give the job HF_TOKEN, {instead}") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} does not exist on the Hugging Face hub (or is private: give the job HF_TOKEN): "
            f"check the id, {instead}"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{what} has no revision {revision!r}: use a branch, tag or commit of it") from None
    except (LocalEntryNotFoundError, OSError, HTTPError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"cannot reach the Hugging Face hub for {what} ({reason}): check the network, HF_ENDPOINT and "
            f"HF_HUB_OFFLINE, {instead}"
        ) from None


def hub_download(repo_id: str, *, repo_type: Literal["model", "dataset"], revision: str, target: Path,
                 allow_patterns: list[str], endpoint: Optional[str] = None) -> None:
    """snapshot_download into `target`, with the hub's errors turned into ValueErrors that say what to do."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, repo_type=repo_type, revision=revision):
        snapshot_download(repo_id, repo_type=repo_type, revision=revision or None, local_dir=target,
                          allow_patterns=allow_patterns, endpoint=endpoint)


def hub_commit(repo_id: str, *, repo_type: Literal["model", "dataset"], revision: str,
               endpoint: Optional[str] = None) -> str:
    """The commit SHA `revision` (a branch, tag or commit; empty: the default branch) of a hub
    repository names now, asked of the hub; ValueError that says what to do when it cannot answer."""
    from huggingface_hub import HfApi

    with _hub_errors(repo_id, repo_type=repo_type, revision=revision):
        info = HfApi(endpoint=endpoint).repo_info(repo_id, repo_type=repo_type, revision=revision or None)
    if not info.sha:
        raise ValueError(f"the Hugging Face hub named no commit for hub {repo_type} {repo_id!r}"
                         f"{' at ' + revision if revision else ''}: set its revision to a commit yourself")
    return info.sha


def fetch_model(spec: str, *, revision: str = "", cache_dir: str = "", what: str = "model.name_or_path",
                endpoint: Optional[str] = None) -> Path:
    """The local folder of the Hugging Face model `spec` names, fetched into the node cache if remote."""
    kind = source_kind(spec, what=what)
    if kind == "local":
        return check_model_folder(Path(spec).expanduser().resolve(), spec=spec, what=what)
    if kind == "s3":
        location = locate(spec)
        files = location.files()
        if not files:
            raise ValueError(f"{what} {spec!r}: nothing is stored under that prefix (or it cannot be listed)")
        names = [n for n in files if "/" not in n and any(fnmatch.fnmatch(n, p) for p in MODEL_FILE_PATTERNS)]
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            raise ValueError(
                f"{what} {spec!r} holds no config.json and .safetensors weights: upload a Hugging Face model "
                "folder there (save_pretrained, then aws s3 sync)"
            )
        folder = _fetch_s3_folder(location, names=sorted(names), files=files, cache_dir=cache_dir)
        return check_model_folder(folder, spec=spec, what=what)

    def fill(target: Path) -> None:
        log(f"downloading hub model {spec}{'@' + revision if revision else ''} into the node cache")
        started = time.monotonic()
        hub_download(spec, repo_type="model", revision=revision, target=target,
                     allow_patterns=list(MODEL_FILE_PATTERNS), endpoint=endpoint)
        check_model_folder(target, spec=spec, what=what)  # before it becomes a cache entry
        log(f"downloaded {spec} in {time.monotonic() - started:.1f} s")

    entry = fill_once(cache_root(cache_dir), entry_name("hub", spec, revision or "default"), fill)
    return check_model_folder(entry.path, spec=spec, what=what)


def fetch_data_file(spec: str, *, cache_dir: str = "", what: str = "data.path") -> Path:
    """The local path of the data file `spec` names: an s3:// URI of one file, or a local path (a
    relative one is looked up in the current folder, then among the files sent with the job)."""
    if not is_s3(spec):
        path = Path(spec).expanduser()
        if not path.is_absolute() and not path.exists() and (JOB_ROOT / path).is_file():
            path = JOB_ROOT / path  # sent with the job
        if not path.is_file():
            raise ValueError(f"{what} {spec!r} is not a file: point it at a JSONL file")
        return path
    location = locate(spec)
    if not location.is_file():
        raise ValueError(f"{what} {spec!r}: no such object (or it cannot be read with these credentials)")
    parent_uri, _, name = spec.rstrip("/").rpartition("/")
    folder = _fetch_s3_folder(locate(parent_uri), names=[name], files={name: location.size()}, cache_dir=cache_dir)
    return path_inside(folder, name)


def split_files(names: list[str], *, split: str) -> list[str]:
    """The data files of `split` in a dataset repository, by the hub's naming conventions:
    `data/<split>-00000-of-00003.parquet`, `<split>/0000.parquet`, `<split>.jsonl`."""
    def belongs(name: str) -> bool:
        parts = name.split("/")
        stem = parts[-1]
        return (split in parts[:-1] or stem.startswith(f"{split}-") or stem.startswith(f"{split}.")
                or stem.startswith(f"{split}_0"))

    return sorted(n for n in names if n.endswith(DATA_FILE_SUFFIXES) and belongs(n))


def fetch_hub_dataset(repo_id: str, *, split: str, revision: str = "", cache_dir: str = "",
                      endpoint: Optional[str] = None) -> list[Path]:
    """The local data files of one split of a hub dataset, fetched once per node."""
    if not HUB_ID.match(repo_id):
        raise ValueError(f"data.path {repo_id!r} is not a hub dataset id (ORG/NAME)")
    patterns = [f"*{split}/*", f"*{split}-*", f"*{split}.*", f"*{split}_0*"]

    def chosen(folder: Path) -> list[Path]:
        names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        return [path_inside(folder, n) for n in split_files([n for n in names if not n.startswith(".cache/")],
                                                             split=split)]

    def fill(target: Path) -> None:
        log(f"downloading split {split!r} of hub dataset {repo_id} into the node cache")
        started = time.monotonic()
        hub_download(repo_id, repo_type="dataset", revision=revision, target=target, allow_patterns=patterns,
                     endpoint=endpoint)
        if not chosen(target):
            raise ValueError(
                f"hub dataset {repo_id!r} has no JSONL or Parquet files for split {split!r}: set data.split to "
                "one of its splits"
            )
        log(f"downloaded {repo_id} in {time.monotonic() - started:.1f} s")

    entry = fill_once(cache_root(cache_dir), entry_name("hub-dataset", repo_id, split, revision or "default"), fill)
    return chosen(entry.path)
