"""A pass of work every few seconds on a thread of its own, which never dies silently.

A sampler or a watcher is a loop on a daemon thread: an exception that escapes one pass ends the
thread, and nothing says so (the soak's memory sampler stopped at its first fault that way and the
run's memory check judged no process). Here an exception in a pass is kept, with its traceback, and
the next pass runs; a thread that ends before it was asked to (an exception that is not an
`Exception`) is kept too, so that whoever reads the results can say that they stop there.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class PassError:
    at_s: float
    """When the pass failed, on the owner's clock."""
    error: str
    """The exception's type and message."""
    traceback: str


def pass_error(exc: BaseException, *, at_s: float) -> PassError:
    return PassError(at_s=at_s, error=f"{type(exc).__name__}: {exc}",
                     traceback="".join(traceback.format_exception(exc)))


class Periodic:
    """`one_pass()` every `every_s` seconds on a daemon thread named `name`, from `start()` until
    `stop()` (or the `with` block's end). `clock` gives the times kept (the owner's, e.g. seconds
    since its start). `errors` keeps the first `keep_errors` failed passes, `error_count` counts them
    all; `stopped` is set when the thread ended without being asked to, with the reason."""

    def __init__(self, one_pass: Callable[[], None], *, every_s: float, name: str, clock: Callable[[], float],
                 on_error: Callable[[PassError], None] = lambda error: None, keep_errors: int = 20) -> None:
        self.one_pass, self.every_s, self.clock, self.on_error = one_pass, every_s, clock, on_error
        self.keep_errors = keep_errors
        self.passes = 0
        """Passes run, failed ones included."""
        self.errors: list[PassError] = []
        self.error_count = 0
        self.stopped: Optional[PassError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Periodic":
        self._thread.start()
        return self

    def stop(self, *, timeout_s: float = 60.0) -> None:
        """Ask the thread to end after its current pass, and wait for it at most `timeout_s`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def __enter__(self) -> "Periodic":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def record(self) -> dict:
        """What the thread did, for a record: passes, failed passes (the first few, with their
        tracebacks) and whether and why it stopped on its own."""
        return {"passes": self.passes, "error_count": self.error_count,
                "errors": [asdict(error) for error in self.errors],
                "stopped": None if self.stopped is None else asdict(self.stopped)}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.one_pass()
                except Exception as exc:  # one pass lost, not the thread: the next pass runs
                    error = pass_error(exc, at_s=self.clock())
                    self.error_count += 1
                    if len(self.errors) < self.keep_errors:
                        self.errors.append(error)
                    self.on_error(error)
                self.passes += 1
                self._stop.wait(self.every_s)
        except BaseException as exc:  # SystemExit, or an on_error that raised: the thread ends here
            self.stopped = pass_error(exc, at_s=self.clock())
            raise
