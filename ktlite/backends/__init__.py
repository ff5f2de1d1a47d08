"""Backends: where pods run. ``local`` is embedded; ``kubernetes`` loads lazily."""

from ktlite.backends.base import Applied, Backend, Plan, PodEndpoint
from ktlite.backends.registry import get_backend

__all__ = ["Applied", "Backend", "Plan", "PodEndpoint", "get_backend"]
