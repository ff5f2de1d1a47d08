"""What every mode of a deployment shares on the way to its pods: the call's options, its
plan (:class:`CallPlans`, the one place a call's ``CallPlan`` is built), how arguments and
results travel (inline, or in shared-memory files where the pods share this machine), how
streamed rank output is printed, and the :class:`CallPath` a mode works on (the deployment as
a mode sees it: spec, backend, pods, client, launch id, code).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ktlite.backends.base import Applied, Backend, PodEndpoint
from ktlite.errors import ConfigError, ProtocolMismatch
from ktlite.net.call_reply import CallReply
from ktlite.net.client import PodClient
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import argfiles, envelope, shm
from ktlite_wire.plan import CallPlan

# for work on every pod at once (health checks, launches, cancels, status)
pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ktlite")
_print_lock = threading.Lock()


@dataclass
class CallOptions:
    """Per-call options; never mixed with the user's own keyword arguments."""

    timeout: float | None = None
    stream_logs: bool | None = None
    workers: Any = None  # pod indices; Kubetorch's "any", "ready" and IPs too (Fanout.pick_workers)
    restart_procs: bool = False
    ranks: list[int] | None = None  # only these global ranks run the call


class CallPath(Protocol):
    """The deployment as its mode sees it (:class:`ktlite.modes.deploy.Deployment` is one)."""

    spec: DeploymentSpec
    backend: Backend
    applied: Applied
    client: PodClient
    launch_id: str
    # the code last pushed (bundle, local sources, init args), pushed again to replaced pods
    code: tuple[bytes, dict[str, Any], bytes | None] | None

    @property
    def name(self) -> str: ...

    @property
    def endpoints(self) -> list[PodEndpoint]: ...

    @property
    def closed(self) -> bool: ...

    def push(
        self, bundle: bytes, sources: dict[str, Any], init: bytes | None, restart: bool = False
    ) -> None: ...

    def wait_healthy(self, url: str, timeout: float) -> None: ...

    def cancel_all(self, call_id: str, reason: str, eps: list[PodEndpoint]) -> None: ...


class CallPlans:
    """The plans of one deployment's calls (:meth:`plan`, the one place a call's ``CallPlan``
    is built). What every call to the same pods shares (their URLs and names, ranks per pod,
    the launch, the quorum timeout) is built and checked once per set of pods; each call copies
    it and sets, and checks, only its own fields."""

    def __init__(self) -> None:
        # by the identities of the spec and the endpoints (a replaced pod is a new
        # PodEndpoint): the entry holds them, so no other object can take their ids
        self._bases: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def plan(
        self,
        spec: DeploymentSpec,
        launch_id: str,
        eps: Sequence[PodEndpoint],
        options: CallOptions,
        *,
        call_id: str,
        num_proc: int | Sequence[int],
        workers: list[int] | None = None,
        ranks: list[int] | None = None,
        per_rank: dict[str, Any] | None = None,
        tree: int = 0,
    ) -> CallPlan:
        """The plan of one call to ``eps`` (the first coordinates: it calls the others, or
        with ``tree`` its children in a call tree of that fan-out), with
        the deployment's call defaults (``spec.pod.calls``) where ``options`` leaves a setting
        open. A plan the pods would refuse is a ConfigError."""
        calls = spec.pod.calls
        sizes = num_proc if isinstance(num_proc, int) else tuple(num_proc)
        key = (id(spec), launch_id, sizes, *[id(ep) for ep in eps])
        try:
            entry = self._bases.get(key)
            if entry is None:  # new pods, a new launch: built and checked once
                base = CallPlan(
                    id="base",
                    launch_id=launch_id,
                    pods=[ep.peer_url for ep in eps],
                    names=[ep.name for ep in eps],
                    fanout=True,
                    quorum_timeout=spec.distributed.quorum_timeout,
                    num_proc=num_proc if isinstance(num_proc, int) else list(num_proc),
                )
                if len(self._bases) >= 64:  # replicas come and go: keep the recent ones
                    self._bases.clear()
                entry = self._bases[key] = (spec, tuple(eps), base, {})
            timeout = calls.call_timeout if options.timeout is None else options.timeout
            stream_logs = bool(
                calls.stream_logs if options.stream_logs is None else options.stream_logs
            )
            restart = bool(options.restart_procs)
            # the calls with the same options (a batch of submitted calls) share one checked
            # plan: each takes a copy with its own id
            alike = workers is None and ranks is None and per_rank is None
            alike = alike and (timeout is None or type(timeout) in (int, float))  # a key
            templates: dict[tuple[Any, ...], CallPlan] = entry[3]
            template = templates.get((timeout, stream_logs, restart, tree)) if alike else None
            if template is not None:
                return template.renamed(call_id)
            plan: CallPlan = entry[2].for_call(
                call_id,
                workers=workers,
                ranks=ranks,
                timeout=timeout,
                stream_logs=stream_logs,
                restart=restart,
                per_rank=per_rank,
                tree=tree,
            )
            if alike:
                if len(templates) >= 16:  # per-call timeouts that vary: keep the recent ones
                    templates.clear()
                templates[(timeout, stream_logs, restart, tree)] = plan.renamed("template")
        except ValueError as e:
            raise ConfigError(f"call to {spec.name!r}: {e}") from e
        return plan


class SentArguments:
    """A call's arguments as they are sent: ``parts`` (inline), or none with the plan naming
    the shared-memory file they were written to. :meth:`done` with the call's reply says
    whether that file may take the next call's arguments."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.reusable = False

    def done(self, reply: CallReply) -> None:
        """The call answered: its file is free when every rank said it let go of it."""
        self.reusable = reply.held == 0 and reply.all_ok()


class _Inline(SentArguments):
    """Arguments sent as they are (no file): nothing to give back when the call ends."""

    def __enter__(self) -> SentArguments:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def shm_arguments(
    applied: Applied, plan: CallPlan, parts: list[Any]
) -> contextlib.AbstractContextManager[SentArguments]:
    """The call's parts as they are sent: where the pods share this machine (local backend;
    ``KTLITE_SHM=0`` turns it off) results come back in shared-memory files, and arguments too
    big to inline go in one (``plan`` says so): a warm one of this process's
    (``ktlite_wire.argfiles``) when one is free, kept for the next call when the reply says
    no rank maps it any more (:meth:`SentArguments.done`), else removed (on a thread)."""
    if not applied.same_host or os.environ.get("KTLITE_SHM", "1") == "0":
        return _Inline(parts)
    plan.shm_results = True
    size = envelope.parts_size(parts)
    if size <= shm.INLINE_MAX:
        return _Inline(parts)  # the usual call: no generator to enter and leave
    return _in_file(plan, parts, size)


@contextlib.contextmanager
def _in_file(plan: CallPlan, parts: list[Any], size: int) -> Iterator[SentArguments]:
    """The arguments written to a warm argument file (``shm_arguments``)."""
    files = argfiles.process()
    landed = files.take(size)
    try:
        shm.write_into(landed.fd, parts, size, lambda n: None)
    except BaseException:
        files.give_back(landed, reusable=True)  # no pod saw it
        raise
    plan.shm = [landed.path, size]
    sent = SentArguments([])
    try:
        yield sent
    finally:
        files.give_back(landed, sent.reusable)


def print_log(rank: int, pod: str, stream: str, text: str) -> None:
    """A streamed line of the user's rank output, as ``[rank R @ pod] text`` (a stream, not a log record)."""
    out = sys.stderr if stream == "err" else sys.stdout
    with _print_lock:
        print(f"[rank {rank} @ {pod}] {text}", file=out, flush=True)


def check_python(health: dict[str, Any], url: str) -> None:
    """Functions travel by cloudpickle, whose bytecode only a matching Python minor runs."""
    theirs = str(health.get("python") or "")
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if theirs and ".".join(theirs.split(".")[:2]) != ours:
        raise ProtocolMismatch(
            f"pod {health.get('pod')} at {url} runs Python {theirs}, this client "
            f"Python {ours}: code shipped by cloudpickle needs the same minor "
            f"version; use an image with Python {ours} (kt.images.python('{ours}'), "
            "or build images/Dockerfile with a matching base)"
        )
