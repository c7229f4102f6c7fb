"""Which base a LoRA export merges its adapter into.

A LoRA checkpoint's `model/adapter/adapter_config.json` names the base the job trained on, but the job
wrote that file, and export fetches the base with the credentials of the user who runs it: a job
could name another model (a private one, a hub revision of its choosing) and have it read. So the
base comes from the run as the client submitted it (workloads/client/run_record.py), or from the user
(`--base`); the adapter's own claim is only checked against the submission, and a claim that differs
is refused: that checkpoint is not what the submitted run trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class LoraBase:
    name_or_path: str
    """As the job was told it (its config's model.name_or_path), which its adapter records."""
    revision: str = ""
    """The hub revision (a commit, as submission pins it); empty: none."""
    source: str = ""
    """Where to read it on this machine when not `name_or_path` (a folder uploaded with the job)."""
    told_by: str
    """Where it was said: the submission's record, or --base."""

    def __str__(self) -> str:
        return repr(self.name_or_path) + (f" at revision {self.revision}" if self.revision else "")


def base_to_merge(adapter_config: dict, *, submitted: Optional[LoraBase], given: Optional[LoraBase]
                  ) -> Optional[LoraBase]:
    """The base to merge into: `given` (the user's), else `submitted` (the run's, as submitted); None
    when neither is known. ValueError when the adapter names another base than the run was
    submitted with."""
    claimed = LoraBase(name_or_path=str(adapter_config.get("base_model_name_or_path") or ""),
                       revision=str(adapter_config.get("revision") or ""), told_by="adapter_config.json")
    if submitted is not None and (claimed.name_or_path, claimed.revision) != (submitted.name_or_path,
                                                                               submitted.revision):
        raise ValueError(
            f"the checkpoint's adapter_config.json names its base {claimed} but the run was submitted with "
            f"{submitted} ({submitted.told_by}): this adapter is not what that run trained; nothing was exported")
    return given or submitted
