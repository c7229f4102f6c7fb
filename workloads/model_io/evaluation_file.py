"""What the evaluation after training (workloads/evaluate) leaves in a checkpoint's folder, as export
reads it: a checkpoint whose tuned model missed its gate is never a run's best. Standard library only:
the client reads it without torch."""

from __future__ import annotations

import json

EVALUATION_FILE = "evaluation.json"
"""The scores of the tuned model and its base, and whether the tuned one passed its gate."""


def gate_failed(checkpoint) -> bool:
    """The checkpoint's tuned model missed its evaluation gate (its evaluation.json says so);
    `checkpoint` is a workloads.model_io.storage Location."""
    try:
        return not json.loads(checkpoint.join(EVALUATION_FILE).read_bytes()).get("passed", True)
    except (ValueError, AttributeError):
        return False
