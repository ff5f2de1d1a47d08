"""A script that declares two kt.app objects, for `ktlite run declares_apps.py`."""

import sys
from pathlib import Path

import ktlite as kt

HERE = Path(__file__).parent
first = kt.app(
    [sys.executable, "replica.py"],
    replicas=2,
    name="declared-first",
    workdir=HERE,
    env={"APP_GREETING": "first"},
)
second = kt.app(
    [sys.executable, "-c", "print('second app says hi')"],
    replicas=1,
    name="declared-second",
    workdir=HERE,
)

if __name__ == "__main__":
    print("MAIN BLOCK RAN")
