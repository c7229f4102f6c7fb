"""A run's hub model and hub dataset pinned to commits once, when the run is submitted.

An empty revision means the repository's default branch, and a branch moves: each node reads it into
its own cache, so a replacement node after a Spot loss, or a resume days later, could read a newer
commit and pack other rows at the same data position, skipping or repeating examples without an
error. So `submit` and `run --local` ask the hub once which commit the given revision names now and
send that commit in the job's config: every node and every restart of the job reads it, the tracker
logs it with the run's parameters, and each checkpoint records it, so that a resubmission of the
run reads it again (workloads/train/resumed.py). A revision that is a commit already is kept as is,
without asking the hub.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping, Optional

from workloads.client.inputs_check import hub_endpoint, hub_repositories

COMMIT = re.compile(r"^[0-9a-f]{40}$")
"""A full git commit SHA, as the hub names revisions."""

CommitFn = Callable[..., str]
"""(repo_id, *, repo_type, revision) -> the commit SHA the revision names now."""


def ask_the_hub(repo_id: str, *, repo_type: str, revision: str) -> str:
    """The commit of `revision` on the hub this machine reaches (HF_ENDPOINT, HF_TOKEN)."""
    from workloads.model_io.sources import hub_commit

    return hub_commit(repo_id, repo_type=repo_type, revision=revision, endpoint=hub_endpoint())


def pin_hub_revisions(train: dict, *, local: Mapping[str, Path],
                      commit: Optional[CommitFn] = None) -> tuple[dict, list[str]]:
    """`train` (TrainConfig.to_dict()) with the revision of the hub model and the hub dataset it
    names resolved to commits, and one line for each (`local`: the fields that name files of this
    machine, which are not hub ids). ValueError, saying how to pin by hand, when the hub cannot answer."""
    commit = commit or ask_the_hub
    out = {**train}
    lines = []
    for section, repo in hub_repositories(train, local=local):
        given = str(train[section].get("revision") or "")
        if COMMIT.match(given):
            continue
        repo_type = "model" if section == "model" else "dataset"
        try:
            sha = commit(repo, repo_type=repo_type, revision=given)
        except ValueError as exc:
            raise ValueError(f"{exc}; or pin {section}.revision to a commit yourself (--set {section}.revision=SHA)"
                             ) from None
        out[section] = {**train[section], "revision": sha}
        lines.append(f"hub {repo_type} {repo} pinned at commit {sha} ({given or 'its default branch'} now): every "
                     "node and restart of the run reads it")
    return out, lines
