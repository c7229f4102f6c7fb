"""The user commands' argument parser: a mistake on the command line raises UsageError (exit 2 with
one line, as every other bad input), instead of argparse's own exit."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)
