"""How much longer than on a quiet machine a test may take here and now.

pytest-timeout's limits (guards against hangs, not timing assertions: ``tests/conftest.py``)
and the stand-in cluster's part limits (``kube_e2e.py``) are multiplied by it, so a busy
machine makes the suite slower, not red.
"""

from __future__ import annotations

import os

MAX_SCALE = 4.0


def time_scale() -> float:
    """``KTLITE_TEST_TIME_SCALE`` when set; else the 1-minute load average per core, between 1
    and :data:`MAX_SCALE` (read once, when the tests are collected)."""
    setting = os.environ.get("KTLITE_TEST_TIME_SCALE")
    if setting:
        scale = float(setting)
        if not scale >= 1:
            raise ValueError(f"KTLITE_TEST_TIME_SCALE={setting!r} must be a number >= 1")
        return scale
    return min(MAX_SCALE, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
