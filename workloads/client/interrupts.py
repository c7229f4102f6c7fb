"""Ctrl-C and SIGTERM for the commands that follow a job: both stop the command the same way (the
reattach hint, the local cluster stopped), and the exit code says which it was, as a shell's does for
a process a signal ended: 130 (128 + SIGINT) for Ctrl-C, 143 (128 + SIGTERM) for SIGTERM."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that no library's `except Exception` swallows it."""


INTERRUPTIONS = (KeyboardInterrupt, Terminated)
"""What `except` catches for a stop asked for by the user (Ctrl-C) or the system (SIGTERM)."""


def exit_code(interruption: BaseException) -> int:
    return EXIT_TERMINATED if isinstance(interruption, Terminated) else EXIT_INTERRUPTED


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread for the block's span, so that what the block
    holds (a port-forward, a local cluster) is released on the way out, as on Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
