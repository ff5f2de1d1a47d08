"""What a pod's rank zygote (``rankzygote``) imports before it forks ranks: ``torch`` for a
deployment whose ranks use it, so a rank forked later (a restart after a failed collective)
finds it imported, its pages shared with the zygote, instead of paying ~1 CPU-s and ~100 MB
of its own for the import each time.

When: ``KTLITE_RANK_PRELOAD`` in the pod's environment (``Compute(env=...)``) names the
modules (comma-separated; empty: none, ever), for every rank started once the code arrived. Unset, the pod server preloads ``torch`` once a
rank of the deployment has shown it uses it (:func:`used_torch`): torch's library was mapped
in the rank once it had loaded the code (``import torch`` at a module's top), or in a rank
still alive when another is replaced, or the rank held a ``torch.distributed`` group (it says
so in each result: ``has_pg``). Not on ``distribute("pytorch")`` alone: a deployment that never
imports torch would carry a ~250 MB zygote for nothing (past a 200 MiB ``memory_limit``, the
kernel kills it). The first ranks, started before the code arrived, import torch themselves;
the restarts after the evidence fork from the torch zygote.

The modules travel in the environment the ranks start with (:func:`start_env`), so a zygote
(started with that environment) and its ranks always agree, and a zygote keyed by its
environment (``rankzygote.shared``) never serves a rank that expects another preload.

Correctness in the zygote (:func:`preload`):

- the library state an import fixes for the process is the one a rank that imported the
  module itself, after its ``Load``, would have: thread counts are read once, at import
  (OpenBLAS, torch's intra-op default), so the rank env's :data:`THREAD_VARS` are part of the
  start environment too;
- ``torch.distributed`` (which ``import torch`` imports) is patched as a rank patches it
  (``distpatch.PatchOnImport`` is installed first);
- CUDA is never initialised (``import torch`` does not; a forked child could not use it): the
  zygote checks and refuses to fork after one that did;
- ``import torch`` starts one thread (numpy's OpenBLAS server), which OpenBLAS itself stops
  around each ``fork`` (its ``pthread_atfork`` handler), and the zygote runs no tensor op, so
  no intra-op or OpenMP pool exists to be copied mid-lock.

A module that fails to import is logged and dropped from ``sys.modules`` again: the zygote
goes on without it and a rank imports it (and meets the same error) itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Protocol

from ktlite_server.distpatch import PatchOnImport

logger = logging.getLogger(__name__)

PRELOAD_VAR = "KTLITE_RANK_PRELOAD"
# read by a library once, at import: a preloaded library must see a rank's values
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
_installed: dict[str, bool] = {}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (asked once: a path scan)."""
    if module not in _installed:
        try:
            _installed[module] = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            _installed[module] = False
    return _installed[module]


def start_env(
    base_env: Mapping[str, str], rank_env: Mapping[str, str] | None, uses_torch: bool
) -> dict[str, str]:
    """The environment a rank starts with (its zygote's): the pod's, and where modules are
    preloaded, their names and the rank env's :data:`THREAD_VARS`. Without a deployment yet
    (``rank_env`` None: the ranks started before the code arrives) nothing is preloaded, as
    the thread settings a library fixes at import are not known: those ranks import what
    they use after their ``Load``, and serve any deployment."""
    if rank_env is None:
        return {k: v for k, v in base_env.items() if k != PRELOAD_VAR}
    modules = base_env.get(PRELOAD_VAR)  # the pod's own setting wins, "" included
    if modules is None:
        modules = "torch" if uses_torch and installed("torch") else ""
    if not names(modules):
        return dict(base_env)
    threads = {k: v for k, v in rank_env.items() if k in THREAD_VARS}
    return {**base_env, **threads, PRELOAD_VAR: modules}


class _Rank(Protocol):
    has_pg: bool

    @property
    def alive(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...


def used_torch(ranks: Iterable[_Rank | None]) -> bool:
    """Whether one of ``ranks`` shows that the deployment's code uses torch: it held a
    ``torch.distributed`` group, or (alive) has torch's library mapped."""
    for r in ranks:
        if r is not None and (r.has_pg or (r.alive and r.pid is not None and _maps_torch(r.pid))):
            return True
    return False


def _maps_torch(pid: int) -> bool:
    try:  # ~50 KB for a process with torch: well under a millisecond
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"/libtorch" in f.read()
    except OSError:
        return False


def names(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def preload(env: Mapping[str, str] = os.environ) -> str | None:
    """In the zygote, before it forks: import the modules ``env`` names. Returns why the zygote
    must not fork (CUDA got initialised), or None."""
    wanted = names(env.get(PRELOAD_VAR, ""))
    if not wanted:
        return None
    # torch.distributed is imported by `import torch`: patched here as a rank would patch it
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport())
    for name in wanted:
        before = set(sys.modules)
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure: go on without it
            for added in set(sys.modules) - before:
                sys.modules.pop(added, None)
            logger.warning(
                "ktlite: the rank zygote could not preload %s (%s: %s); ranks import it themselves",
                name,
                type(e).__name__,
                e,
            )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA was initialised while preloading " + ", ".join(wanted)
    logger.debug("ktlite: the rank zygote preloaded %s (%d threads)", ", ".join(wanted), threads())
    return None


def threads() -> int:
    """This process's threads (the kernel's count, native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0
