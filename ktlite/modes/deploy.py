"""Orchestration: spec → backend → ready pods → code pushed → calls → per-rank results.

A :class:`Deployment` is the call path every mode shares: its pods (endpoints), the client
that reaches them, the code pushed to them, the queue of submitted calls, colocated targets,
and closing. Where a call goes and how its results come back is its mode's
(:mod:`ktlite.modes.mode`), chosen once here (:func:`mode_for`) from the spec.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import sys
import time
import uuid
from typing import Any

from ktlite.backends.base import Applied, Backend, PodEndpoint
from ktlite.backends.registry import get_backend, traits
from ktlite.datastore.store import handoff
from ktlite.errors import (
    DeployError,
    LaunchTimeout,
    NotDeployedError,
    PodUnreachable,
)
from ktlite.modes.callpath import CallOptions, check_python, pool, print_log, shm_arguments
from ktlite.modes.fanout import Fanout, HeadOnly
from ktlite.modes.launch import build_launch
from ktlite.modes.mode import Mode
from ktlite.modes.outcomes import split, to_error
from ktlite.modes.routing import Routing
from ktlite.modes.submissions import Submissions
from ktlite.net.client import PodClient
from ktlite.net.progress import ticking
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import argfiles
from ktlite_wire.launch import Colocation

__all__ = [
    "CallOptions",
    "Deployment",
    "attach",
    "backend_of",
    "deploy",
    "mode_for",
    "print_log",
    "shm_arguments",
]


logger = logging.getLogger(__name__)


def _loading(spec: DeploymentSpec) -> str:
    """What a code push waits for, as its status line says it."""
    pods = f"{spec.workers} pod(s)"
    framework = spec.distributed.framework
    if framework == "ray":
        return f"loading the code and forming the Ray cluster on {pods}"
    if framework == "monarch":
        return f"loading the code and forming the Monarch mesh on {pods}"
    return f"loading the code on {pods}"


def backend_of(spec: DeploymentSpec) -> Backend:
    """The backend ``spec``'s pods run on (its cluster, for Kubernetes)."""
    pod = spec.pod
    return get_backend(pod.backend, pod.kubernetes.namespace, pod.kubernetes.kubeconfig_path)


def mode_for(spec: DeploymentSpec) -> type[Mode]:
    """The mode of a deployment of ``spec``: the one place that reads which one it is."""
    if spec.autoscale is not None:
        return Routing
    if spec.distributed.engine:
        return HeadOnly
    return Fanout


class Deployment:
    """A live deployment: where its pods are, and how to call them (through its ``mode``)."""

    def __init__(
        self,
        spec: DeploymentSpec,
        backend: Backend,
        applied: Applied,
        client: PodClient | None = None,
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.applied = applied
        self.client = client or PodClient(applied.token, http=applied.http)
        self.launch_id = ""
        self.code: tuple[bytes, dict[str, Any], bytes | None] | None = None  # for pushing again
        self.submissions = Submissions(self)  # remote.submit()'s calls, FIFO
        self._closed = False
        # colocated targets (kt.cls(B).to(remote)): name -> (kind, bundle, sources, init), pushed
        # again with the code to pods the backend replaced
        self.colocated: dict[str, tuple[str, bytes, dict[str, Any], bytes | None]] = {}
        self.mode: Mode = mode_for(spec)(self)

    def __repr__(self) -> str:
        return (
            f"Deployment(name={self.spec.name!r}, backend={self.backend.name!r}, "
            f"pods={len(self.applied.endpoints)}, mode={type(self.mode).__name__})"
        )

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def endpoints(self) -> list[PodEndpoint]:
        return self.applied.endpoints

    @property
    def closed(self) -> bool:
        """Torn down (or closed): no more calls."""
        return self._closed

    @property
    def single(self) -> bool:
        """A call returns one value (not a list by rank)."""
        return self.mode.single

    # ---- deploy ------------------------------------------------------------------------

    def push(
        self, bundle: bytes, sources: dict[str, Any], init: bytes | None, restart: bool = False
    ) -> None:
        """Send the code to every pod (the mode says which and how); each restarts or
        reloads its rank processes."""
        self.code = (bundle, sources, init)
        self.launch_id = uuid.uuid4().hex[:12]
        launch = build_launch(
            self.spec,
            launch_id=self.launch_id,
            code=(bundle, sources, init),
            master_port=self.applied.master_port,
            restart=restart,
            **self.mode.launch_fields(),
        )
        # where the data store is, for kt.put/get in the ranks: read while the pods are asked for
        # /health (queued before them: a pod's launch waiting for it never holds up its task)
        access = self.spec.pod.kubernetes.store_access
        store = pool.submit(handoff, self.backend, self.spec.name, access)
        with ticking(self.name, _loading(self.spec)):
            self.mode.load(launch, store)
        self.recolocate()

    def recolocate(self) -> None:
        """Push the colocated targets again where a pod lacks them (a replaced pod, a new
        one); instances that survived a redeploy in their processes stay."""
        for target, (kind, tbundle, tsources, tinit) in list(self.colocated.items()):
            self.colocate(target, kind, tbundle, tsources, tinit, if_missing=True)

    def colocate(
        self,
        target: str,
        kind: str,
        bundle: bytes | None,
        sources: dict[str, Any],
        init: bytes | None,
        drop: bool = False,
        if_missing: bool = False,
    ) -> None:
        """Load a second function/class (``target``) into this deployment's rank processes
        (or with ``drop``, remove it): a colocation launch, sent like the code's own."""
        self.mode.check_colocation(target)
        timeout = self.spec.pod.calls.launch_timeout
        body = Colocation(
            target=target,
            launch_id=self.launch_id or "",
            kind=kind,
            bundle=bundle,
            init=init,
            sources=sources,
            drop=drop,
            if_missing=if_missing,
        ).encode()

        # several pods: sent once, to pod 0, which relays it as it relays the code
        relay = self.mode.launch_relay(timeout)

        def one(ep: Any) -> list[Any]:
            return self.client.deploy(ep.url, body, timeout + 30, relay=relay)

        eps = self.endpoints[:1] if relay is not None else self.endpoints
        outcomes = [o for outs in pool.map(one, eps) for o in outs]
        failures, values = split(outcomes)
        if failures:
            what = "removing" if drop else "colocating"
            raise to_error(
                failures, values, f"{what} {target!r} on {self.name!r} failed", DeployError
            )
        if drop:
            self.colocated.pop(target, None)
        else:
            self.colocated[target] = (kind, bundle or b"", sources, init)

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                health = self.client.health(url)
                check_python(health, url)
                return
            except PodUnreachable as e:
                if time.monotonic() > deadline:
                    raise LaunchTimeout(
                        f"pod at {url} did not answer /health within {timeout:g}s: {e}"
                    ) from e
                time.sleep(0.05)

    # ---- calls -------------------------------------------------------------------------

    def submit(
        self,
        method: str | None,
        parts: list[Any],
        options: CallOptions,
        future: Any,
        per_rank: dict[str, Any] | None = None,
    ) -> Any:
        """Queue one call; ``future`` (a :class:`kt.Future`) gets its values in rank order.

        Submitted calls leave in the order they were submitted, at most
        ``mode.parallel_calls()`` at a time (one for a distributed deployment: the ranks run its
        calls one by one, and a queue here keeps them in submission order; many for an
        autoscaled one, whose waiting calls count as load): ``submissions.Submissions``."""
        self.submissions.submit((method, parts, options, future, per_rank))
        return future

    def call(
        self,
        method: str | None,
        parts: list[Any],
        options: CallOptions,
        log: Any = None,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run one call as the mode runs it; values in rank order (``[value]`` when single).
        ``log(rank, pod, stream, text)`` prints streamed lines (default ``[rank R @ pod]``)."""
        return self.mode.call(parts, options, log, on_send, per_rank)

    def cancel_all(self, call_id: str, reason: str, eps: list[PodEndpoint]) -> None:
        """Best effort, all at once, briefly: a hung pod must not delay the others (in a call
        tree: to the pods that relay it to the others: ``mode.cancel_targets``)."""
        eps = self.mode.cancel_targets(eps)
        futures = [pool.submit(self.client.cancel, ep.url, call_id, reason, 1.5) for ep in eps]
        concurrent.futures.wait(futures, timeout=2.0)

    def restart_failed(self) -> dict[str, Any]:
        """Restart the dead rank processes on every pod (only those)."""
        return self.mode.restart_failed()

    def status(self, stuck_after: float | None = None) -> Any:
        return self.mode.status(stuck_after)

    def teardown(self, volumes: bool = False, timeout: float | None = None) -> None:
        """Stop every pod of this deployment and delete what it created (its volumes too with
        ``volumes``), waiting up to ``timeout`` seconds (default ``Compute.teardown_timeout``);
        then close it."""
        limit = self.spec.pod.calls.teardown_timeout if timeout is None else timeout
        self.fail_queued()  # submitted calls that have not started never will
        self.backend.teardown(self.name, timeout=limit, volumes=volumes)
        for ep in self.endpoints:
            self.client.forget(ep.url)
        argfiles.process().clear()  # the warm argument files this process kept (none in use)
        self.close()

    def close(self) -> None:
        """Fail the submitted calls that have not started, then drop the connections."""
        self.fail_queued()
        self.client.close()

    def fail_queued(self) -> None:
        """No more submitted calls: those not started yet fail with NotDeployedError; the
        mode stops what it runs in the background and wakes the calls waiting in it."""
        self._closed = True
        self.submissions.close()
        self.mode.stop()


def deploy(
    spec: DeploymentSpec,
    bundle: bytes,
    sources: dict[str, Any],
    init: bytes | None,
    restart: bool = False,
) -> Deployment:
    mode = mode_for(spec)
    mode.check(spec)
    backend = backend_of(spec)
    existing = backend.lookup(spec.name)
    token = existing.token if existing is not None else secrets.token_urlsafe(32)
    spec = mode.shape(spec, backend, existing)
    logger.info("%s: asking the %s backend for the pods", spec.name, backend.name)
    applied = backend.apply(spec, token)
    dep = Deployment(spec, backend, applied)
    try:
        dep.push(bundle, sources, init, restart)
        logger.info(
            "%s: launch %s ready on %d pod(s)", spec.name, dep.launch_id, len(applied.endpoints)
        )
    except BaseException as e:
        dep.close()
        # the pods are fine, the code is not: they stay warm for the next .to() (notes are
        # Python 3.11's; before, the error goes as it is)
        if (
            sys.version_info >= (3, 11)
            and isinstance(e, Exception)
            and (traits(backend.name).pods_outlive_caller or spec.detached)
        ):
            e.add_note(
                f"the pods of {spec.name!r} keep running, so the next .to() reuses them; "
                f"`ktlite teardown {spec.name}` removes them"
            )
        raise
    dep.mode.deployed()
    return dep


def attach(spec: DeploymentSpec) -> Deployment:
    """The running deployment for ``spec.name``, without deploying."""
    backend = backend_of(spec)
    applied = backend.lookup(spec.name)
    if applied is None:
        raise NotDeployedError(
            f"deployment {spec.name!r} is not running on backend {backend.name!r}; "
            "deploy it with .to(compute) or `ktlite deploy`"
        )
    dep = Deployment(spec, backend, applied)
    dep.mode.adopt()
    return dep
