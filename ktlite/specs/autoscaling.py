"""``Compute.autoscale(...)``: a service behind interchangeable replicas that grow and shrink
with load (Kubetorch's serving mode), and the pure scaling rule the local backend runs.

The names and meanings are Kubetorch's (which are Knative's autoscaling annotations):

- ``concurrency``: the most calls one replica runs at once (Knative's ``containerConcurrency``);
  more wait in the caller's queue for a free replica.
- ``target``: the load per replica the autoscaler aims for (in-flight calls for
  ``metric="concurrency"``, calls per second for ``"rps"``, CPU percent for ``"cpu"``);
  default ``concurrency``, else Knative's 100 (``"rps"``: 200, ``"cpu"``: 80).
- ``target_utilization``: the percentage of ``target`` at which it scales up (default 70).
- ``min_scale`` (default 0: scale to zero), ``max_scale`` (default: no limit; the local
  backend caps it at this machine's CPU count), ``initial_scale`` (default 1): the replicas
  started at deploy, kept at least ``scale_down_delay`` (Kubetorch's examples say
  ``initial_replicas``, ``min_replicas``, ``max_replicas``: the same three).
- ``window`` (default ``"60s"``): the load is averaged over it; a burst above twice what the
  replicas can take scales up at once (Knative's panic mode, over a tenth of the window).
- ``scale_down_delay`` (default ``"1m"``, as Kubetorch sets it): a lower replica count must be
  wanted for this long before replicas stop.
- ``scale_to_zero_pod_retention_period`` (default ``"10m"``, as Kubetorch sets it): the last
  replica stays this long after the last call.
- ``autoscaler_class``, ``progress_deadline`` and extra keywords are Knative's annotations.

Durations are Knative's strings (``"30s"``, ``"1m5s"``, ``"2h"``) or seconds.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ktlite.errors import ConfigError

METRICS = ("concurrency", "rps", "cpu", "memory")
AUTOSCALER_CLASSES = ("kpa.autoscaling.knative.dev", "hpa.autoscaling.knative.dev")
DEFAULT_TARGETS = {"concurrency": 100.0, "rps": 200.0, "cpu": 80.0, "memory": 80.0}
_DURATION = re.compile(r"^(\d+(\.\d+)?[smh])+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([smh])")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(value: Any, name: str, *, zero_ok: bool = True) -> float:
    """A Knative duration (``"30s"``, ``"1m5s"``) or a number of seconds, in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str) and _DURATION.match(value.strip()):
        result = sum(float(n) * _UNITS[u] for n, u in _PART.findall(value.strip()))
    else:
        raise ConfigError(
            f"autoscale({name}={value!r}) must be a duration such as '30s', '1m5s', '2h' "
            "or a number of seconds"
        )
    if not math.isfinite(result) or result < 0 or (result == 0 and not zero_ok):
        raise ConfigError(
            f"autoscale({name}={value!r}) must be a {'non-negative' if zero_ok else 'positive'} "
            "duration"
        )
    return result


def _knative(value: Any) -> str:
    """A duration as Knative's annotations spell it."""
    if isinstance(value, str):
        return value.strip()
    return f"{value:g}s"


@dataclass(frozen=True)
class AutoscaleConfig:
    """A deployment served by replicas that scale with load; see the module docstring."""

    target: float | None = None
    window: str | float | None = None
    metric: str | None = None
    target_utilization: float | None = None
    min_scale: int | None = None
    max_scale: int | None = None
    initial_scale: int | None = None
    concurrency: int | None = None
    scale_to_zero_pod_retention_period: str | float | None = None
    scale_down_delay: str | float | None = None
    autoscaler_class: str | None = None
    progress_deadline: str | float | None = None
    extra: dict[str, str] = field(default_factory=dict)  # more Knative autoscaling annotations

    def __post_init__(self) -> None:
        for name in ("min_scale", "max_scale", "initial_scale", "concurrency"):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if name == "concurrency" else 0)
            ):
                low = 1 if name == "concurrency" else 0
                raise ConfigError(f"autoscale({name}={value!r}) must be a whole number >= {low}")
        if self.concurrency is not None and self.concurrency > 1024:
            raise ConfigError(
                f"autoscale(concurrency={self.concurrency}) is above 1024 calls per replica"
            )
        if self.max_scale is not None and self.max_scale < 1:
            raise ConfigError(
                "autoscale(max_scale=0): a service needs at least one replica under load; "
                "leave max_scale out for no limit"
            )
        if (
            self.min_scale is not None
            and self.max_scale is not None
            and self.min_scale > self.max_scale
        ):
            raise ConfigError(
                f"autoscale(min_scale={self.min_scale}, max_scale={self.max_scale}): min_scale "
                "cannot be above max_scale"
            )
        if self.initial_scale is not None:
            if self.max_scale is not None and self.initial_scale > self.max_scale:
                raise ConfigError(
                    f"autoscale(initial_scale={self.initial_scale}) is above max_scale="
                    f"{self.max_scale}"
                )
            if self.initial_scale < self.min:
                raise ConfigError(
                    f"autoscale(initial_scale={self.initial_scale}) is below min_scale="
                    f"{self.min_scale}"
                )
        if self.metric is not None and self.metric not in METRICS:
            raise ConfigError(
                f"autoscale(metric={self.metric!r}); allowed: {', '.join(map(repr, METRICS))}"
            )
        if self.target is not None and (
            isinstance(self.target, bool)
            or not isinstance(self.target, (int, float))
            or not math.isfinite(self.target)
            or self.target <= 0
        ):
            raise ConfigError(
                f"autoscale(target={self.target!r}) must be a positive number (load per replica)"
            )
        if self.target_utilization is not None and (
            isinstance(self.target_utilization, bool)
            or not isinstance(self.target_utilization, (int, float))
            or not 0 < self.target_utilization <= 100
        ):
            raise ConfigError(
                f"autoscale(target_utilization={self.target_utilization!r}) must be a percentage "
                "between 1 and 100"
            )
        if self.autoscaler_class is not None and self.autoscaler_class not in AUTOSCALER_CLASSES:
            raise ConfigError(
                f"autoscale(autoscaler_class={self.autoscaler_class!r}); allowed: "
                f"{', '.join(map(repr, AUTOSCALER_CLASSES))}"
            )
        if self.metric in ("cpu", "memory") and self.autoscaler_class == AUTOSCALER_CLASSES[0]:
            raise ConfigError(
                f"autoscale(metric={self.metric!r}) needs autoscaler_class="
                f"'{AUTOSCALER_CLASSES[1]}' (Knative's KPA scales on concurrency or rps only)"
            )
        self.window_s  # noqa: B018 - bad durations fail here
        self.scale_down_delay_s  # noqa: B018
        self.retention_s  # noqa: B018
        if self.progress_deadline is not None:
            seconds(self.progress_deadline, "progress_deadline", zero_ok=False)
        if not isinstance(self.extra, dict):
            raise ConfigError(f"autoscale extra annotations must be keywords, got {self.extra!r}")
        object.__setattr__(
            self, "extra", {str(k).replace("_", "-"): str(v) for k, v in self.extra.items()}
        )

    # ---- effective values ----------------------------------------------------------------

    @property
    def min(self) -> int:
        return 0 if self.min_scale is None else self.min_scale

    @property
    def initial(self) -> int:
        return max(self.min, 1) if self.initial_scale is None else self.initial_scale

    @property
    def metric_name(self) -> str:
        return self.metric or "concurrency"

    @property
    def target_per_replica(self) -> float:
        """The load one replica should carry before another is added (target × utilization)."""
        target = self.target
        if target is None:
            target = (
                float(self.concurrency)
                if self.concurrency and self.metric_name == "concurrency"
                else DEFAULT_TARGETS[self.metric_name]
            )
        return (
            float(target)
            * (70.0 if self.target_utilization is None else float(self.target_utilization))
            / 100
        )

    @property
    def window_s(self) -> float:
        return seconds("60s" if self.window is None else self.window, "window", zero_ok=False)

    @property
    def scale_down_delay_s(self) -> float:
        return seconds(
            "1m" if self.scale_down_delay is None else self.scale_down_delay, "scale_down_delay"
        )

    @property
    def retention_s(self) -> float:
        value = self.scale_to_zero_pod_retention_period
        return seconds("10m" if value is None else value, "scale_to_zero_pod_retention_period")

    def describe(self) -> str:
        top = "no limit" if self.max_scale is None else str(self.max_scale)
        return (
            f"{self.min}..{top} replicas, {self.metric_name} target {self.target_per_replica:g} per replica"
            + (f", at most {self.concurrency} calls each" if self.concurrency else "")
        )

    def annotations(self) -> dict[str, str]:
        """Knative's autoscaling annotations for this config (only the fields given, and the
        delays Kubetorch sets by default)."""
        prefix = "autoscaling.knative.dev/"
        out = {prefix + "class": self.autoscaler_class or AUTOSCALER_CLASSES[0]}
        for name, key in (
            ("target", "target"),
            ("min_scale", "min-scale"),
            ("max_scale", "max-scale"),
            ("metric", "metric"),
            ("target_utilization", "target-utilization-percentage"),
            ("initial_scale", "initial-scale"),
        ):
            value = getattr(self, name)
            if value is not None:
                out[prefix + key] = f"{value:g}" if isinstance(value, float) else str(value)
        if self.window is not None:
            out[prefix + "window"] = _knative(self.window)
        out[prefix + "scale-down-delay"] = _knative(
            "1m" if self.scale_down_delay is None else self.scale_down_delay
        )
        out[prefix + "scale-to-zero-pod-retention-period"] = _knative(
            "10m"
            if self.scale_to_zero_pod_retention_period is None
            else self.scale_to_zero_pod_retention_period
        )
        out.update({prefix + k: v for k, v in self.extra.items()})
        return out


def from_kwargs(kwargs: dict[str, Any]) -> AutoscaleConfig:
    """Kubetorch's ``autoscale(**kwargs)``: known names are fields, the rest Knative annotations.
    ``min_replicas``/``max_replicas`` (in Kubetorch's own docstring) and ``initial_replicas``
    (in its examples) are taken as the scales."""
    kwargs = dict(kwargs)
    for alias, name in (
        ("min_replicas", "min_scale"),
        ("max_replicas", "max_scale"),
        ("initial_replicas", "initial_scale"),
    ):
        if alias in kwargs:
            if name in kwargs:
                raise ConfigError(f"autoscale(): pass {name}= or {alias}=, not both")
            kwargs[name] = kwargs.pop(alias)
    known = {f for f in AutoscaleConfig.__dataclass_fields__ if f != "extra"}
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    odd = [k for k in extra if not re.match(r"^[a-z][a-z0-9_-]*$", k)]
    if odd:
        raise ConfigError(
            f"autoscale() got unknown option(s) {', '.join(odd)}; allowed: {', '.join(sorted(known))} "
            "(other keywords become autoscaling.knative.dev/ annotations)"
        )
    return AutoscaleConfig(**kwargs, extra=extra)


# ---- the scaling rule (the local backend's autoscaler; Knative's KPA does the same) ----------


@dataclass
class Decision:
    """One autoscaler step: how many replicas, and why (shown by status)."""

    at: float
    current: int
    desired: int
    load: float  # the metric averaged over the window (total across replicas)
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "current": self.current,
            "desired": self.desired,
            "load": round(self.load, 3),
            "reason": self.reason,
        }


class Scaler:
    """Knative's rule, over samples of the total load (in-flight + queued calls, calls per
    second, or CPU percent, summed over replicas):

    - want = ceil(average load over ``window`` / target per replica), within min..max;
    - a burst (the load over the last tenth of the window needs more than twice the replicas
      running) scales up at once to what that burst needs (panic mode);
    - scaling down waits until fewer replicas have been wanted for ``scale_down_delay``
      (the largest want over that delay wins);
    - zero replicas only after no calls for ``scale_to_zero_pod_retention_period``.
    """

    def __init__(self, config: AutoscaleConfig, max_default: int) -> None:
        self.config = config
        self.max = (
            config.max_scale if config.max_scale is not None else max(max_default, config.min, 1)
        )
        self.samples: deque[tuple[float, float]] = deque()
        self.wants: deque[tuple[float, int]] = deque()

    def started(self, now: float, replicas: int) -> None:
        """The autoscaler starts with ``replicas`` running (``initial_scale``'s at a deploy):
        they count as wanted at ``now``, so none stops before ``scale_down_delay``."""
        self.wants.append((now, replicas))

    def _average(self, now: float, span: float) -> float:
        recent = [v for t, v in self.samples if t >= now - span]
        return sum(recent) / len(recent) if recent else 0.0

    def decide(self, now: float, load: float, current: int, last_call: float | None) -> Decision:
        c = self.config
        self.samples.append((now, load))
        while self.samples and self.samples[0][0] < now - c.window_s:
            self.samples.popleft()
        per = c.target_per_replica
        stable = self._average(now, c.window_s)
        panic = self._average(now, max(c.window_s / 10, 1e-3))
        want = math.ceil(stable / per - 1e-9) if stable > 0 else 0
        want = min(max(want, c.min), self.max)
        burst = min(max(math.ceil(panic / per - 1e-9), c.min), self.max)
        self.wants.append((now, want))
        while self.wants and self.wants[0][0] < now - c.scale_down_delay_s:
            self.wants.popleft()
        if burst > max(current, want) and (current == 0 or burst >= 2 * current):
            return Decision(
                now,
                current,
                burst,
                panic,
                f"burst: {panic:.3g} {c.metric_name} over the last "
                f"{c.window_s / 10:g}s needs {burst} replica(s) at {per:g} each (panic mode)",
            )
        if want > current:
            return Decision(
                now,
                current,
                want,
                stable,
                f"{stable:.3g} {c.metric_name} averaged over "
                f"{c.window_s:g}s needs {want} replica(s) at {per:g} each",
            )
        held = max((w for _, w in self.wants), default=want)
        if current > 0 and want == 0 and c.min == 0:
            idle = now - last_call if last_call is not None else float("inf")
            if held > 0 or idle < max(c.retention_s, c.scale_down_delay_s) or stable > 0:
                return Decision(
                    now,
                    current,
                    max(held, 1),
                    stable,
                    f"idle {idle:.0f}s; the last replica stays until "
                    f"{max(c.retention_s, c.scale_down_delay_s):g}s without calls",
                )
            return Decision(
                now,
                current,
                0,
                stable,
                f"no calls for {idle:.0f}s "
                f"(scale_to_zero_pod_retention_period {c.retention_s:g}s): scaled to zero",
            )
        desired = max(held, want, c.min)
        if desired < current:
            return Decision(
                now,
                current,
                desired,
                stable,
                f"{stable:.3g} {c.metric_name} needs {want} "
                f"replica(s); fewer have been enough for scale_down_delay {c.scale_down_delay_s:g}s",
            )
        if desired == current and want < current:
            return Decision(
                now,
                current,
                current,
                stable,
                f"{stable:.3g} {c.metric_name} needs {want} "
                f"replica(s); waiting scale_down_delay {c.scale_down_delay_s:g}s before scaling down",
            )
        return Decision(
            now,
            current,
            current,
            stable,
            f"{stable:.3g} {c.metric_name} averaged over {c.window_s:g}s: {current} replica(s) enough",
        )
