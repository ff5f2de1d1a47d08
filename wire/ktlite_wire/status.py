"""How one rank's part of a call (or of a deploy) ended."""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    """A rank's outcome. A ``str`` enum: it is its own JSON form."""

    OK = "ok"
    ERROR = "error"  # the user's code raised: the data is the exception's info
    DIED = "died"  # the rank process died, or could not start
    CANCELLED = "cancelled"  # stopped (the caller asked, or another rank failed)
    TIMEOUT = "timeout"  # stopped at the call's timeout
    UNREACHABLE = "unreachable"  # its pod could not be reached before the call started
    STALE = "stale"  # its pod lost or replaced the deployment's code: nothing ran there

    def __str__(self) -> str:
        return self.value

    @property
    def failed(self) -> bool:
        """A failure of its own, not a stop caused by another rank's failure or the caller."""
        return self not in (Status.OK, Status.CANCELLED, Status.TIMEOUT)

    @classmethod
    def parse(cls, value: object) -> Status:
        status = _BY_VALUE.get(value) if isinstance(value, str) else None
        if status is None:  # a dict lookup: Enum's own call costs more than a warm call's row
            allowed = ", ".join(s.value for s in cls)
            raise ValueError(f"status {value!r} is not one of {allowed}")
        return status


_BY_VALUE: dict[str, Status] = {s.value: s for s in Status}
