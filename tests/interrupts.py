"""Ctrl-C in tests, whatever SIGINT disposition the suite inherited.

A suite started in the background by a shell without job control (`make test &`, nohup, a script)
inherits SIGINT ignored, as POSIX has it for background commands, and Python then installs no
KeyboardInterrupt handler, neither in the suite nor in a child it starts: a test's SIGINT would be
lost, and the test would fail for a reason that is not the product's."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator


def sigint_at_default() -> None:
    """A subprocess's preexec_fn: the child starts as from a terminal, and Python installs its
    KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process for the block's span (the main thread only)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
