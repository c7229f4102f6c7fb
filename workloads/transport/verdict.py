"""What a check of NCCL's transports concludes, shared by the offline check (verify.py) and the
in-band gate (gate.py): the verdict's status with its exit code, and the gate's line for a job whose
ranks talked over another backend than NCCL, which the gate writes and `verify-transport` reads
back from the job's log."""

from __future__ import annotations

import enum
import re


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_code(self) -> int:
        return {Status.PASS: 0, Status.FAIL: 1, Status.INCONCLUSIVE: 3}[self]


NOT_NCCL_RE = re.compile(r"transport gate does not apply to the (\w+) backend")
"""The gate's line in a job's log when the ranks talked over another backend than NCCL (gloo)."""


def not_nccl_message(backend: str) -> str:
    """The gate's line for a run on `backend` (NOT_NCCL_RE reads it back)."""
    return f"transport gate does not apply to the {backend} backend (it checks NCCL transports)"
