"""Stopping the server processes that tests start themselves (pod servers, store servers)."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 15.0) -> None:
    """SIGTERM ``proc``; SIGKILL it if it has not exited within ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)
