"""What the Kubernetes backend's unit tests share: a backend with nothing cached across tests
and no user configuration (its own KTLITE_HOME, no ``ktlite config`` environment settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ktlite import config
from ktlite.backends.kubernetes import KubernetesBackend


def isolate_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No announcement or client cached across tests; no user config or env settings."""
    monkeypatch.setattr(KubernetesBackend, "_announced", set())
    monkeypatch.setattr(KubernetesBackend, "_clients", {})
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path / "ktlite-home"))
    for env, _, _ in config.KEYS.values():
        monkeypatch.delenv(env, raising=False)
