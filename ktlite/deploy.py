"""Orchestration: spec → backend → ready pods → code pushed → calls → per-rank results.

This is the only layer that turns per-rank outcomes into values or one error naming
every failed rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from ktlite import engines
from ktlite.backends.base import Applied, Backend
from ktlite.backends.capabilities import ClientScaling, Serving, optional, require
from ktlite.backends.registry import get_backend, traits
from ktlite.client import CallReply, PodClient
from ktlite.deployment_spec import DeploymentSpec
from ktlite.errors import (
    CallCancelled,
    CallTimeout,
    ConfigError,
    DeployError,
    KtliteError,
    LaunchTimeout,
    NotDeployedError,
    PodUnreachable,
    ProtocolMismatch,
    QuorumTimeout,
    RankDied,
    RankFailure,
    RemoteError,
    RemoteException,
    WorkerMembershipChanged,
    with_remote_context,
)
from ktlite.launch import build_launch
from ktlite_wire import codec, envelope, shm
from ktlite_wire.launch import Colocation
from ktlite_wire.outcome import RankOutcome, ShmRef
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ktlite")


class _ReplacedWatch:
    """Reads the coordinator's notices during a call: when it cannot reach some pods yet and
    the backend shows them replaced (their old IPs swallow packets, so the wait would last
    ``quorum_timeout``), it cancels the call, which no rank has started yet."""

    def __init__(self, dep: Deployment, call_id: str) -> None:
        self.dep, self.call_id = dep, call_id
        self.replaced: list[str] = []
        self._checked = 0.0

    def __call__(self, info: dict[str, Any]) -> None:
        if info.get("kind") != "waiting" or self.replaced or time.monotonic() - self._checked < 2.0:
            return
        self._checked = time.monotonic()
        with contextlib.suppress(Exception):  # a failed check only means we keep waiting
            gone = self.dep._replaced([int(i) for i in info.get("pods") or []])
            if gone:
                self.replaced.extend(gone)
                self.dep.client.cancel(self.dep.endpoints[0].url, self.call_id,
                                       f"pod(s) {', '.join(gone)} were replaced")


class _CancelledBeforeSend(Exception):
    """A submitted call cancelled just before it left: it never reaches a pod."""


class _NotStarted(Exception):
    """A call no rank started because pods were replaced: safe to send again once healed."""

    def __init__(self, error: BaseException, why: str) -> None:
        super().__init__(why)
        self.error, self.why = error, why
_print_lock = threading.Lock()


@dataclass
class CallOptions:
    """Per-call options; never mixed with the user's own keyword arguments."""

    timeout: float | None = None
    stream_logs: bool | None = None
    workers: Any = None  # pod indices; Kubetorch's "any", "ready" and IPs too (Deployment._pick_workers)
    restart_procs: bool = False
    ranks: list[int] | None = None  # only these global ranks run the call


@contextlib.contextmanager
def shm_arguments(applied: Applied, meta: dict[str, Any], parts: list[Any]) -> Iterator[list[Any]]:
    """The call's parts as they are sent: where the pods share this machine (local backend;
    ``KTLITE_SHM=0`` turns it off) results come back in shared-memory files, and arguments too
    big to inline go in one, removed when the call ends."""
    if not applied.same_host or os.environ.get("KTLITE_SHM", "1") == "0":
        yield parts
        return
    meta["shm_results"] = True
    if envelope.parts_size(parts) <= shm.INLINE_MAX:
        yield parts
        return
    arg_file, size = shm.write(parts, shm.ARG_PREFIX)
    meta["shm"] = [arg_file, size]
    try:
        yield []
    finally:
        with contextlib.suppress(OSError):
            os.unlink(arg_file)


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
        self._code: tuple[bytes, dict[str, Any], bytes | None] | None = None  # for pushing again
        self._suspect = False  # a call lost a pod: check for replaced pods before the next one
        self._queue: concurrent.futures.ThreadPoolExecutor | None = None  # submitted calls, FIFO
        self._queued: set[Any] = set()  # their futures, until they end
        self._queue_lock = threading.Lock()
        self._closed = False
        # colocated targets (kt.cls(B).to(remote)): name -> (kind, bundle, sources, init), pushed
        # again with the code to pods the backend replaced
        self.colocated: dict[str, tuple[str, bytes, dict[str, Any], bytes | None]] = {}

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
        self._code = (bundle, sources, init)
        self.launch_id = uuid.uuid4().hex[:12]
        d = self.spec.distributed
        ips = [ep.ip for ep in self.endpoints]
        timeout = self.spec.compute.launch_timeout
        base = build_launch(self.spec, launch_id=self.launch_id, code=(bundle, sources, init), pod_ips=ips,
                            master_port=self.applied.master_port, restart=restart,
                            single=self.spec.compute.distributed is None)
        from ktlite.store import handoff
        # where the data store is, for kt.put/get in the ranks: read while the pods are asked for
        # /health (queued before them: a one() waiting for it never holds up its task)
        store = _pool.submit(handoff, self.backend)

        names = [ep.name for ep in self.endpoints]

        def one(ep: Any) -> list[Any]:
            self._wait_healthy(ep.url, timeout)
            engine = engines.engine_settings(self.spec, ep.ordinal, ips, names, self.applied.master_port,
                                             self.launch_id, [e.peer_url for e in self.endpoints],
                                             self.applied.token, self.applied.same_host) if d.engine else None
            msg = replace(base, ordinal=ep.ordinal, store=store.result(), engine=engine)
            return self.client.deploy(ep.url, msg.encode(), timeout + 30)

        outcomes = [o for outs in _pool.map(one, self.endpoints) for o in outs]
        failures, values = _split(outcomes)
        if failures:
            raise _to_error(failures, values, f"deploying {self.name!r} failed", DeployError)
        self.recolocate()

    def recolocate(self) -> None:
        """Push the colocated targets again where a pod lacks them (a replaced pod, a new
        one); instances that survived a redeploy in their processes stay."""
        for target, (kind, tbundle, tsources, tinit) in list(self.colocated.items()):
            self.colocate(target, kind, tbundle, tsources, tinit, if_missing=True)

    def colocate(self, target: str, kind: str, bundle: bytes | None, sources: dict[str, Any],
                 init: bytes | None, drop: bool = False, if_missing: bool = False) -> None:
        """Load a second function/class (``target``) into this deployment's rank processes
        (or with ``drop``, remove it): a colocation launch, sent like the code's own."""
        timeout = self.spec.compute.launch_timeout
        body = Colocation(target=target, launch_id=self.launch_id or "", kind=kind, bundle=bundle, init=init,
                          sources=sources, drop=drop, if_missing=if_missing).encode()

        def one(ep: Any) -> list[Any]:
            return self.client.deploy(ep.url, body, timeout + 30)

        outcomes = [o for outs in _pool.map(one, self.endpoints) for o in outs]
        failures, values = _split(outcomes)
        if failures:
            what = "removing" if drop else "colocating"
            raise _to_error(failures, values, f"{what} {target!r} on {self.name!r} failed", DeployError)
        if drop:
            self.colocated.pop(target, None)
        else:
            self.colocated[target] = (kind, bundle or b"", sources, init)

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

    def submit(self, method: str | None, parts: list[Any], options: CallOptions, future: Any,
               per_rank: dict[str, Any] | None = None) -> Any:
        """Queue one call; ``future`` (a :class:`kt.Future`) gets its values in rank order.

        Submitted calls leave in the order they were submitted, at most
        ``spec.concurrency`` at a time (one for a distributed deployment: the ranks run its
        calls one by one, and a queue here keeps them in submission order)."""
        with self._queue_lock:
            if self._closed:
                raise NotDeployedError(f"deployment {self.name!r} was torn down; call .to() again")
            if self._queue is None:
                self._queue = concurrent.futures.ThreadPoolExecutor(
                    max(1, self.spec.concurrency), thread_name_prefix=f"ktlite-{self.name}")
            self._queued.add(future)
            self._queue.submit(self._run_submitted, method, parts, options, future, per_rank)
        return future

    def _run_submitted(self, method: str | None, parts: list[Any], options: CallOptions, future: Any,
                       per_rank: dict[str, Any] | None) -> None:
        try:
            if future.done() or not future.set_running_or_notify_cancel():
                return  # cancelled while queued (or failed by close()): never sent
            future._stop = lambda call_id, why: self._cancel_all(call_id, why, self.endpoints)

            def sending(call_id: str) -> None:
                future.call_id = call_id
                if future.cancel_requested:
                    raise _CancelledBeforeSend()
            try:
                values = self.call(method, parts, options, on_send=sending, per_rank=per_rank)
            except _CancelledBeforeSend:
                future._end_cancelled()
            except BaseException as e:  # noqa: BLE001 - the future carries every failure
                if future.cancel_requested and isinstance(e, (CallCancelled, RemoteError)):
                    future._end_cancelled()
                else:
                    future.set_exception(e)
            else:
                future.set_result(values[0] if future.single else values)
        finally:
            with self._queue_lock:
                self._queued.discard(future)

    def call(self, method: str | None, parts: list[Any], options: CallOptions,
             log: Any = None, on_send: Any = None, per_rank: dict[str, Any] | None = None) -> list[Any]:
        """Run one call on every rank (or the chosen workers); values in rank order.
        ``log(rank, pod, stream, text)`` prints streamed lines (default ``[rank R @ pod]``).

        Pods the backend replaced (a deleted pod came back with a new IP, a container
        restarted: either has none of our code) are noticed before the call when an earlier
        call lost a pod, or while the coordinator waits for its quorum: the code is pushed to
        the new pods and the call runs, as long as no rank had started it."""
        eps = self.endpoints
        if options.workers is not None:
            options = replace(options, workers=self._pick_workers(options.workers))
        if self.spec.distributed.engine:
            options = self._on_head(options, per_rank)
        if options.workers is not None:
            bad = [w for w in options.workers if not isinstance(w, int) or isinstance(w, bool)
                   or not 0 <= w < len(eps)]
            if bad or not options.workers:
                raise ConfigError(f"workers={options.workers!r}: give pod indices between 0 and {len(eps) - 1}")
        if options.ranks is not None:
            d = self.spec.distributed
            bad = [r for r in options.ranks if not isinstance(r, int) or isinstance(r, bool)
                   or not 0 <= r < d.world_size]
            if bad or not options.ranks:
                raise ConfigError(f"ranks={options.ranks!r}: give ranks between 0 and {d.world_size - 1}")
        if self._suspect:
            self._heal("an earlier call lost a pod")
        try:
            return self._call_once(parts, options, log, on_send, per_rank)
        except _NotStarted as e:
            if not self._heal(e.why):
                raise e.error from None
        return self._call_once(parts, options, log, on_send, per_rank)

    def _pick_workers(self, workers: Any) -> list[int]:
        """Kubetorch's ``workers=`` forms as pod indices: ``"any"`` (the coordinator pod),
        ``"ready"`` (the pods that answer /health now), an IP or a piece of one, or a list of
        indices and IPs."""
        eps = self.endpoints
        if workers == "any":
            return [0]
        if workers == "ready":
            def answers(ep: Any) -> bool:
                try:
                    self.client.health(ep.url, timeout=2.0)
                    return True
                except KtliteError:
                    return False
            ready = [ep.ordinal for ep, ok in zip(eps, list(_pool.map(answers, eps)), strict=True) if ok]
            if not ready:
                raise PodUnreachable(f"workers='ready': no pod of {self.name!r} answered /health within "
                                     f"2 s ({', '.join(ep.name for ep in eps)}); see `ktlite status "
                                     f"{self.name}` and remote.logs()", delivered=False)
            return ready
        items = [workers] if isinstance(workers, (str, int)) else workers
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"workers={workers!r}: give pod indices, pod IPs, 'any' or 'ready'")
        picked: list[int] = []
        for item in items:
            if isinstance(item, str):
                hits = [ep.ordinal for ep in eps if item == ep.ip] or \
                    [ep.ordinal for ep in eps if item in ep.ip]
                if not hits:
                    raise ConfigError(f"workers={workers!r}: no pod of {self.name!r} has an IP matching "
                                      f"{item!r}; its pods: {', '.join(f'{ep.ordinal}={ep.ip}' for ep in eps)}")
                picked += hits
            else:
                picked.append(item)
        return picked

    def _on_head(self, options: CallOptions, per_rank: dict[str, Any] | None) -> CallOptions:
        """A Ray or Monarch deployment's call runs on pod 0 (rank 0) only: the function is the
        driver (controller) and fans out through the engine itself."""
        if per_rank is not None or options.workers not in (None, [0]) or options.ranks not in (None, [0]):
            how = ("a Ray cluster: a call runs once, on the head pod, and reaches the worker nodes through "
                   "Ray (ray.remote tasks and actors)" if self.spec.distributed.framework == "ray" else
                   "a Monarch mesh: a call runs once, on pod 0 (the controller), and reaches every pod "
                   "through Monarch (ktlite.distributed.monarch_procs() and actors)")
            raise ConfigError(f"{self.name!r} is {how}; per-rank data, workers= and ranks= do not apply")
        return replace(options, ranks=[0], workers=None)

    def _call_once(self, parts: list[Any], options: CallOptions, log: Any, on_send: Any = None,
                   per_rank: dict[str, Any] | None = None) -> list[Any]:
        eps = self.endpoints
        d = self.spec.distributed
        stream = self.spec.compute.stream_logs if options.stream_logs is None else options.stream_logs
        call_id = uuid.uuid4().hex
        if on_send is not None:
            on_send(call_id)
        meta = {"id": call_id, "launch_id": self.launch_id,
                "pods": [ep.peer_url for ep in eps], "names": [ep.name for ep in eps],
                "workers": sorted(set(options.workers)) if options.workers is not None else None,
                "timeout": options.timeout if options.timeout is not None else self.spec.compute.call_timeout,
                "stream_logs": stream, "restart": options.restart_procs,
                "fanout": True, "quorum_timeout": d.quorum_timeout,
                "num_proc": d.num_proc if d.uniform else list(d.sizes)}
        if per_rank is not None:
            meta["per_rank"] = per_rank  # where each rank's items are in the body
        if options.ranks is not None:  # only these ranks run it, so only their pods take part
            ranks = sorted(set(options.ranks))
            pods = sorted({d.ordinal_of(r) for r in ranks} & set(meta["workers"] or range(len(eps))))
            if not pods:
                raise ConfigError(f"ranks={options.ranks!r} are on none of workers={options.workers!r}")
            meta["ranks"], meta["workers"] = ranks, pods
        watch = _ReplacedWatch(self, call_id)
        with shm_arguments(self.applied, meta, parts) as sent:
            reply = self._send(call_id, meta, sent, (log or print_log) if stream else None, watch)
        failures, values = _split(reply.outcomes)
        if failures:
            if any(f.kind in (Status.DIED, Status.UNREACHABLE, Status.STALE) for f in failures):
                self._suspect = True  # the next call first checks for replaced pods
            error = _to_error(failures, values, f"call to {self.name!r}", RemoteError)
            if not reply.started:  # no rank ran it: if its pods were replaced, it can go again
                missing = {self._ordinal_of(f.pod) for f in failures if f.kind in (Status.UNREACHABLE, Status.STALE)}
                gone = watch.replaced or self._replaced(sorted(missing - {-1}))
                if gone:
                    raise _NotStarted(error, f"the coordinator could not reach {', '.join(gone)}")
            lost = {self._ordinal_of(f.pod) for f in failures if f.kind in (Status.DIED, Status.UNREACHABLE)} - {-1}
            if lost and reply.started and isinstance(error, RemoteError):
                changed = self._membership_changed(sorted(lost), error, failures)
                if changed is not None:
                    raise changed from error
            raise error
        self._suspect = False
        return [values[r] for r in sorted(values)]

    def _send(self, call_id: str, meta: dict[str, Any], parts: list[Any], log: Any,
              watch: _ReplacedWatch) -> CallReply:
        """The call through the coordinator (pod 0), with its transport failures explained."""
        eps = self.endpoints
        try:
            return self.client.call(eps[0].url, meta, parts, log, watch, pod=eps[0].name)
        except NotDeployedError as e:
            # the coordinator answered 409 before anything ran: it lost our code (a new pod, a
            # restarted container) or runs another launch
            gone = self._replaced([0])
            if gone:
                raise _NotStarted(e, f"{gone[0]} had none of our code") from e
            raise
        except PodUnreachable as e:
            self._suspect = True
            # the coordinator cannot stop the other pods' ranks now: ask them directly
            self._cancel_all(call_id, "the coordinator pod stopped answering", eps[1:])
            current = self.backend.lookup(self.name)
            if current is None or current.token != self.applied.token:
                raise NotDeployedError(f"deployment {self.name!r} was torn down or replaced; "
                                       "call .to(compute) again") from e
            if not e.delivered and self._replaced([0], current):
                raise _NotStarted(e, f"the proxy could not reach {eps[0].name}") from e
            if self._replaced([0], current):
                raise self._membership_error([eps[0].name], current, str(e)) from e
            raise PodUnreachable(f"{e}; the other pods were told to stop the call. "
                                 f"{self._pod_state(0, current)}", delivered=e.delivered) from e
        except KeyboardInterrupt:
            # stop the ranks everywhere before giving control back; the deployment stays usable
            self._cancel_all(call_id, "the caller pressed Ctrl-C", [*eps[1:], eps[0]])
            raise

    # ---- replaced pods -----------------------------------------------------------------

    def _ordinal_of(self, pod: str) -> int:
        return next((ep.ordinal for ep in self.endpoints if ep.name == pod), -1)

    def _replaced(self, ordinals: list[int], current: Applied | None = None) -> list[str]:
        """Names of the pods among ``ordinals`` that the backend replaced since we pushed code."""
        if not ordinals:
            return []
        current = current or self.backend.lookup(self.name)
        if current is None:
            return []
        now = {ep.ordinal: ep.incarnation for ep in current.endpoints}
        return [ep.name for ep in self.endpoints
                if ep.ordinal in ordinals and ep.incarnation and now.get(ep.ordinal) != ep.incarnation]

    def _ips(self, applied: Applied | None) -> list[str]:
        """Each pod's address by ordinal: its IP, or host:port where pods share one host."""
        if applied is None:
            return []
        eps = sorted(applied.endpoints, key=lambda ep: ep.ordinal)
        return [urlsplit(ep.peer_url).netloc if applied.same_host else ep.ip for ep in eps]

    def _membership_changed(self, ordinals: list[int], error: RemoteError,
                            failures: list[RankFailure]) -> WorkerMembershipChanged | None:
        """The call's error as :class:`WorkerMembershipChanged` when pods among ``ordinals``
        were lost or replaced (not merely a rank process that died on a pod that lives on)."""
        try:
            current = self.backend.lookup(self.name)
            gone = self._replaced(ordinals, current) if current is not None else \
                [ep.name for ep in self.endpoints if ep.ordinal in ordinals]
        except Exception:  # noqa: BLE001 - the call's own error is what matters then
            return None
        if not gone:
            return None
        return self._membership_error(gone, current, str(error), failures, error.outcomes)

    def _membership_error(self, gone: list[str], current: Applied | None, detail: str,
                          failures: list[RankFailure] | None = None,
                          outcomes: dict[int, Any] | None = None) -> WorkerMembershipChanged:
        self._suspect = True  # the next call waits for the replacements and pushes the code
        return WorkerMembershipChanged(
            f"pod(s) {', '.join(gone)} of {self.name!r} were lost or replaced during the call; the "
            f"next call runs on their replacements (the code is pushed again"
            f"{', class instances are created anew' if self.spec.kind == 'cls' else ''}).\n{detail}",
            failures, outcomes, previous_ips=self._ips(self.applied), current_ips=self._ips(current))

    def _pod_state(self, ordinal: int, current: Applied) -> str:
        ep = self.endpoints[ordinal]
        now = next((c for c in current.endpoints if c.ordinal == ordinal), None)
        if now is None:
            return f"Pod {ep.name} is gone or not running; the next call waits for its replacement."
        if ep.incarnation and now.incarnation != ep.incarnation:
            return (f"Pod {ep.name} was replaced (now at {now.ip}); the next call pushes the code to "
                    "it.")
        return f"Pod {ep.name} still runs at {ep.ip}: it may be overloaded; see remote.logs()."

    def _heal(self, why: str) -> bool:
        """If the backend replaced pods since the code was pushed, wait for them and push the
        code again; False when nothing was replaced. Raises NotDeployedError when the
        deployment was torn down or re-created by someone else."""
        current = self.backend.lookup(self.name)
        if current is None or current.token != self.applied.token:
            raise NotDeployedError(f"deployment {self.name!r} was torn down or re-created; call "
                                   ".to(compute) again")
        if current.spec_hash and self.applied.spec_hash and current.spec_hash != self.applied.spec_hash:
            raise NotDeployedError(f"deployment {self.name!r} was redeployed with another Compute (by "
                                   "another process?); call .to(compute) again")
        gone = self._replaced([ep.ordinal for ep in self.endpoints], current)
        if not gone:
            self._suspect = False
            return False
        if self._code is None:
            raise NotDeployedError(f"pod(s) {', '.join(gone)} of {self.name!r} were replaced; call "
                                   ".to(compute) again")
        kind = " (class instances are created anew on every pod)" if self.spec.kind == "cls" else ""
        logger.warning("%s: pod(s) %s were replaced (%s); waiting for them and pushing the code again%s", self.name, ", ".join(gone), why, kind)
        applied = self.backend.apply(self.spec, self.applied.token)
        self.applied = applied
        self.push(*self._code)
        self._suspect = False
        return True

    def _cancel_all(self, call_id: str, reason: str, eps: list[Any]) -> None:
        """Best effort, all at once, briefly: a hung pod must not delay the others."""
        futures = [_pool.submit(self.client.cancel, ep.url, call_id, reason, 1.5) for ep in eps]
        concurrent.futures.wait(futures, timeout=2.0)

    def restart_failed(self) -> dict[str, Any]:
        """Restart the dead rank processes on every pod (only those); pod 0 last, so the
        process group is re-formed at the next call."""
        timeout = self.spec.compute.launch_timeout + 30
        eps = self.endpoints
        futures = [_pool.submit(self.client.restart_failed, ep.url, timeout) for ep in eps[1:]]
        answers = [f.result() for f in futures]
        # pod 0 moves the deployment to a new process-group generation when a rank restarted
        answers.insert(0, self.client.restart_failed(eps[0].url, timeout,
                                                     regroup=any(a["restarted"] for a in answers)))
        restarted = sorted(r for a in answers for r in a["restarted"])
        return {"restarted": restarted, "failed": [f for a in answers for f in a["failed"]],
                "pods": answers}

    def status(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        # all pods at once: each may take a moment to measure its ranks' CPU
        futures = [_pool.submit(self.client.status, ep.url, stuck_after) for ep in self.endpoints]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Fail the submitted calls that have not started, then drop the connections."""
        self.fail_queued()
        self.client.close()

    def fail_queued(self) -> None:
        """No more submitted calls: those not started yet fail with NotDeployedError."""
        with self._queue_lock:
            self._closed = True
            waiting = [f for f in self._queued if not f.running() and not f.done()]
            queue, self._queue = self._queue, None
        for future in waiting:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(NotDeployedError(
                    f"deployment {self.name!r} was torn down before this submitted call started"))
        if queue is not None:
            queue.shutdown(wait=False, cancel_futures=True)


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
    engines.check_client(spec)
    backend = get_backend(spec.compute.backend, spec.compute.namespace, spec.compute.kubeconfig_path)
    existing = backend.lookup(spec.name)
    token = existing.token if existing is not None else secrets.token_urlsafe(32)
    if spec.autoscale is not None and require(backend, Serving).autoscaler(spec) == "client" and existing is not None:
        # a redeploy keeps the replicas that run (within the bounds); the autoscaler goes on
        a = spec.autoscale
        spec = replace(spec, replicas=min(max(len(existing.endpoints), a.initial),
                                          a.max_scale or len(existing.endpoints) or 1))
    logger.info("%s: asking the %s backend for the pods", spec.name, backend.name)
    applied = backend.apply(spec, token)
    dep = _deployment(spec, backend, applied)
    try:
        dep.push(bundle, sources, init, restart)
        logger.info("%s: launch %s ready on %d pod(s)", spec.name, dep.launch_id, len(applied.endpoints))
    except BaseException as e:
        dep.close()
        if isinstance(e, Exception) and (traits(backend.name).pods_outlive_caller or spec.detached):
            # the pods are fine, the code is not: they stay warm for the next .to()
            e.add_note(f"the pods of {spec.name!r} keep running, so the next .to() reuses them; "
                       f"`ktlite teardown {spec.name}` removes them")
        raise
    scaling = optional(backend, ClientScaling)
    if spec.autoscale is not None and spec.detached and scaling is not None:
        scaling.supervise(spec.name)  # scales it once this process is gone
    return dep


def attach(spec: DeploymentSpec) -> Deployment:
    """The running deployment for ``spec.name``, without deploying."""
    backend = get_backend(spec.compute.backend, spec.compute.namespace, spec.compute.kubeconfig_path)
    applied = backend.lookup(spec.name)
    if applied is None:
        raise NotDeployedError(f"deployment {spec.name!r} is not running on backend {backend.name!r}; "
                               "deploy it with .to(compute) or `ktlite deploy`")
    dep = _deployment(spec, backend, applied)
    if spec.autoscale is not None:
        dep.adopt()  # type: ignore[attr-defined]
    return dep


def _deployment(spec: DeploymentSpec, backend: Backend, applied: Applied) -> Deployment:
    if spec.autoscale is None:
        return Deployment(spec, backend, applied)
    from ktlite.serving import ServingDeployment
    return ServingDeployment(spec, backend, applied)


# ---- outcomes → values / errors ------------------------------------------------------------

# a failed rank's kind -> the error that reports it ("error" keeps the rank's own exception)
_KIND_ERRORS: dict[str, type[RemoteError]] = {
    Status.DIED: RankDied, Status.UNREACHABLE: QuorumTimeout, Status.TIMEOUT: CallTimeout,
    Status.CANCELLED: CallCancelled}

def _split(outcomes: list[RankOutcome]) -> tuple[list[RankFailure], dict[int, Any]]:
    failures: list[RankFailure] = []
    values: dict[int, Any] = {}
    # values handed over in shared-memory files: take every one first, so none is left behind
    outcomes = [o._replace(data=shm.take(o.data.path, o.data.size)) if isinstance(o.data, ShmRef) else o
                for o in outcomes]
    for rank, pod, status, data, message, at in sorted(outcomes, key=lambda o: o.rank):
        if status is Status.OK:
            try:
                values[rank] = codec.loads(data) if data is not None else None
            except Exception as e:  # noqa: BLE001
                failures.append(RankFailure(rank, pod, Status.ERROR, f"its result could not be unpickled here: "
                                            f"{type(e).__name__}: {e}", exception=e, at=at))
        elif status is Status.ERROR:
            info = codec.loads(data)
            exc: BaseException | None = None
            if info.pickled is not None:
                with contextlib.suppress(Exception):
                    exc = codec.loads(info.pickled)
            failures.append(RankFailure(rank, pod, Status.ERROR, f"{info.type_name}: {info.message}",
                                        traceback=info.traceback, exception=exc, at=at))
            if exc is None:
                failures[-1].exception = RemoteException(
                    f"rank {rank} on pod {pod} raised {info.type_name}: {info.message}",
                    type_name=info.type_name, remote_traceback=info.traceback)
        else:
            failure = RankFailure(rank, pod, status, message, at=at)
            # outcomes hold a value or an exception for every rank
            failure.exception = (NotDeployedError(failure.describe()) if status is Status.STALE
                                 else _KIND_ERRORS.get(status, RemoteError)(failure.describe(),
                                                                            failures=[failure]))
            failures.append(failure)
    return failures, values


def _to_error(failures: list[RankFailure], values: dict[int, Any], what: str,
              base: type[Exception]) -> BaseException:
    primary = [f for f in failures if f.kind in (Status.ERROR, Status.DIED, Status.UNREACHABLE, Status.STALE)] or failures
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
    elif primary[0].kind is Status.TIMEOUT:
        lines.append("no rank finished")
    if primary[0].kind is Status.TIMEOUT:
        lines.append("to try: a longer limit (remote.options(timeout=S) or Compute(call_timeout=S)); "
                     "if a rank hangs (a collective some rank never joined), its pod's log "
                     "(remote.logs()) shows how far it got")
    summary = "\n".join(lines)
    first = primary[0]
    if first.kind is Status.ERROR and first.exception is not None:
        if isinstance(first.exception, RemoteException):
            first.exception.failures, first.exception.outcomes = failures, outcomes
            first.exception.args = (first.exception.args[0] + "\n" + summary,)
            return first.exception
        return with_remote_context(first.exception, failures, outcomes, summary)
    if base is DeployError:
        return DeployError(summary)
    if first.kind is Status.STALE:
        return NotDeployedError(summary)
    return _KIND_ERRORS.get(first.kind, RemoteError)(summary, failures=failures, outcomes=outcomes)
