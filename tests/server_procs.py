"""Stopping the server processes that tests start themselves (pod servers, store servers)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 15.0) -> None:
    """SIGTERM ``proc``; SIGKILL it if it has not exited within ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def stop_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads (a stand-in cluster and its pod servers);
    SIGKILL the group if ``proc`` has not exited within ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
