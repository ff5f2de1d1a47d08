"""The pod server's diagnostics: the ``ktlite_server`` logger on stderr (the pod log).

``KTLITE_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING`` (the default), ``ERROR``) is handed
over by the client that started the pod. At DEBUG the server also logs every HTTP request
it answers: method, path, status and time, never a header (the token travels in one).
``KTLITE_LOG_CALL_BODIES=1`` logs what each call brought (at INFO). The ranks' own output
is not logged: it is relayed as a stream, ``[rank r] ...``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

ENV = "KTLITE_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)


def level_from_env() -> tuple[int, str | None]:
    """The level ``KTLITE_LOG_LEVEL`` names (WARNING when unset), and a complaint when its
    value is not a level."""
    value = os.environ.get(ENV, "").strip().upper()
    level = logging.WARNING
    if value in LEVELS:
        level = logging.getLevelName(value)
    elif value.isdigit():
        level = int(value)
    elif value:
        return level, f"{ENV}={value!r} is not a log level; give one of {', '.join(LEVELS)}"
    if os.environ.get("KTLITE_LOG_CALL_BODIES", "") not in ("", "0"):
        level = min(level, logging.INFO)
    return level, None


def configure() -> None:
    """The ``ktlite_server`` logger writes to stderr at ``KTLITE_LOG_LEVEL``'s level. This
    process is the pod's (a server, a rank, a setup step), so the handler is ours to add;
    the root logger is left to the user's code that runs in a rank."""
    root = logging.getLogger("ktlite_server")
    if not any(getattr(h, "_ktlite", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._ktlite = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False  # a rank's user code may configure the root logger: no echo
    level, complaint = level_from_env()
    root.setLevel(level)
    if complaint:
        logger.warning("%s (default WARNING)", complaint)


def request_log(app: ASGIApp) -> ASGIApp:
    """``app``, logging each HTTP request it answers at DEBUG; ``app`` itself when DEBUG is
    off at start (the level comes from the environment once: a layer per request costs)."""
    log = logging.getLogger("ktlite_server.requests")
    if not log.isEnabledFor(logging.DEBUG):
        return app
    from ktlite_server.callresponse import RAW_RESPONSE  # the pod server's, not a rank's

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started, status = time.monotonic(), [0]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        extensions = scope.get("extensions") or {}
        raw = extensions.get(RAW_RESPONSE)
        if raw is not None:  # a call's answer the server writes itself (always a 200 head)

            def raw_logged(raw_scope: Scope) -> Any:
                out = raw(raw_scope)
                if out is not None:
                    status[0] = 200
                return out

            scope["extensions"] = {**extensions, RAW_RESPONSE: raw_logged}  # same scope object

        try:
            await app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            log.debug(
                "%s %s from %s -> %s in %.3fs",
                scope["method"],
                scope["path"],
                client[0],
                status[0] or "no answer",
                time.monotonic() - started,
            )

    return logged
