"""A clock for code that takes `clock` and `sleep` callables: time moves only when it sleeps."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
