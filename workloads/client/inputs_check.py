"""The inputs a run's config names, checked on this machine before a cluster is started or reached,
so that a mistake costs seconds, not a cluster start and a failed job.

- `data.path` of JSONL data, when the run reads it from here: every record up to
  `data.max_examples`, read as the job reads it (workloads/train/records.py), so a bad line is named
  with its file and line number;
- `model.name_or_path`, when a folder here: a Hugging Face model folder (config.json and safetensors
  weights), and, when the data is records and `data.tokenizer` is empty, with its tokenizer;
- `data.tokenizer`, when a folder here: a tokenizer's files;
- a model, tokenizer or hub dataset that is neither a path, an s3:// URI nor a hub id (ORG/NAME):
  refused, where the job would fail on it;
- with `hub` (a local run: its nodes are this machine): a model, tokenizer or dataset from the
  Hugging Face hub that this machine has not cached yet, when the hub does not answer, or answers
  that the repository does not exist.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Mapping

from workloads.model_io.cache import cache_root, entry_name
from workloads.model_io.sources import HUB_ID, check_model_folder
from workloads.train.config import NAMED_ARCHITECTURES

HUB_TIMEOUT_S = 5.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""One of these makes a folder something AutoTokenizer can load."""
_OFF = ("1", "true", "yes", "on")


def _records_data(train: dict) -> bool:
    return train["data"]["kind"] in ("jsonl", "hub")


def check_records(path: Path, data: Mapping, *, objective: str = "sft") -> None:
    """Every record of a JSONL (or Parquet) file the job will read, up to data.max_examples: as
    preference pairs under objective "dpo" (workloads/train/pair_records.py)."""
    if objective == "dpo":
        from workloads.train.pair_records import read_pairs

        read_pairs([path], limit=int(data.get("max_examples") or 0))
        return
    from workloads.train.records import read_records

    read_records([path], text_field=data["text_field"], messages_field=data["messages_field"],
                 limit=int(data.get("max_examples") or 0), data_format=data.get("format") or "auto")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _check_tokenizer_folder(folder: Path, *, field: str, value: str) -> None:
    if not folder.is_dir():
        raise ValueError(f"{field} {value!r} is a file, not a tokenizer folder")
    if not _has_tokenizer(folder):
        raise ValueError(f"{field} {value!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                         "point it at a folder written by tokenizer.save_pretrained")


def _not_a_source(field: str, value: str) -> ValueError:
    return ValueError(f"{field} {value!r} is neither a file or folder here, an s3:// URI nor a Hugging Face "
                      "id (ORG/NAME)")


def _is_remote_or_node_path(value: str) -> bool:
    return "://" in value or Path(value).expanduser().is_absolute()


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def check_hub(repo_id: str, *, kind: str, what: str, revision: str = "", timeout_s: float = HUB_TIMEOUT_S) -> None:
    """The hub answers for `repo_id` (kind "models" or "datasets"); ValueError when it cannot be
    reached, is switched off, or has no such repository."""
    instead = "or use a JSONL file" if kind == "datasets" else "or use a local folder or an s3:// copy"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _OFF:
        raise ValueError(f"{what} {repo_id!r} is not in this machine's cache and HF_HUB_OFFLINE is set: unset it, "
                         f"{instead}")
    url = f"{hub_endpoint()}/api/{kind}/{repo_id}" + (
        f"/revision/{urllib.parse.quote(revision, safe='')}" if revision else "")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 404):  # the hub answers 401 for a repository it does not show this caller
            raise ValueError(f"{what} {repo_id!r} does not exist on the Hugging Face hub (or is private: set "
                             f"HF_TOKEN): check the id{' and the revision' if revision else ''}, {instead}") from None
        return  # it answers (a gated repository: the download says what it needs)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ValueError(f"cannot reach the Hugging Face hub at {hub_endpoint()} for {what} {repo_id!r} ({reason}), "
                         f"and it is not in this machine's cache: check the network, HF_ENDPOINT and "
                         f"HF_HUB_OFFLINE, {instead}") from None


def _tokenizer_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in TOKENIZER_FILES)


def _model_by_id(train: dict, *, local: Mapping[str, Path]) -> bool:
    """model.name_or_path is neither a named architecture, a file or folder here, a node path nor
    an s3:// URI: a hub id, if anything."""
    name = str(train["model"]["name_or_path"])
    return "model.name_or_path" not in local and name not in NAMED_ARCHITECTURES and not _is_remote_or_node_path(name)


def hub_repositories(train: dict, *, local: Mapping[str, Path]) -> list[tuple[str, str]]:
    """The config's sections ("model", "data") that name a hub repository, with its id."""
    out = []
    name = str(train["model"]["name_or_path"])
    if _model_by_id(train, local=local) and HUB_ID.match(name):
        out.append(("model", name))
    if train["data"]["kind"] == "hub":
        out.append(("data", str(train["data"]["path"])))
    return out


def _check_reference_model(train: dict, *, local: Mapping[str, Path]) -> None:
    """A local dpo.reference_model: a model folder whose tokenizer is the policy's (when both are here)."""
    spec = str(train["dpo"]["reference_model"])
    folder = check_model_folder(local["dpo.reference_model"], spec=spec, what="dpo.reference_model")
    policy = local.get("data.tokenizer") or local.get("model.name_or_path")
    if policy is None or not _has_tokenizer(folder) or not _has_tokenizer(policy):
        return
    from workloads.train.encode import load_tokenizer, tokenizer_difference

    difference = tokenizer_difference(load_tokenizer(str(policy)), load_tokenizer(str(folder)))
    if difference:
        raise ValueError(f"dpo.reference_model {spec!r} does not read text as the policy does ({policy}): "
                         f"{difference}: give a model with the policy's tokenizer, or leave dpo.reference_model empty")


def check_inputs(train: dict, *, local: Mapping[str, Path], hub: bool, skip: frozenset[str] = frozenset()) -> None:
    """Check what `train` (TrainConfig.to_dict()) names. `local`: field -> the file or folder on this
    machine that the run reads for it; `skip`: fields whose files are made later (the demo's). A
    value not in `local` is a node path, an s3:// URI or a hub id. ValueError for the first problem."""
    data, model = train["data"], train["model"]
    if "data.path" in local and "data.path" not in skip:
        check_records(local["data.path"], data, objective=train.get("objective") or "sft")
    name = str(model["name_or_path"])
    if "model.name_or_path" in local and "model.name_or_path" not in skip:
        folder = check_model_folder(local["model.name_or_path"], spec=name, what="model.name_or_path")
        if _records_data(train) and not data.get("tokenizer") and not _has_tokenizer(folder):
            raise ValueError(f"model.name_or_path {name!r} holds no tokenizer, which the data needs: save it "
                             "there (tokenizer.save_pretrained) or set data.tokenizer")
    elif _model_by_id(train, local=local):
        if not HUB_ID.match(name):
            raise _not_a_source("model.name_or_path", name)
        cached = cache_root(train.get("cache_dir") or "") / entry_name("hub", name, model.get("revision") or "default")
        if hub and not cached.is_dir():
            check_hub(name, kind="models", what="hub model", revision=model.get("revision") or "")
    if "dpo.reference_model" in local:
        _check_reference_model(train, local=local)
    tokenizer = str(data.get("tokenizer") or "")
    if tokenizer and _records_data(train):
        if "data.tokenizer" in local:
            _check_tokenizer_folder(local["data.tokenizer"], field="data.tokenizer", value=tokenizer)
        elif not _is_remote_or_node_path(tokenizer):
            if not HUB_ID.match(tokenizer):
                raise _not_a_source("data.tokenizer", tokenizer)
            if hub and not _tokenizer_cached(tokenizer):
                check_hub(tokenizer, kind="models", what="hub tokenizer")
    if data["kind"] == "hub":
        repo = str(data["path"])
        cached = cache_root(train.get("cache_dir") or "") / entry_name(
            "hub-dataset", repo, str(data.get("split")), data.get("revision") or "default")
        if hub and not cached.is_dir():
            check_hub(repo, kind="datasets", what="hub dataset", revision=data.get("revision") or "")
