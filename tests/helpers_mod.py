"""A plain local module (not installed anywhere) used by the module-by-value tests.

The pods cannot import it from their own ``sys.path``: it only works there because ktlite
ships the caller's local modules along with the function.
"""

from __future__ import annotations

import os

GREETING = "hello from helpers_mod"


def double(x: int) -> int:
    return 2 * x


def describe() -> dict[str, object]:
    """Where this module runs: the process id and the module's own name."""
    return {"greeting": GREETING, "pid": os.getpid(), "module": __name__}


class Scaler:
    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, x: int) -> int:
        return self.factor * x
