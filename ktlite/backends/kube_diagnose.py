"""Pure: why a pod is not ready, read from its status, and a one-line progress summary.

A problem is *fatal* when waiting longer cannot help (the deploy stops at once with the
reason); otherwise it is the last reason reported if ``launch_timeout`` runs out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ktlite.backends.kube_manifests import SETUP_FAILED_EXIT

_PULL_ERRORS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull")
_CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")


@dataclass(frozen=True)
class PodProblem:
    pod: str
    message: str
    fatal: bool
    want_logs: bool = False  # the container ran: its log says why it stopped
    fix: str = ""
    # what kind of problem (the error class the deploy raises): "image_pull", "unschedulable",
    # "secret", "config", "oom", "evicted", "failed", "setup", "crash", or "" (still waiting)
    kind: str = ""
    reason: str = ""  # Kubernetes' own reason word, e.g. "OOMKilled", "Evicted"


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def _terminated(cs: dict[str, Any]) -> dict[str, Any] | None:
    """How the container last ended, unless it is running again (then it recovered)."""
    state = cs.get("state") or {}
    if "running" in state:
        return None
    term: dict[str, Any] | None = state.get("terminated") or (cs.get("lastState") or {}).get(
        "terminated"
    )
    return term


def _waits_for_volumes(message: str) -> bool:
    """The scheduler holds the pod until its claims bind (or exist)."""
    return "unbound immediate PersistentVolumeClaims" in message or (
        "persistentvolumeclaim" in message and "not found" in message
    )


def diagnose(
    pod: dict[str, Any],
    scaling_up: Callable[[dict[str, Any]], bool] = lambda p: False,
    claims: Callable[[dict[str, Any]], str | None] = lambda p: None,
) -> PodProblem | None:
    """The reason ``pod`` is not (yet) ready, or None if it is on its way. ``claims(pod)``
    says why a claim the pod mounts cannot bind (None: it may still bind)."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        reason = status.get("reason", "")
        return PodProblem(
            name,
            f"the pod failed: {reason} {status.get('message', '')}".rstrip(),
            fatal=True,
            want_logs=True,
            kind="evicted" if reason == "Evicted" else "failed",
            reason=reason or "Failed",
        )
    scheduled = _condition(status, "PodScheduled")
    if (
        scheduled
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
    ):
        message = f"Unschedulable: {scheduled.get('message', 'no node fits')}"
        if _waits_for_volumes(message):
            # binding takes a moment (a provisioner makes the volume): wait, unless it cannot
            why = claims(pod)
            if why is None:
                return PodProblem(name, "waiting for its volume(s) to be bound", fatal=False)
            return PodProblem(
                name,
                f"its volume cannot be bound: {why}",
                fatal=True,
                kind="unschedulable",
                reason="Unschedulable",
                fix="check the Volume's storage_class and access_mode against "
                "`kubectl get storageclass`, or create the PersistentVolumeClaim",
            )
        if scaling_up(pod):
            return PodProblem(
                name, message + " (the cluster autoscaler is adding a node)", fatal=False
            )
        return PodProblem(
            name,
            message,
            fatal=True,
            kind="unschedulable",
            reason="Unschedulable",
            fix="lower cpus/memory/gpus, fix node_selector/gpu_type/tolerations, or add nodes",
        )
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        detail = waiting.get("message", "")
        term = _terminated(cs)
        if reason in _PULL_ERRORS:
            return PodProblem(
                name,
                f"{reason}: image {cs.get('image')!r} cannot be pulled: {detail}",
                fatal=True,
                kind="image_pull",
                reason=reason,
                fix="check the image name and tag; for an image loaded into the "
                "cluster (kind load, minikube image load) use image_pull_policy='IfNotPresent' "
                "or 'Never'; for a private registry add imagePullSecrets to the "
                "service account",
            )
        if reason in _CONFIG_ERRORS:
            secret = "secret" in detail.lower() and "not found" in detail.lower()
            return PodProblem(
                name,
                f"{reason}: {detail}",
                fatal=True,
                reason=reason,
                kind="secret" if secret else "config",
                fix="check that the Secrets, ConfigMaps and volumes the pod names exist",
            )
        if term is not None and term.get("reason") == "OOMKilled":
            return PodProblem(
                name,
                "OOMKilled: the container ran out of memory while starting "
                f"(exit code {term.get('exitCode')})",
                fatal=True,
                want_logs=True,
                kind="oom",
                reason="OOMKilled",
                fix="raise memory (and memory_limit)",
            )
        if term is not None and term.get("exitCode") == SETUP_FAILED_EXIT:
            return PodProblem(
                name,
                "the pod's setup failed (unpacking ktlite, the server's packages, or an image step)",
                fatal=True,
                want_logs=True,
                kind="setup",
                reason="Error",
                fix="fix the failing step; or build an image that already holds ktlite "
                "and the packages (images/Dockerfile), with freeze=True",
            )
        if reason == "CrashLoopBackOff" or (term is not None and term.get("exitCode", 0) != 0):
            code = term.get("exitCode") if term else "?"
            what = (
                "CrashLoopBackOff: the container keeps exiting"
                if reason == "CrashLoopBackOff"
                else "the container exited while starting"
            )
            return PodProblem(
                name,
                f"{what} (last exit code {code}, {cs.get('restartCount', 0)} restart(s))",
                fatal=True,
                want_logs=True,
                kind="crash",
                reason=reason or (term or {}).get("reason", "Error"),
            )
        if reason and reason != "ContainerCreating" and reason != "PodInitializing":
            return PodProblem(name, f"{reason}: {detail}".rstrip(": "), fatal=False)
    if status.get("phase") == "Pending":
        return PodProblem(
            name,
            "Pending: "
            + (
                "scheduled, creating the container"
                if scheduled and scheduled.get("status") == "True"
                else "waiting to be scheduled"
            ),
            fatal=False,
        )
    if status.get("phase") == "Running":
        return PodProblem(
            name,
            "running, waiting for the server to answer /health (image setup steps run first)",
            fatal=False,
        )
    return None


def progress(pods: list[dict[str, Any]], total: int) -> str:
    """``"pods scheduled 2/2, running 1/2, ready 0/2"``."""

    def count(test: Callable[[dict[str, Any]], bool]) -> int:
        return sum(1 for p in pods if test(p.get("status") or {}))

    scheduled = count(lambda s: (_condition(s, "PodScheduled") or {}).get("status") == "True")
    running = count(lambda s: s.get("phase") == "Running")
    ready = count(lambda s: (_condition(s, "Ready") or {}).get("status") == "True")
    return f"pods scheduled {scheduled}/{total}, running {running}/{total}, ready {ready}/{total}"
