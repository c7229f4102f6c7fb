"""Files and folders the training config names (data.path, data.tokenizer, model.name_or_path),
checked on this machine before anything starts or is submitted.

Ray Train runs each worker in a folder of its own, so a relative path reaches no file there. A
local run (`run --local`, the cluster is this machine) gets every such path made absolute. A
submitted job gets the local files uploaded in its working_dir under `job_files/` and the config
pointing there (`workloads/train/paths.py` finds them on the nodes). A path that names nothing here
is refused at once, unless it is absolute on a remote cluster (then it names a file of the nodes)
or, for the model and tokenizer, a Hugging Face id.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

from workloads.train.config import NAMED_ARCHITECTURES
from workloads.train.paths import looks_like_path

PATH_FIELDS = ("data.path", "data.tokenizer", "model.name_or_path", "dpo.reference_model", "lora.stacked_adapter")
UPLOAD_DIR = "job_files"
MAX_UPLOAD_BYTES = 256 * 2**20
"""Files beyond this stay off the job's working_dir (Ray refuses a working_dir over 512 MiB)."""


@dataclass(frozen=True, kw_only=True)
class ConfigPath:
    field: str
    """Dotted config field, e.g. data.path."""
    value: str
    """The value as given."""
    local: Path
    """What it names on this machine (relative values from the current folder)."""

    @property
    def is_absolute(self) -> bool:
        return Path(self.value).expanduser().is_absolute()


def config_paths(train: dict, *, cwd: Path) -> list[ConfigPath]:
    """The fields of `train` (TrainConfig.to_dict()) that name a file or folder: data.path of
    JSONL data always; the tokenizer and the model when written as a path or found here (as
    transformers itself would find them), not a named architecture or a hub id."""
    found = []
    for field in PATH_FIELDS:
        section, key = field.split(".")
        value = str((train.get(section) or {}).get(key) or "")
        if not value or (field == "model.name_or_path" and value in NAMED_ARCHITECTURES):
            continue
        if field == "data.path" and train["data"].get("kind") != "jsonl":
            continue
        local = (cwd / Path(value).expanduser()).resolve()
        if field == "data.path" or looks_like_path(value) or local.exists():
            found.append(ConfigPath(field=field, value=value, local=local))
    return found


def _set(train: dict, field: str, value: str) -> None:
    section, key = field.split(".")
    train[section][key] = value


def _missing(path: ConfigPath, advice: str) -> ValueError:
    return ValueError(f"{path.field} {path.value!r} is not a file or folder here ({path.local}): {advice}")


def resolved_for_local_run(train: dict, *, cwd: Path, made: frozenset[str] = frozenset()) -> dict:
    """`train` with every path it names made absolute; ValueError for one that names nothing (but
    for the fields in `made`, whose files are written before the job starts)."""
    resolved = copy.deepcopy(train)
    for path in config_paths(train, cwd=cwd):
        if not path.local.exists() and path.field not in made:
            raise _missing(path, "relative paths are read from the current folder")
        _set(resolved, path.field, str(path.local))
    return resolved


def local_inputs(train: dict, *, cwd: Path, made: frozenset[str] = frozenset(),
                 upload_absolute: bool = True) -> dict[str, Path]:
    """Field -> the file or folder on this machine that the run reads for it: every existing path of
    a local run (the default), what `files_for_job` uploads for a submitted one. `made`: fields
    whose files do not exist yet (the demo writes them just before the job)."""
    return {path.field: path.local for path in config_paths(train, cwd=cwd)
            if path.field not in made and path.local.exists() and (upload_absolute or not path.is_absolute)}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def files_for_job(train: dict, *, cwd: Path, upload_absolute: bool
                  ) -> tuple[dict, tuple[tuple[str, Path], ...]]:
    """`train` pointing at the local files it names in the job's folder, and the (place in the
    job's folder, local path) pairs to upload. Absolute paths are uploaded only with
    `upload_absolute` (a cluster that cannot see this machine's files, `--stack`); otherwise, and
    when they do not exist here, they are left as paths on the cluster's nodes. ValueError for a
    relative path that names nothing here, or files too large to upload."""
    rewritten = copy.deepcopy(train)
    places: dict[Path, str] = {}
    for path in config_paths(train, cwd=cwd):
        if path.is_absolute and not (upload_absolute and path.local.exists()):
            continue
        if not path.local.exists():
            raise _missing(path, "local files are uploaded with the job, so give one that exists, "
                                 "or an absolute path on the cluster's nodes")
        place = places.setdefault(path.local, f"{UPLOAD_DIR}/{path.field}/{path.local.name}")
        _set(rewritten, path.field, place)
    total = sum(_size(local) for local in places)
    if total > MAX_UPLOAD_BYTES:
        names = ", ".join(str(local) for local in places)
        raise ValueError(f"the local files the config names ({names}) hold {total / 2**20:,.0f} MiB, more "
                         f"than the {MAX_UPLOAD_BYTES // 2**20} MiB uploaded with a job: copy them to S3 "
                         "(aws s3 cp FILE s3://BUCKET/inputs/ --recursive for a folder) and set the field to "
                         "that s3:// URI, or give a path the cluster's nodes can read")
    return rewritten, tuple((place, local) for local, place in places.items())


def stage_files(root: Path, files: tuple[tuple[str, Path], ...]) -> None:
    """Copy each local file or folder of `files_for_job` to its place under `root`."""
    for place, local in files:
        target = root / place
        target.parent.mkdir(parents=True, exist_ok=True)
        if local.is_dir():
            shutil.copytree(local, target)
        else:
            shutil.copy2(local, target)
