"""Decorators: mark functions for deployment, deploy them from the shell, call them by name.

Run from the repository root:

    ktlite deploy examples/decorated.py       # deploys `square` (1 pod) and `ranks` (2 pods)
    PYTHONPATH=examples python -c "import decorated; print(decorated.square(7), decorated.ranks())"
    ktlite teardown square ranks

The `python -c` process deploys nothing: calling an imported decorated function calls the
deployment of that name (if there is none, the error says to run `ktlite deploy`).

Or run the script itself, which deploys on the first call (the pods exit with it):

    python examples/decorated.py
"""

from __future__ import annotations

import os

import ktlite as kt


@kt.compute(cpus=1)
def square(x: int) -> int:
    return x * x


@kt.compute(cpus=1)
@kt.distribute("pytorch", workers=2)  # the two decorators stack in either order
def ranks() -> str:
    env = os.environ
    return f"rank {env['RANK']} of {env['WORLD_SIZE']} on {env['KTLITE_POD_NAME']}"


if __name__ == "__main__":
    print(square(7))  # 49
    print(ranks())  # one string per rank: ['rank 0 of 2 on ranks-0', 'rank 1 of 2 on ranks-1']
