"""What the dashboard shows, read the way ``ktlite list`` and ``ktlite status`` read it: every
backend's deployments (a backend that cannot be reached is a row saying why), and one
deployment's pods, ranks and recent calls.

Nothing here answers with a deployment's token: a deployment's answers pass through
:func:`scrub`, which also blanks the token wherever a pod's text repeats it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ktlite.api.attach import attach, pods_status
from ktlite.backends.base import Backend
from ktlite.backends.registry import NAMES, get_backend
from ktlite.dashboard import timeline
from ktlite.errors import ConfigError, KtliteError, NotDeployedError
from ktlite.modes import status
from ktlite.modes.deploy import Deployment

logger = logging.getLogger(__name__)

LIST_S = 8.0  # how long one backend's list may take before the page shows it as not answering
REDACTED = "[redacted]"
_SECRET_KEYS = ("token", "secret", "password")


def scrub(value: Any, secrets: tuple[str, ...]) -> Any:
    """``value`` without any of ``secrets`` (replaced where a string holds one) and without
    fields named like a credential."""
    if isinstance(value, dict):
        return {
            k: scrub(v, secrets)
            for k, v in value.items()
            if not any(s in str(k).lower() for s in _SECRET_KEYS)
        }
    if isinstance(value, list | tuple):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            if secret and secret in value:
                value = value.replace(secret, REDACTED)
        return value
    return value


class Backends:
    """The backends the dashboard shows (by name) and their deployments, listed at most once
    at a time each: a backend whose list hangs (an unreachable cluster) shows as not answering
    while its list still runs, and the next list waits for it to end."""

    def __init__(self, names: list[str] | None = None, namespace: str | None = None) -> None:
        self.names = list(names or NAMES)
        self.namespace = namespace
        self._lock = threading.Lock()
        self._listing: dict[str, concurrent.futures.Future[list[dict[str, Any]]]] = {}
        self._attached: dict[tuple[str, str], Deployment] = {}

    def backend(self, name: str) -> Backend:
        if name not in self.names:
            raise NotDeployedError(
                f"backend {name!r} is not shown by this dashboard; it shows {', '.join(self.names)}"
            )
        return get_backend(name, self.namespace)

    def close(self) -> None:
        """Nothing to wait for: a list still running is on a daemon thread, abandoned."""

    def listing(self) -> list[dict[str, Any]]:
        """Per backend: ``deployments`` (``ktlite list``'s rows), or ``error`` saying why not
        and ``set_up``: False where the backend is not set up here (a ConfigError: no
        kubeconfig, a missing extra), True where it is but could not be listed."""
        with self._lock:
            for name in self.names:
                running = self._listing.get(name)
                if running is None or running.done():
                    self._listing[name] = _in_daemon_thread(self._list, name)
            futures = dict(self._listing)
        out = []
        deadline = time.monotonic() + LIST_S
        for name in self.names:
            future = futures[name]
            try:
                rows = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                out.append(
                    {
                        "backend": name,
                        "error": f"its list did not answer within {LIST_S:g}s "
                        "(an unreachable cluster or host?); it shows once it answers",
                        "set_up": True,
                    }
                )
                continue
            except ConfigError as e:  # no kubeconfig, no SSH extra: not set up here
                out.append({"backend": name, "error": str(e), "set_up": False})
                continue
            except Exception as e:  # noqa: BLE001 - any backend failure is a row, not a page error
                out.append({"backend": name, "error": f"{type(e).__name__}: {e}", "set_up": True})
                continue
            out.append({"backend": name, "deployments": scrub(rows, ())})
        return out

    def _list(self, name: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.backend(name).list()
        return rows

    def _deployment(
        self, backend: str, name: str, stuck_after: float | None
    ) -> tuple[Deployment, list[dict[str, Any]]]:
        key = (backend, name)
        with self._lock:
            dep = self._attached.get(key)
        if dep is not None:
            pods = pods_status(dep, stuck_after)
            if pods and not all("error" in p for p in pods):
                return dep, pods
        dep, pods = attach(self.backend(backend), name)  # new, or its pods were replaced
        with self._lock:
            self._attached[key] = dep
        if stuck_after is not None:
            pods = pods_status(dep, stuck_after)
        return dep, pods

    def detail(self, backend: str, name: str, stuck_after: float | None = None) -> dict[str, Any]:
        """One deployment's pods (each with its ranks' state and usage; ``stuck`` where a rank
        has been busy with one call for over ``stuck_after`` seconds, default the pods' 600)
        and its recent calls; for an autoscaled one also its replicas and its autoscaler's
        last decision (``serving``: what ``ktlite status`` prints)."""
        if stuck_after is not None and not stuck_after > 0:
            raise ConfigError(f"stuck_after={stuck_after:g}: give seconds > 0, e.g. 60")
        dep, pods = self._deployment(backend, name, stuck_after)
        token = dep.applied.token
        answer: dict[str, Any] = {
            "backend": backend,
            "name": name,
            "where": dep.backend.where(),
            "pods": [{k: v for k, v in p.items() if k != "recent_calls"} for p in pods],
            "calls": timeline.calls(pods),
            "autoscale": dep.applied.autoscale,
        }
        if dep.applied.autoscale is not None:  # replicas and the autoscaler, as `ktlite status`
            scaling = _quietly(lambda: dep.backend.scaling_status(name))
            answer["autoscaler"] = scaling
            answer["serving"] = status.serving(name, dep.applied.autoscale, scaling, pods)
        return dict(scrub(answer, (token,)))

    def secrets_of(self, backend: str, name: str) -> tuple[str, ...]:
        """The deployment's token (to blank it in what its pods write); NotDeployedError when
        it does not run."""
        with self._lock:
            dep = self._attached.get((backend, name))
        if dep is not None:
            return (dep.applied.token,)
        applied = self.backend(backend).lookup(name)
        if applied is None:
            raise NotDeployedError(f"no deployment {name!r} on backend {backend!r}")
        return (applied.token,)

    def forget(self, backend: str, name: str) -> None:
        with self._lock:
            self._attached.pop((backend, name), None)

    def teardown(self, backend: str, name: str) -> bool:
        self.forget(backend, name)
        return self.backend(backend).teardown(name, timeout=60.0)


def _quietly(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except KtliteError as e:
        return {"error": str(e)}


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """``fn(*args)`` on a thread of its own that never holds up the process's exit (a
    ThreadPoolExecutor's workers are joined at exit: a list hung on an unreachable cluster kept
    ``ktlite dashboard`` from stopping on Ctrl-C)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(e)

    threading.Thread(target=run, name="ktlite-dashboard-list", daemon=True).start()
    return future
