"""How a deployment's calls and lifetime behave by default: timeouts, log streaming, rank
restarts and concurrency. ``kt.Compute(launch_timeout=..., call_timeout=...)`` fills them,
``compute.calls`` holds them; none of them shapes a pod."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ktlite.errors import ConfigError
from ktlite.specs.quantities import parse_duration

SERIALIZATIONS = ("json", "pickle")  # Kubetorch's call serialization formats ktlite takes


def _seconds(name: str, value: object, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"{name}={value!r} must be a positive number of seconds (finite)"
            + (" (or None for no limit)" if none_ok else "")
        )


@dataclass(frozen=True)
class CallDefaults:
    """Defaults of a deployment's calls and lifetime.

    Args:
        launch_timeout: seconds to wait for pods to become ready.
        call_timeout: default limit of each call in seconds (None: no limit).
        teardown_timeout: seconds ``teardown()`` waits for pods to stop before killing them.
        inactivity_ttl: a duration ("30m", "1h", 600) after which idle pods stop.
        stream_logs: stream every rank's stdout/stderr to the caller during calls.
        max_restarts: how often a dead rank process is restarted between calls.
        concurrency: calls each rank process runs at once (None: ktlite's default).
        restart_procs: every ``.to()`` starts fresh rank processes.
        allowed_serialization: the call serializations accepted ("json", "pickle").
    """

    launch_timeout: float = 600.0
    call_timeout: float | None = None
    teardown_timeout: float = 30.0
    inactivity_ttl: str | float | None = None
    stream_logs: bool = True
    max_restarts: int = 3
    concurrency: int | None = None
    restart_procs: bool = False
    allowed_serialization: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.launch_timeout, bool)
            or not isinstance(self.launch_timeout, (int, float))
            or not math.isfinite(self.launch_timeout)
            or self.launch_timeout <= 0
        ):
            raise ConfigError(
                f"launch_timeout={self.launch_timeout!r} must be a positive number of seconds"
            )
        _seconds("call_timeout", self.call_timeout, none_ok=True)
        _seconds("teardown_timeout", self.teardown_timeout)
        self.inactivity_seconds  # noqa: B018 - a bad duration fails here, before any deploy
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be a whole number >= 0")
        if self.concurrency is not None and (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or not 1 <= self.concurrency <= 1024
        ):
            raise ConfigError(
                f"concurrency={self.concurrency!r} must be a whole number between 1 and 1024 "
                "(calls each rank process runs at once)"
            )
        if not isinstance(self.restart_procs, bool):
            raise ConfigError(f"restart_procs={self.restart_procs!r} must be True or False")
        if self.allowed_serialization is not None:
            given: object = self.allowed_serialization
            allowed = (given,) if isinstance(given, str) else tuple(self.allowed_serialization)
            bad = [a for a in allowed if a not in SERIALIZATIONS]
            if bad or not allowed:
                raise ConfigError(
                    f"allowed_serialization={self.allowed_serialization!r}; allowed entries: "
                    f"{', '.join(map(repr, SERIALIZATIONS))}"
                )
            object.__setattr__(self, "allowed_serialization", allowed)

    @property
    def inactivity_seconds(self) -> float | None:
        """``inactivity_ttl`` in seconds (None: no limit)."""
        return parse_duration(self.inactivity_ttl, "inactivity_ttl")


CALL_FIELDS = tuple(f.name for f in fields(CallDefaults))
