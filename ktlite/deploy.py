"""Orchestration: spec → backend → ready pods → code pushed → calls → per-rank results.

This is the only layer that turns per-rank outcomes into values or one error naming
every failed rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ktlite import protocol, shm
from ktlite.backends.base import Applied, Backend, get_backend
from ktlite.client import PodClient
from ktlite.errors import (
    CallCancelled,
    CallTimeout,
    ConfigError,
    DeployError,
    LaunchTimeout,
    NotDeployedError,
    PodUnreachable,
    ProtocolMismatch,
    QuorumTimeout,
    RankDied,
    RankFailure,
    RemoteError,
    RemoteException,
    with_remote_context,
)
from ktlite.spec import DeploymentSpec

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ktlite")
_print_lock = threading.Lock()


@dataclass
class CallOptions:
    """Per-call options; never mixed with the user's own keyword arguments."""

    timeout: float | None = None
    stream_logs: bool | None = None
    workers: list[int] | None = None
    restart_procs: bool = False


def print_log(rank: int, pod: str, stream: str, text: str) -> None:
    out = sys.stderr if stream == "err" else sys.stdout
    with _print_lock:
        print(f"[rank {rank} @ {pod}] {text}", file=out, flush=True)


class Deployment:
    """A live deployment: where its pods are, and how to call them."""

    def __init__(self, spec: DeploymentSpec, backend: Backend, applied: Applied) -> None:
        self.spec = spec
        self.backend = backend
        self.applied = applied
        self.client = PodClient(applied.token, http=applied.http)
        self.launch_id = ""

    def __repr__(self) -> str:
        return f"Deployment(name={self.spec.name!r}, backend={self.backend.name!r}, pods={len(self.applied.endpoints)})"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def endpoints(self) -> list[Any]:
        return self.applied.endpoints

    # ---- deploy ------------------------------------------------------------------------

    def push(self, bundle: bytes, sources: dict[str, Any], init: bytes | None,
             restart: bool = False) -> None:
        """Send the code to every pod; each restarts or reloads its rank processes."""
        self.launch_id = uuid.uuid4().hex[:12]
        d = self.spec.distributed
        ips = [ep.ip for ep in self.endpoints]
        timeout = self.spec.compute.launch_timeout
        base = {"launch_id": self.launch_id, "bundle": bundle, "kind": self.spec.kind, "init": init,
                "sources": sources, "distributed": asdict(d), "pod_ips": ips,
                "master_port": self.applied.master_port, "max_restarts": self.spec.compute.max_restarts,
                "cpus": self.spec.compute.cpu_count, "restart": restart, "load_timeout": timeout}

        def one(ep: Any) -> list[Any]:
            self._wait_healthy(ep.url, timeout)
            return self.client.deploy(ep.url, protocol.dumps({**base, "ordinal": ep.ordinal}), timeout + 30)

        outcomes = [o for outs in _pool.map(one, self.endpoints) for o in outs]
        failures, values = _split(outcomes)
        if failures:
            raise _to_error(failures, values, f"deploying {self.name!r} failed", DeployError)

    def _wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                health = self.client.health(url)
                _check_python(health, url)
                return
            except PodUnreachable as e:
                if time.monotonic() > deadline:
                    raise LaunchTimeout(f"pod at {url} did not answer /health within {timeout:g}s: {e}") from e
                time.sleep(0.05)

    # ---- calls -------------------------------------------------------------------------

    def call(self, method: str | None, parts: list[Any], options: CallOptions,
             log: Any = None) -> list[Any]:
        """Run one call on every rank (or the chosen workers); values in rank order.
        ``log(rank, pod, stream, text)`` prints streamed lines (default ``[rank R @ pod]``)."""
        eps = self.endpoints
        d = self.spec.distributed
        if options.workers is not None:
            bad = [w for w in options.workers if not isinstance(w, int) or isinstance(w, bool)
                   or not 0 <= w < len(eps)]
            if bad or not options.workers:
                raise ConfigError(f"workers={options.workers!r}: give pod indices between 0 and {len(eps) - 1}")
        stream = self.spec.compute.stream_logs if options.stream_logs is None else options.stream_logs
        call_id = uuid.uuid4().hex
        meta = {"id": call_id, "launch_id": self.launch_id,
                "pods": [ep.peer_url for ep in eps], "names": [ep.name for ep in eps],
                "workers": sorted(set(options.workers)) if options.workers is not None else None,
                "timeout": options.timeout if options.timeout is not None else self.spec.compute.call_timeout,
                "stream_logs": stream, "restart": options.restart_procs,
                "fanout": True, "quorum_timeout": d.quorum_timeout, "num_proc": d.num_proc}
        coordinator = eps[0].url
        arg_file = None
        if self.applied.same_host and os.environ.get("KTLITE_SHM", "1") != "0":
            meta["shm_results"] = True
            if protocol.parts_size(parts) > shm.INLINE_MAX:
                arg_file, size = shm.write(parts, shm.ARG_PREFIX)
                meta["shm"], parts = [arg_file, size], []
        try:
            outcomes = self.client.call(coordinator, meta, parts, (log or print_log) if stream else None)
        except PodUnreachable as e:
            # the coordinator cannot stop the other pods' ranks now: ask them directly
            self._cancel_all(call_id, "the coordinator pod stopped answering", eps[1:])
            current = self.backend.lookup(self.name)
            if current is None or current.token != self.applied.token:
                raise NotDeployedError(f"deployment {self.name!r} was torn down or replaced; "
                                       "call .to(compute) again") from e
            raise PodUnreachable(f"coordinator pod {eps[0].name}: {e}; the other pods were told to stop "
                                 "the call. Call .to() again to restart a dead pod") from e
        except KeyboardInterrupt:
            # stop the ranks everywhere before giving control back; the deployment stays usable
            self._cancel_all(call_id, "the caller pressed Ctrl-C", [*eps[1:], eps[0]])
            raise
        finally:
            if arg_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(arg_file)
        failures, values = _split(outcomes)
        if failures:
            raise _to_error(failures, values, f"call to {self.name!r}", RemoteError)
        return [values[r] for r in sorted(values)]

    def _cancel_all(self, call_id: str, reason: str, eps: list[Any]) -> None:
        """Best effort, all at once, briefly: a hung pod must not delay the others."""
        futures = [_pool.submit(self.client.cancel, ep.url, call_id, reason, 1.5) for ep in eps]
        concurrent.futures.wait(futures, timeout=2.0)

    def status(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        return [self.client.status(ep.url, stuck_after) for ep in self.endpoints]

    def close(self) -> None:
        self.client.close()


def _check_python(health: dict[str, Any], url: str) -> None:
    """Functions travel by cloudpickle, whose bytecode only a matching Python minor runs."""
    theirs = str(health.get("python") or "")
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if theirs and ".".join(theirs.split(".")[:2]) != ours:
        raise ProtocolMismatch(f"pod {health.get('pod')} at {url} runs Python {theirs}, this client "
                               f"Python {ours}: code shipped by cloudpickle needs the same minor "
                               f"version; use an image with Python {ours} (kt.images.python('{ours}'), "
                               "or build images/Dockerfile with a matching base)")


def deploy(spec: DeploymentSpec, bundle: bytes, sources: dict[str, Any], init: bytes | None,
           restart: bool = False) -> Deployment:
    backend = get_backend(spec.compute.backend, spec.compute.namespace)
    existing = backend.lookup(spec.name)
    token = existing.token if existing is not None else secrets.token_urlsafe(32)
    applied = backend.apply(spec, token)
    dep = Deployment(spec, backend, applied)
    try:
        dep.push(bundle, sources, init, restart)
    except BaseException:
        dep.close()
        raise
    return dep


def attach(spec: DeploymentSpec) -> Deployment:
    """The running deployment for ``spec.name``, without deploying."""
    backend = get_backend(spec.compute.backend, spec.compute.namespace)
    applied = backend.lookup(spec.name)
    if applied is None:
        raise NotDeployedError(f"deployment {spec.name!r} is not running on backend {backend.name!r}; "
                               "deploy it with .to(compute) or `ktlite deploy`")
    return Deployment(spec, backend, applied)


# ---- outcomes → values / errors ------------------------------------------------------------

# a failed rank's kind -> the error that reports it ("error" keeps the rank's own exception)
_KIND_ERRORS: dict[str, type[RemoteError]] = {
    "died": RankDied, "unreachable": QuorumTimeout, "timeout": CallTimeout, "cancelled": CallCancelled}

def _split(outcomes: list[tuple[int, str, str, Any, str, float]]
           ) -> tuple[list[RankFailure], dict[int, Any]]:
    failures: list[RankFailure] = []
    values: dict[int, Any] = {}
    # values handed over in shared-memory files: take every one first, so none is left behind
    outcomes = [(r, p, s, shm.take(d[1], d[2]) if isinstance(d, tuple) else d, m, at)
                for r, p, s, d, m, at in outcomes]
    for rank, pod, status, data, message, at in sorted(outcomes, key=lambda o: o[0]):
        if status == "ok":
            try:
                values[rank] = protocol.loads(data) if data is not None else None
            except Exception as e:  # noqa: BLE001
                failures.append(RankFailure(rank, pod, "error", f"its result could not be unpickled here: "
                                            f"{type(e).__name__}: {e}", exception=e, at=at))
        elif status == "error":
            info = protocol.loads(data)
            exc: BaseException | None = None
            if info.pickled is not None:
                with contextlib.suppress(Exception):
                    exc = protocol.loads(info.pickled)
            failures.append(RankFailure(rank, pod, "error", f"{info.type_name}: {info.message}",
                                        traceback=info.traceback, exception=exc, at=at))
            if exc is None:
                failures[-1].exception = RemoteException(
                    f"rank {rank} on pod {pod} raised {info.type_name}: {info.message}",
                    type_name=info.type_name, remote_traceback=info.traceback)
        else:
            failure = RankFailure(rank, pod, status, message, at=at)
            # outcomes hold a value or an exception for every rank
            failure.exception = (NotDeployedError(failure.describe()) if status == "stale"
                                 else _KIND_ERRORS.get(status, RemoteError)(failure.describe(),
                                                                            failures=[failure]))
            failures.append(failure)
    return failures, values


def _to_error(failures: list[RankFailure], values: dict[int, Any], what: str,
              base: type[Exception]) -> BaseException:
    primary = [f for f in failures if f.kind in ("error", "died", "unreachable", "stale")] or failures
    collateral = [f for f in failures if f not in primary]
    # the cause is the earliest failure (a peer's "connection reset" comes after the death
    # that caused it), then the lowest rank
    primary.sort(key=lambda f: (f.at or float("inf"), f.rank))
    outcomes: dict[int, Any] = dict(values)
    for f in failures:
        outcomes[f.rank] = f.exception if f.exception is not None else f
    lines = [f"{what}: {len(primary)} rank(s) failed: "
             f"{', '.join(str(r) for r in sorted(f.rank for f in primary))}"]
    lines += [f.describe() for f in primary]
    if collateral:
        kinds = sorted({f.kind for f in collateral})
        lines.append(f"{' / '.join(kinds)}: rank(s) {', '.join(str(f.rank) for f in collateral)} "
                     f"({collateral[0].message})")
    if values:
        lines.append(f"finished: rank(s) {', '.join(map(str, sorted(values)))} (their results are on "
                     "this error's .results)")
    elif primary[0].kind == "timeout":
        lines.append("no rank finished")
    if primary[0].kind == "timeout":
        lines.append("to try: a longer limit (remote.options(timeout=S) or Compute(call_timeout=S)); "
                     "if a rank hangs (a collective some rank never joined), its pod's log "
                     "(remote.logs()) shows how far it got")
    summary = "\n".join(lines)
    first = primary[0]
    if first.kind == "error" and first.exception is not None:
        if isinstance(first.exception, RemoteException):
            first.exception.failures, first.exception.outcomes = failures, outcomes
            first.exception.args = (first.exception.args[0] + "\n" + summary,)
            return first.exception
        return with_remote_context(first.exception, failures, outcomes, summary)
    if base is DeployError:
        return DeployError(summary)
    if first.kind == "stale":
        return NotDeployedError(summary)
    return _KIND_ERRORS.get(first.kind, RemoteError)(summary, failures=failures, outcomes=outcomes)
