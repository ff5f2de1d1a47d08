"""The fixed-pods modes: SPMD fan-out (:class:`Fanout`: every call on every rank, a list by
RANK) and head-only (:class:`HeadOnly`: Ray and Monarch, the call on the head pod, one value).

A call goes to the coordinator (pod 0), which fans it out to the pods with the pod list.
Pods the backend replaced (a deleted pod came back with a new IP, a container restarted:
either has none of our code) are noticed before a call when an earlier call lost a pod, or
while the coordinator waits for its quorum: the code is pushed to the new pods and the call
runs, as long as no rank had started it. No call is retried once a rank may have run it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from ktlite.backends.base import PodEndpoint
from ktlite.errors import (
    ConfigError,
    DeployError,
    KtliteError,
    NotDeployedError,
    PodUnreachable,
    RemoteError,
)
from ktlite.modes import callids, engines, podtable
from ktlite.modes.callpath import CallOptions, CallPlans, pool, print_log, shm_arguments
from ktlite.modes.mode import Mode
from ktlite.modes.outcomes import decode_values, split, to_error
from ktlite.modes.replacement import ReplacedWatch, Replacements
from ktlite.net.client import CallReply, PodClient
from ktlite.specs.deployment_spec import DeploymentSpec
from ktlite_wire import calltree, envelope
from ktlite_wire.launch import Launch
from ktlite_wire.plan import CallPlan
from ktlite_wire.status import Status

logger = logging.getLogger(__name__)

START_MAX = 1 << 20  # a larger call's body is sent by a thread of its own (start_call)
Done = Callable[[list[Any] | None, BaseException | None], None]  # (values, error)


class _NotStarted(Exception):
    """A call no rank started because pods were replaced: safe to send again once healed."""

    def __init__(self, error: BaseException, why: str) -> None:
        super().__init__(why)
        self.error, self.why = error, why


class Fanout(Mode):
    """SPMD: a call runs on every rank (or the ``workers=`` pods, the ``ranks=`` ranks), one
    call at a time in order; its values come back as a list by RANK."""

    def __init__(self, dep: Any) -> None:
        super().__init__(dep)
        self.pods = Replacements(dep)
        self.plans = CallPlans()

    @property
    def single(self) -> bool:  # type: ignore[override]
        return self.dep.spec.pod.distributed is None  # one pod, one rank: its value

    # shorthands for the deployment's parts
    @property
    def spec(self) -> DeploymentSpec:
        return self.dep.spec

    @property
    def name(self) -> str:
        return self.dep.name

    @property
    def endpoints(self) -> list[PodEndpoint]:
        return self.dep.endpoints

    @property
    def client(self) -> PodClient:
        return self.dep.client

    # ---- code --------------------------------------------------------------------------

    def launch_fields(self) -> dict[str, Any]:
        return {
            "pod_ips": [ep.ip for ep in self.endpoints],
            "single": self.spec.pod.distributed is None,
        }

    def load(self, launch: Launch, store: concurrent.futures.Future[Any]) -> None:
        """Send the launch to every pod, each with its ordinal; each restarts or reloads its
        rank processes. Several pods: sent once, to pod 0 (the only pod the caller waits
        for), which relays it to every pod, down the call tree from ``tree_minimum`` pods on."""
        timeout = self.spec.pod.calls.launch_timeout
        eps = self.endpoints
        relay = self.launch_relay(timeout)

        def one(ep: PodEndpoint) -> list[Any]:
            self.dep.wait_healthy(ep.url, timeout)
            msg = replace(
                launch, ordinal=ep.ordinal, store=store.result(), **self.launch_extras(ep)
            )
            if relay is not None:
                return self.client.deploy(ep.url, msg.encode(), timeout + 30, relay=relay)
            return self.client.deploy(ep.url, msg.encode(), timeout + 30)

        outcomes = [o for outs in pool.map(one, eps[:1] if relay else eps) for o in outs]
        failures, values = split(outcomes)
        if failures:
            raise to_error(failures, values, f"deploying {self.name!r} failed", DeployError)

    def launch_extras(self, ep: PodEndpoint) -> dict[str, Any]:
        """What pod ``ep``'s launch carries beyond the shared keys (an engine's settings)."""
        return {}

    def launch_relay(self, timeout: float) -> str | None:
        """The ``x-ktlite-tree`` header of a code push relayed from pod 0 to every pod (down
        the call tree from ``tree_minimum`` pods on, else from pod 0 to each); None: one pod,
        or pods whose launches differ (an engine's)."""
        return podtable.relay(self, timeout)  # the same header as the pod table's

    def cancel_targets(self, eps: list[PodEndpoint]) -> list[PodEndpoint]:
        """In a call tree, pod 0 relays a cancel to every pod: it and its children (they
        relay it on if pod 0 hangs) stand for all of ``eps``; flat, every pod of ``eps``."""
        every = self.endpoints
        fanout = self.spec.distributed.tree(len(every))
        if not fanout:
            return eps
        ordinals = {ep.ordinal for ep in eps}
        heads = [0] + [sub[0] for sub in calltree.split(list(range(1, len(every))), fanout)]
        return [every[i] for i in heads if i in ordinals] or eps

    # ---- calls -------------------------------------------------------------------------

    def head_options(self, options: CallOptions, per_rank: dict[str, Any] | None) -> CallOptions:
        """The call's options as this mode runs them (all of them, in SPMD)."""
        return options

    def call(
        self,
        parts: list[Any],
        options: CallOptions,
        log: Any = None,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run one call on every rank (or the chosen workers); values in rank order (see the
        module docstring for replaced pods)."""
        eps = self.endpoints
        if options.workers is not None:
            options = replace(options, workers=self.pick_workers(options.workers))
        options = self.head_options(options, per_rank)
        if options.workers is not None:
            bad = [
                w
                for w in options.workers
                if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < len(eps)
            ]
            if bad or not options.workers:
                raise ConfigError(
                    f"workers={options.workers!r}: give pod indices between 0 and {len(eps) - 1}"
                )
        if options.ranks is not None:
            d = self.spec.distributed
            bad = [
                r
                for r in options.ranks
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < d.world_size
            ]
            if bad or not options.ranks:
                raise ConfigError(
                    f"ranks={options.ranks!r}: give ranks between 0 and {d.world_size - 1}"
                )
        if self.pods.suspect:
            self.pods.heal("an earlier call lost a pod")
        try:
            return self._call_once(parts, options, log, on_send, per_rank)
        except _NotStarted as e:
            if not self.pods.heal(e.why):
                raise e.error from None
        return self._call_once(parts, options, log, on_send, per_rank)

    def start_call(
        self,
        parts: list[Any],
        options: CallOptions,
        on_send: Any,
        per_rank: dict[str, Any] | None,
        done: Done,
    ) -> bool:
        """:meth:`call`, without a thread waiting on it, for a call to one pod reached
        directly: its answer is read with every other's (``ktlite.net.callmux``) and
        ``done(values, None)`` or ``done(None, error)`` is called once it has come (a failure
        is explained, and a call no rank started sent again, on a thread of ``pool``). False
        when the call must go through :meth:`call`."""
        eps = self.endpoints
        if (
            len(eps) != 1
            or self.pods.suspect
            or options.workers is not None
            or options.ranks is not None
            or envelope.parts_size(parts) > START_MAX
            or not self.client.can_start(eps[0].url)
        ):
            return False
        options = self.head_options(options, per_rank)
        plan, watch, log = self.plan_call(options, None, on_send, per_rank)
        sending = shm_arguments(self.dep.applied, plan, parts)
        sent = sending.__enter__()  # left when the call ends: on the thread that reads it

        def finished(reply: CallReply | None, error: BaseException | None) -> None:
            if reply is not None:
                sent.done(reply)
            sending.__exit__(None, None, None)
            if reply is not None and (blobs := reply.values()) is not None:
                values = decode_values(blobs)  # the usual end: every rank returned a value
                if values is not None:
                    self.pods.suspect = False
                    done(values, None)
                    return
            pool.submit(conclude, reply, error)

        def conclude(reply: CallReply | None, error: BaseException | None) -> None:
            try:
                try:
                    if reply is None:
                        self.failed(error or PodUnreachable("no reply"), plan)
                    values = self.values(reply, watch)
                except _NotStarted as e:
                    if not self.pods.heal(e.why):
                        raise e.error from None
                    values = self._call_once(parts, options, None, on_send, per_rank)
            except BaseException as e:  # noqa: BLE001 - the call's own outcome
                done(None, e)
                return
            done(values, None)

        self.client.start_call(eps[0].url, plan, sent.parts, log, finished, pod=eps[0].name)
        return True

    def pick_workers(self, workers: Any) -> list[int]:
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

            ready = [
                ep.ordinal for ep, ok in zip(eps, list(pool.map(answers, eps)), strict=True) if ok
            ]
            if not ready:
                raise PodUnreachable(
                    f"workers='ready': no pod of {self.name!r} answered /health within "
                    f"2 s ({', '.join(ep.name for ep in eps)}); see `ktlite status "
                    f"{self.name}` and remote.logs()",
                    delivered=False,
                )
            return ready
        items = [workers] if isinstance(workers, (str, int)) else workers
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"workers={workers!r}: give pod indices, pod IPs, 'any' or 'ready'")
        picked: list[int] = []
        for item in items:
            if isinstance(item, str):
                hits = [ep.ordinal for ep in eps if item == ep.ip] or [
                    ep.ordinal for ep in eps if item in ep.ip
                ]
                if not hits:
                    raise ConfigError(
                        f"workers={workers!r}: no pod of {self.name!r} has an IP matching "
                        f"{item!r}; its pods: {', '.join(f'{ep.ordinal}={ep.ip}' for ep in eps)}"
                    )
                picked += hits
            else:
                picked.append(item)
        return picked

    def _call_once(
        self,
        parts: list[Any],
        options: CallOptions,
        log: Any,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> list[Any]:
        plan, watch, log = self.plan_call(options, log, on_send, per_rank)
        with shm_arguments(self.dep.applied, plan, parts) as sent:
            reply = self._send(plan, sent.parts, log, watch)
            sent.done(reply)
        return self.values(reply, watch)

    def plan_call(
        self,
        options: CallOptions,
        log: Any = None,
        on_send: Any = None,
        per_rank: dict[str, Any] | None = None,
    ) -> tuple[CallPlan, ReplacedWatch, Any]:
        """A call's plan, the watch over its notices and where its streamed lines go (None:
        not streamed); ``on_send(call_id)`` runs with its new id."""
        eps = self.endpoints
        d = self.spec.distributed
        workers = sorted(set(options.workers)) if options.workers is not None else None
        ranks = None
        if options.ranks is not None:  # only these ranks run it, so only their pods take part
            ranks = sorted(set(options.ranks))
            workers = sorted({d.ordinal_of(r) for r in ranks} & set(workers or range(len(eps))))
            if not workers:
                raise ConfigError(
                    f"ranks={options.ranks!r} are on none of workers={options.workers!r}"
                )
        call_id = callids.new()  # unique, without a system call that lets go of the GIL
        if on_send is not None:
            on_send(call_id)
        plan = self.plans.plan(
            self.spec,
            self.dep.launch_id,
            eps,
            options,
            call_id=call_id,
            num_proc=d.num_proc if d.uniform else list(d.sizes),
            workers=workers,
            ranks=ranks,
            per_rank=per_rank,  # where each rank's items are in the body
            tree=d.tree(len(eps) if workers is None else len(workers)),
        )
        return (
            plan,
            ReplacedWatch(self.pods, call_id),
            (log or print_log) if plan.stream_logs else None,
        )

    def values(self, reply: CallReply, watch: ReplacedWatch) -> list[Any]:
        """A call's values in rank order, from its reply; its failures as one error
        (``_NotStarted`` when no rank ran it and its pods were replaced)."""
        blobs = reply.values()  # every rank's value, when each returned one: no records
        ok = decode_values(blobs) if blobs is not None else None
        if ok is not None:
            self.pods.suspect = False
            return ok
        failures, values = split(reply.outcomes)
        if failures:
            if any(f.kind in (Status.DIED, Status.UNREACHABLE, Status.STALE) for f in failures):
                self.pods.suspect = True  # the next call first checks for replaced pods
            error = to_error(failures, values, f"call to {self.name!r}", RemoteError)
            if not reply.started:  # no rank ran it: if its pods were replaced, it can go again
                missing = {
                    self.pods.ordinal_of(f.pod)
                    for f in failures
                    if f.kind in (Status.UNREACHABLE, Status.STALE)
                }
                gone = watch.replaced or self.pods.replaced(sorted(missing - {-1}))
                if gone:
                    raise _NotStarted(error, f"the coordinator could not reach {', '.join(gone)}")
            lost = {
                self.pods.ordinal_of(f.pod)
                for f in failures
                if f.kind in (Status.DIED, Status.UNREACHABLE)
            } - {-1}
            if lost and reply.started and isinstance(error, RemoteError):
                changed = self.pods.membership_changed(sorted(lost), error, failures)
                if changed is not None:
                    raise changed from error
            raise error
        self.pods.suspect = False
        return [values[r] for r in sorted(values)]

    def _send(self, plan: CallPlan, parts: list[Any], log: Any, watch: ReplacedWatch) -> CallReply:
        """The call through the coordinator (pod 0), with its transport failures explained."""
        eps, call_id = self.endpoints, plan.id
        try:
            return self.client.call(eps[0].url, plan, parts, log, watch, pod=eps[0].name)
        except (NotDeployedError, PodUnreachable) as e:
            self.failed(e, plan)
        except KeyboardInterrupt:
            # stop the ranks everywhere before giving control back; the deployment stays usable
            self.dep.cancel_all(call_id, "the caller pressed Ctrl-C", [*eps[1:], eps[0]])
            raise

    def failed(self, e: BaseException, plan: CallPlan) -> NoReturn:
        """Raise what the failure ``e`` of sending the call ``plan`` means (see the module
        docstring: ``_NotStarted`` when it can go again once the pods are healed)."""
        eps, call_id = self.endpoints, plan.id
        if isinstance(e, NotDeployedError):
            # the coordinator answered 409 before anything ran: it lost our code (a new pod, a
            # restarted container) or runs another launch
            gone = self.pods.replaced([0])
            if gone:
                raise _NotStarted(e, f"{gone[0]} had none of our code") from e
            raise e
        if isinstance(e, PodUnreachable):
            self.pods.suspect = True
            # the coordinator cannot stop the other pods' ranks now: ask them directly
            self.dep.cancel_all(call_id, "the coordinator pod stopped answering", eps[1:])
            current = self.dep.backend.lookup(self.name)
            if current is None or current.token != self.dep.applied.token:
                raise NotDeployedError(
                    f"deployment {self.name!r} was torn down or replaced; call .to(compute) again"
                ) from e
            if not e.delivered and self.pods.replaced([0], current):
                raise _NotStarted(e, f"the proxy could not reach {eps[0].name}") from e
            if self.pods.replaced([0], current):
                raise self.pods.membership_error([eps[0].name], current, str(e)) from e
            raise PodUnreachable(
                f"{e}; the other pods were told to stop the call. {self.pods.pod_state(0, current)}",
                delivered=e.delivered,
            ) from e
        raise e

    def restart_failed(self) -> dict[str, Any]:
        """Restart the dead rank processes on every pod (only those), asked of pod 0, which
        asks the others (``podtable``); pod 0 last, so the process group is re-formed."""
        return podtable.restart_failed(self)

    def table_relay(self, timeout: float) -> str | None:
        return podtable.relay(self, timeout)

    def status(self, stuck_after: float | None = None) -> list[dict[str, Any]]:
        """Every pod's status, asked of pod 0, which gathers it (``podtable``)."""
        table = podtable.entries(self, stuck_after)
        podtable.raise_errors(table, f"the status of {self.name!r}")
        return table


class HeadOnly(Fanout):
    """Ray and Monarch (``distribute("ray"/"monarch")``): the pods run the engine's own
    runtime, formed by the pod servers by IP; a call runs once, on pod 0 (rank 0), which is
    the driver (controller) and reaches the other pods through the engine. One value."""

    single = True

    @classmethod
    def check(cls, spec: DeploymentSpec) -> None:
        engines.check_client(spec)

    def launch_extras(self, ep: PodEndpoint) -> dict[str, Any]:
        eps = self.endpoints
        return {
            "engine": engines.engine_settings(
                self.spec,
                ep.ordinal,
                [e.ip for e in eps],
                [e.name for e in eps],
                self.dep.applied.master_port,
                self.dep.launch_id,
                [e.peer_url for e in eps],
                self.dep.applied.token,
                self.dep.applied.same_host,
            )
        }

    def launch_relay(self, timeout: float) -> str | None:
        return None  # each pod's launch carries its own engine settings

    def head_options(self, options: CallOptions, per_rank: dict[str, Any] | None) -> CallOptions:
        """A Ray or Monarch deployment's call runs on pod 0 (rank 0) only: the function is the
        driver (controller) and fans out through the engine itself."""
        if (
            per_rank is not None
            or options.workers not in (None, [0])
            or options.ranks not in (None, [0])
        ):
            how = (
                "a Ray cluster: a call runs once, on the head pod, and reaches the worker nodes through "
                "Ray (ray.remote tasks and actors)"
                if self.spec.distributed.framework == "ray"
                else "a Monarch mesh: a call runs once, on pod 0 (the controller), and reaches every pod "
                "through Monarch (ktlite.distributed.monarch_procs() and actors)"
            )
            raise ConfigError(
                f"{self.name!r} is {how}; per-rank data, workers= and ranks= do not apply"
            )
        return replace(options, ranks=[0], workers=None)
