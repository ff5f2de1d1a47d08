"""What the autoscaler of a served deployment (``Compute.autoscale``) says.

Two mixins: :class:`AutoscalerReport` for :class:`ktlite.modes.serving.ReplicaScaler` (the
decision record ``status()["autoscaler"]`` shows and the process that scales writes for
``ktlite status``), and :class:`ServedHandle` for the handles ``kt.fn``/``kt.cls`` return,
whose ``scaling_status()`` asks the autoscaler that decides: the cluster's (an HPA, Knative)
on Kubernetes, ktlite's own on the local backend.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ktlite.backends.capabilities import ClientScaling, optional
from ktlite.errors import NotDeployedError
from ktlite.specs.autoscaling import Scaler


class AutoscalerReport:
    """Mixed into ``ReplicaScaler``: the attributes below are its own."""

    _leading: bool
    _decision: Any
    _scaler: Scaler
    _scale_error: str | None

    # read-only properties of ReplicaScaler's
    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def backend(self) -> Any:
        raise NotImplementedError

    @property
    def spec(self) -> Any:
        raise NotImplementedError

    @property
    def _who(self) -> str:
        raise NotImplementedError

    @property
    def _replicas(self) -> dict[str, Any]:
        raise NotImplementedError

    def _record(self) -> None:
        """Keep the last decision where `ktlite status` (another process) reads it."""
        scaling = optional(self.backend, ClientScaling)
        if scaling is not None and self._decision is not None:
            with contextlib.suppress(OSError):
                scaling.record_scaling(self.name, self.autoscaler_info())

    def autoscaler_info(self) -> dict[str, Any]:
        a = self.spec.autoscale
        info: dict[str, Any] = {
            "autoscaler": "ktlite (in this process)" if self._who == "client" else self._who,
            "min": a.min,
            "max": a.max_scale if a.max_scale is not None else self._scaler.max,
            "metric": a.metric_name,
            "target_per_replica": a.target_per_replica,
            "concurrency": self.spec.concurrency,
            "window_s": a.window_s,
            "scale_down_delay_s": a.scale_down_delay_s,
            "retention_s": a.retention_s,
            "desired": self._decision.desired if self._decision else len(self._replicas),
            "last_decision": self._decision.as_dict() if self._decision else None,
            "error": self._scale_error,
        }
        if self._decision is not None:
            ago = time.monotonic() - self._decision.at
            info["last_decision"]["wall_time"] = time.time() - ago
        if self._who != "client":
            with contextlib.suppress(Exception):
                info["cluster"] = self.backend.scaling_status(self.name)
                # what the cluster scales on (CPU where the metric asked for needs an adapter)
                if (info["cluster"] or {}).get("metric"):
                    info["metric"] = info["cluster"]["metric"]
        return info

    def scaling_status(self) -> dict[str, Any]:
        """See :meth:`ServedHandle.scaling_status`."""
        if self._who != "client":
            said: dict[str, Any] | None = self.backend.scaling_status(self.name)
            if said is None:
                raise NotDeployedError(
                    f"served deployment {self.name!r} has no {self._who} autoscaler in the cluster "
                    "any more (torn down?); call .to() again"
                )
            return said
        current = len([r for r in self._replicas.values() if not r.draining])
        recorded = None if self._leading else self.backend.scaling_status(self.name)
        if recorded is not None and recorded.get("alive"):
            # another process scales this deployment: its last decision, as it recorded it
            return {**recorded, "current": current}
        return {**self.autoscaler_info(), "current": current}


class ServedHandle:
    """Mixed into the handles of ``kt.fn``/``kt.cls`` (``ktlite.api.remote``)."""

    deployment: Any

    def scaling_status(self) -> dict[str, Any]:
        """What the autoscaler of this served deployment (``Compute.autoscale``) says now.

        On Kubernetes, the cluster's autoscaler: for the HorizontalPodAutoscaler ``current``
        and ``desired`` replicas, ``min``/``max``, ``last_scale_time``, its ``conditions``
        (type, status, reason, message; e.g. ``FailedGetResourceMetric`` without
        metrics-server) and ``metric`` (``name``, ``target``, ``current``, and ``instead_of``
        where it scales on CPU in place of the metric asked for); for Knative the Service's
        conditions, its revisions and the PodAutoscaler's scale. On the local backend,
        ktlite's own autoscaler (in this process, or the process that scales it): ``current``,
        ``desired``, ``min``/``max``, ``metric``, ``target_per_replica`` and ``last_decision``
        with its ``reason``.

        Example:
            said = model.scaling_status()
            print(said["current"], "->", said["desired"], said["metric"])
        """
        said: dict[str, Any] = self.deployment.mode.scaling_status()
        return said
