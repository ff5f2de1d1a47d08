"""Pods as the fake API server's scheduler and kubelet play them: ``PodState`` builders
(``pending()``, ``ready()``, ``crash_loop()``...) that give a pod's ``status`` as a real cluster
reports it, with its events and log text, and a pod's script (``PodScript``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kube_fake_api import (
    _UNSCHEDULABLE,
    Obj,
    _normalize_image,
    _qos,
    _sha,
)


@dataclass(frozen=True)
class PodCtx:
    """What a status builder knows about the pod it describes (timestamps are RFC 3339)."""

    pod: Obj
    ip: str
    node: str
    host_ip: str
    created: str
    since: str  # when the current script step began

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def containers(self) -> list[tuple[str, str]]:
        return [(c["name"], c.get("image", "")) for c in self.pod["spec"]["containers"]]

    def container_id(self, container: str, attempt: int = 0) -> str:
        return "containerd://" + _sha(f"{self.uid}/{container}/{attempt}")


def _no_events(ctx: PodCtx) -> list[tuple[str, str, str]]:
    return []


@dataclass(frozen=True)
class PodState:
    """One step of a pod's life: its status, the events and log text it brings."""

    status: Callable[[PodCtx], Obj]
    events: Callable[[PodCtx], list[tuple[str, str, str]]] = _no_events  # (type, reason, msg)
    logs: str | None = None  # current container's log text, set when the step begins
    previous_logs: str | None = None  # previous (crashed) container's log text
    ip: str | None = None  # pod IP to report instead of an allocated one
    # the runtime has removed the previous container (garbage-collected, log rotated away):
    # the kubelet answers a request for its log with HTTP 200 and a line of its own
    previous_log_lost: bool = False


PodScript = PodState | Sequence[tuple[float, PodState]] | None
PodBehavior = Callable[[Obj], PodScript]


def _cond(kind: str, ok: bool, at: str, reason: str | None = None, msg: str | None = None) -> Obj:
    out: Obj = {
        "type": kind,
        "status": "True" if ok else "False",
        "lastProbeTime": None,
        "lastTransitionTime": at,
    }
    return {**out, **({"reason": reason} if reason else {}), **({"message": msg} if msg else {})}


def _conditions(
    ctx: PodCtx, *, sandbox: bool, ready: bool, reason: str = "ContainersNotReady"
) -> list[Obj]:
    names = " ".join(n for n, _ in ctx.containers)
    msg = (
        None
        if ready or reason != "ContainersNotReady"
        else f"containers with unready status: [{names}]"
    )
    return [
        _cond("PodReadyToStartContainers", sandbox, ctx.since),
        _cond("Initialized", True, ctx.created),
        _cond("Ready", ready, ctx.since, None if ready else reason, msg),
        _cond("ContainersReady", ready, ctx.since, None if ready else reason, msg),
        _cond("PodScheduled", True, ctx.created),
    ]


def _pod_status(
    ctx: PodCtx, phase: str, conditions: list[Obj], containers: list[Obj], ip: bool = True
) -> Obj:
    status: Obj = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": ctx.host_ip,
        "hostIPs": [{"ip": ctx.host_ip}],
        "startTime": ctx.created,
        "containerStatuses": containers,
        "qosClass": _qos(ctx.pod["spec"]),
    }
    return {**status, **({"podIP": ctx.ip, "podIPs": [{"ip": ctx.ip}]} if ip else {})}


def _containers(
    ctx: PodCtx,
    state: Callable[[str, str], Obj],
    *,
    pulled: bool = True,
    ready: bool = False,
    restarts: int = 0,
    last: Callable[[str], Obj] | None = None,
) -> list[Obj]:
    out = []
    for name, image in ctx.containers:
        st = state(name, image)
        norm = _normalize_image(image)
        item: Obj = {
            "name": name,
            "image": norm if pulled else image,
            "imageID": f"{norm.rsplit(':', 1)[0]}@sha256:{_sha(norm)}" if pulled else "",
            "ready": ready,
            "restartCount": restarts,
            "started": "running" in st,
            "state": st,
            "lastState": last(name) if last else {},
        }
        if pulled and ("running" in st or "terminated" in st):
            item["containerID"] = st.get("terminated", {}).get("containerID") or ctx.container_id(
                name, restarts
            )
        elif "terminated" in item["lastState"]:
            item["containerID"] = item["lastState"]["terminated"]["containerID"]
        out.append(item)
    return out


def _terminated(ctx: PodCtx, name: str, code: int, reason: str, attempt: int) -> Obj:
    return {
        "exitCode": code,
        "reason": reason,
        "startedAt": ctx.created,
        "finishedAt": ctx.since,
        "containerID": ctx.container_id(name, attempt),
    }


def _started_events(ctx: PodCtx) -> list[tuple[str, str, str]]:
    return [
        e
        for n, img in ctx.containers
        for e in (
            ("Normal", "Pulled", f'Container image "{img}" already present on machine'),
            ("Normal", "Created", f"Created container {n}"),
            ("Normal", "Started", f"Started container {n}"),
        )
    ]


def pending() -> PodState:
    """Accepted but not yet scheduled (what every pod starts as)."""
    return PodState(lambda ctx: {"phase": "Pending", "qosClass": _qos(ctx.pod["spec"])})


def unschedulable(message: str = _UNSCHEDULABLE) -> PodState:
    def status(ctx: PodCtx) -> Obj:
        return {
            "phase": "Pending",
            "qosClass": _qos(ctx.pod["spec"]),
            "conditions": [_cond("PodScheduled", False, ctx.since, "Unschedulable", message)],
        }

    return PodState(status, lambda ctx: [("Warning", "FailedScheduling", message)])


def container_creating() -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=False, ready=False),
            _containers(
                ctx, lambda n, i: {"waiting": {"reason": "ContainerCreating"}}, pulled=False
            ),
            ip=False,
        )
    )


def ready(ip: str | None = None) -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=True),
            _containers(ctx, lambda n, i: {"running": {"startedAt": ctx.since}}, ready=True),
        ),
        _started_events,
        ip=ip,
    )


def running_not_ready(ip: str | None = None) -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(ctx, lambda n, i: {"running": {"startedAt": ctx.since}}),
        ),
        _started_events,
        ip=ip,
    )


def _pull_error(image: str) -> str:
    ref = _normalize_image(image)
    return (
        f'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": '
        f'failed to resolve reference "{ref}": {ref}: not found'
    )


def _pull_failure(reason: str, image: str | None, message: str | None) -> PodState:
    backoff = reason == "ImagePullBackOff"

    def text(img: str) -> str:
        return message or (
            f'Back-off pulling image "{image or img}"' if backoff else _pull_error(image or img)
        )

    def events(ctx: PodCtx) -> list[tuple[str, str, str]]:
        out = []
        for _, img in ctx.containers:
            img = image or img
            err = message if message and not backoff else _pull_error(img)
            out += [
                ("Normal", "Pulling", f'Pulling image "{img}"'),
                ("Warning", "Failed", f'Failed to pull image "{img}": {err}'),
                ("Warning", "Failed", "Error: ErrImagePull"),
            ]
            if backoff:
                out += [
                    ("Normal", "BackOff", f'Back-off pulling image "{img}"'),
                    ("Warning", "Failed", "Error: ImagePullBackOff"),
                ]
        return out

    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx, lambda n, i: {"waiting": {"reason": reason, "message": text(i)}}, pulled=False
            ),
        ),
        events,
    )


def image_pull_backoff(image: str | None = None, message: str | None = None) -> PodState:
    """``image`` defaults to each container's own; ``message`` replaces the waiting message."""
    return _pull_failure("ImagePullBackOff", image, message)


def err_image_pull(image: str | None = None, message: str | None = None) -> PodState:
    return _pull_failure("ErrImagePull", image, message)


def _backoff(restarts: int) -> str:
    seconds = min(10 * 2 ** (restarts - 1), 300)
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def crash_loop(
    exit_code: int = 1, logs: str | None = None, restarts: int = 1, reason: str = "Error"
) -> PodState:
    """Restarted ``restarts`` times, now in back-off; ``logs`` is the crashed container's log."""
    restarts = max(1, restarts)

    def status(ctx: PodCtx) -> Obj:
        def waiting(name: str, image: str) -> Obj:
            return {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {_backoff(restarts)} restarting failed container={name} "
                    f"pod={ctx.name}_{ctx.namespace}({ctx.uid})",
                }
            }

        return _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                waiting,
                restarts=restarts,
                last=lambda n: {"terminated": _terminated(ctx, n, exit_code, reason, restarts - 1)},
            ),
        )

    def events(ctx: PodCtx) -> list[tuple[str, str, str]]:
        return _started_events(ctx) + [
            (
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {n} in pod "
                f"{ctx.name}_{ctx.namespace}({ctx.uid})",
            )
            for n, _ in ctx.containers
        ]

    return PodState(status, events, previous_logs=logs)


def terminated_error(
    exit_code: int = 1, logs: str | None = None, reason: str | None = None
) -> PodState:
    """First termination, before any restart; with restartPolicy Never/OnFailure the phase is
    Failed/Succeeded as the kubelet reports it, else Running."""
    why = reason or ("Completed" if exit_code == 0 else "Error")

    def status(ctx: PodCtx) -> Obj:
        policy = ctx.pod["spec"].get("restartPolicy", "Always")
        phase = (
            "Succeeded"
            if exit_code == 0 and policy != "Always"
            else "Failed"
            if exit_code != 0 and policy == "Never"
            else "Running"
        )
        why_not = {"Succeeded": "PodCompleted", "Failed": "PodFailed"}.get(
            phase, "ContainersNotReady"
        )
        return _pod_status(
            ctx,
            phase,
            _conditions(ctx, sandbox=True, ready=False, reason=why_not),
            _containers(ctx, lambda n, i: {"terminated": _terminated(ctx, n, exit_code, why, 0)}),
        )

    return PodState(status, _started_events, logs=logs)


def terminated_again(
    exit_code: int = 1,
    logs: str | None = None,
    restarts: int = 1,
    previous_logs: str | None = None,
    previous_log_lost: bool = False,
) -> PodState:
    """Exited again after ``restarts`` restart(s), before the kubelet reports the back-off:
    ``state`` is this run's end (its log ``logs``), ``lastState`` the run before (its log
    ``previous_logs``, or the kubelet's answer for a lost one: see ``PodState``)."""
    restarts = max(1, restarts)
    why = "Completed" if exit_code == 0 else "Error"

    def status(ctx: PodCtx) -> Obj:
        return _pod_status(
            ctx,
            "Running",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                lambda n, i: {"terminated": _terminated(ctx, n, exit_code, why, restarts)},
                restarts=restarts,
                last=lambda n: {"terminated": _terminated(ctx, n, exit_code, why, restarts - 1)},
            ),
        )

    return PodState(
        status,
        _started_events,
        logs=logs,
        previous_logs=previous_logs,
        previous_log_lost=previous_log_lost,
    )


def oom_killed(logs: str | None = None, restarts: int = 0) -> PodState:
    """Exit 137 OOMKilled: the first kill (``restarts=0``) or in back-off after ``restarts``."""
    return (
        crash_loop(137, logs, restarts, "OOMKilled")
        if restarts
        else terminated_error(137, logs, "OOMKilled")
    )


def create_container_config_error(message: str = 'secret "x" not found') -> PodState:
    return PodState(
        lambda ctx: _pod_status(
            ctx,
            "Pending",
            _conditions(ctx, sandbox=True, ready=False),
            _containers(
                ctx,
                lambda n, i: {
                    "waiting": {"reason": "CreateContainerConfigError", "message": message}
                },
                pulled=False,
            ),
        ),
        lambda ctx: [
            e
            for _, img in ctx.containers
            for e in (
                ("Normal", "Pulled", f'Container image "{img}" already present on machine'),
                ("Warning", "Failed", f"Error: {message}"),
            )
        ],
    )


def _steps(script: PodScript) -> list[tuple[float, PodState]]:
    if script is None:
        return [(0.0, ready())]
    if isinstance(script, PodState):
        return [(0.0, script)]
    return sorted(((float(t), s) for t, s in script), key=lambda step: step[0])


@dataclass
class _PodMeta:
    steps: list[tuple[float, PodState]]
    start: float  # clock time the steps are measured from
    created: float
    ip: str
    node: tuple[str, str]
    step: int = -1
    delete_at: float | None = None
