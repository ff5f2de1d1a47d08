"""The pod server's refusals: an HTTP status for the infrastructure, an error code for the
caller to classify by (``x-ktlite-error``), a message for people."""

from __future__ import annotations

from fastapi import HTTPException

from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import ERROR_CODE_HEADER


def refuse(
    status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None
) -> HTTPException:
    """An HTTPException that carries ``code``; raise it."""
    return HTTPException(
        status, message, headers={**(headers or {}), ERROR_CODE_HEADER: code.value}
    )
