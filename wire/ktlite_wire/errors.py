"""Errors on the wire: a code every refusal carries, and what a rank's exception becomes.

Callers classify a refusal by its :class:`ErrorCode` (the ``x-ktlite-error`` header of an
HTTP answer, the ``code`` of an error frame), never by its message text, which is for
people.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    UNAUTHORIZED = "unauthorized"  # missing or wrong deployment token
    PROTOCOL_MISMATCH = "protocol_mismatch"  # the two sides speak different protocol versions
    NOT_DEPLOYED = "not_deployed"  # the pod has no code (its server restarted after the deploy)
    REDEPLOYED = "redeployed"  # the pod runs another launch than the caller's
    STALE_LAUNCH = "stale_launch"  # a launch older (by generation) than the one the pod holds
    UNKNOWN_CALL = "unknown_call"  # a re-attach to a call the pod never saw (it restarted)
    CALL_EXPIRED = "call_expired"  # a re-attach to a call whose result is no longer kept
    BAD_REQUEST = "bad_request"  # a malformed request: the caller's fault
    LENGTH_REQUIRED = "length_required"
    TOO_LARGE = "too_large"
    NOT_FOUND = "not_found"  # (data store) no such key
    CONFLICT = "conflict"  # (data store) the key exists as something else
    FORBIDDEN = "forbidden"  # (data store) the token's scope does not reach the key
    STORE_FULL = "store_full"  # (data store) the store holds KTLITE_STORE_MAX_BYTES already
    INTERNAL = "internal"  # an infrastructure failure on the pod
    PORT_UNREACHABLE = "port_unreachable"  # /ports/P: nothing answers on port P in the pod

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object) -> ErrorCode | None:
        """The code named by ``value``; None for a missing or unknown one (an older peer)."""
        try:
            return cls(value)
        except ValueError:
            return None


class ProtocolError(ValueError):
    """A malformed, truncated or other-version message."""


@dataclass(frozen=True)
class WireError:
    """A failure a pod reports: a code to classify it by, and a message for people."""

    code: ErrorCode
    message: str
    type_name: str = ""  # the Python type of an infrastructure failure, when there was one

    def encode(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message, "type": self.type_name}

    @classmethod
    def decode(cls, data: Any) -> WireError:
        if not isinstance(data, dict) or not isinstance(data.get("message"), str):
            raise ProtocolError(
                f"an error must be an object with a message, got {str(data)[:200]!r}"
            )
        code = ErrorCode.parse(data.get("code")) or ErrorCode.INTERNAL
        return cls(code, data["message"], str(data.get("type") or ""))


@dataclass
class RemoteExceptionInfo:
    """An exception raised on a rank: its pickle when it round-trips, always its text.

    It travels pickled inside a value message (opaque to the pod server), like a return
    value; only the caller unpickles it.
    """

    type_name: str
    message: str
    traceback: str
    pickled: bytes | None = None
