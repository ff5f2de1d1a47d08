"""What a rank process changes in ``torch.distributed`` and ``ray`` as they are imported, so
that long-lived rank processes behave as fresh ones would across calls (see
:class:`PatchOnImport`), and whether a process holds ``torch.distributed`` state."""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import os
import sys
from typing import Any


def holds_dist_state() -> bool:
    """Whether torch.distributed state lives in this process: a process group, or what an
    ``init_process_group`` that raised left behind (a peer went away mid-rendezvous). The
    latter holds no group, but torch's group counter has moved on, so this process's next
    rendezvous would use another store prefix than its fresh peers' and all would wait
    forever: the pod must restart such a rank after a failed call, like one with a group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    if getattr(dist, "_ktlite_init_called", False):
        return True
    try:
        if dist.is_available() and dist.is_initialized():
            return True
        # init_process_group called past our patch (distributed_c10d's own name)
        return getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", 0) > 0
    except Exception:
        return False


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.distributed`` as it is imported so the default process group lives as
    long as the rank process (and ``ray`` on a Ray deployment: see :func:`_patch_ray`).

    A stateless function calls ``init_process_group`` on every call. Re-creating the group in
    the same process is unsafe: DDP keeps the old group, and with it rank 0's TCPStore server
    on MASTER_PORT, alive in reference cycles, and the next rendezvous splits between the
    stale and the new store and hangs. So a second ``init_process_group`` with the same
    backend returns the live group, and ``destroy_process_group()`` of the default group is
    deferred to process exit. The server restarts rank processes whenever the rank env
    changes or a call fails, so a kept group always matches its peers.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        patch = _IMPORT_PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                original = spec.loader.exec_module

                def exec_module(module: Any, _original: Any = original) -> None:
                    _original(module)
                    patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def _patch_dist(dist: Any) -> None:
    if not dist.is_available() or getattr(dist, "_ktlite_patched", False):
        return
    original_init, original_destroy = dist.init_process_group, dist.destroy_process_group
    original_is_initialized = dist.is_initialized

    def is_initialized() -> bool:
        # a group the deployment has moved on from reads as none, so the guarded form that
        # Lightning and Kubetorch's examples write (``if not dist.is_initialized():
        # dist.init_process_group(...)``) re-forms it too; torch's own code keeps seeing it
        return original_is_initialized() and not getattr(dist, "_ktlite_stale", False)

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        dist._ktlite_init_called = True  # even if it raises: see holds_dist_state
        if getattr(dist, "_ktlite_stale", False):
            # a rank of the deployment was restarted (or a call failed) since this group was
            # formed: leave it and rendezvous anew on this generation's MASTER_PORT, with the
            # group counter where a fresh process has it, so every rank names the group alike
            dist._ktlite_stale = False
            if original_is_initialized():
                with contextlib.suppress(Exception):
                    original_destroy()
                gc.collect()
            with contextlib.suppress(Exception):
                dist.distributed_c10d._world.group_count = 0
        if dist.is_initialized():
            current = str(dist.get_backend()).lower()
            if backend is None or str(backend).lower() in current:
                return None  # the group from an earlier call of this rank process
            original_destroy()
            gc.collect()
        return original_init(backend, *args, **kwargs)

    def destroy_process_group(group: Any = None) -> Any:
        if group is None or group is dist.GroupMember.WORLD:
            return None  # kept for the next call; it ends with the rank process
        return original_destroy(group)

    init_process_group.__doc__ = original_init.__doc__
    is_initialized.__doc__ = original_is_initialized.__doc__
    destroy_process_group.__doc__ = original_destroy.__doc__
    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group
    dist.is_initialized = is_initialized
    dist._ktlite_patched = True


def _patch_ray(ray: Any) -> None:
    """On a Ray deployment every call is a driver of the same cluster, in the same rank
    process: a second ``ray.init()`` (the function calls it each time) keeps the connection
    of the first, with its actors, instead of raising."""
    if os.environ.get("KTLITE_FRAMEWORK") != "ray" or getattr(ray, "_ktlite_patched", False):
        return
    original_init = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("ignore_reinit_error", True)
        return original_init(*args, **kwargs)

    init.__doc__ = original_init.__doc__
    ray.init = init
    ray._ktlite_patched = True


_IMPORT_PATCHES = {"torch.distributed": _patch_dist, "ray": _patch_ray}
