"""ktlite's diagnostics: the ``ktlite`` logger, ``KTLITE_LOG_LEVEL`` and a stderr handler.

Every module logs to ``logging.getLogger(__name__)``, under ``ktlite``. ``KTLITE_LOG_LEVEL``
(``DEBUG``, ``INFO``, ``WARNING`` (the default) or ``ERROR``) sets that logger's level: INFO
shows the steps of a deploy, DEBUG also every HTTP request to a pod (method, address, path,
status; never a header). The variable is handed to the pods, whose server and rank
processes log to their stderr, the pod log.

Records go to the application's logging when it has configured any (a handler on the root
logger): then this module's stderr handler stays quiet, so nothing shows twice. A script or
notebook that configured nothing sees ktlite's warnings on stderr, as ``print`` showed them
before (a bare ``NullHandler`` would have hidden them). The ``ktlite`` command installs the
same handler. What users asked to see (the CLI's own output, progress lines, the ranks'
``[rank r]`` output) is written to its streams, never logged.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

ENV = "KTLITE_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(levelname)s %(name)s: %(message)s"

logger = logging.getLogger(__name__)
_refused: set[str] = set()  # KTLITE_LOG_LEVEL values already complained about


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current ``sys.stderr`` (a redirected or captured one included), and only
    while the application has configured no logging of its own."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:  # called holding the handler's lock
        if logging.getLogger().handlers:  # the application's own handlers get it by propagation
            return
        self.stream = sys.stderr  # the current one: replaced by a test's capture, a redirect
        super().emit(record)


def parse_level(value: str) -> int | None:
    """``value``'s level (a name in any case, or a number), or None when it is not one."""
    name = value.strip().upper()
    if name.isdigit():
        return int(name)
    return logging.getLevelName(name) if name in LEVELS else None


def configure(level: str | None = None) -> None:
    """Give the ``ktlite`` logger its stderr handler (once) and the level ``level``, else
    ``KTLITE_LOG_LEVEL``'s; without either its level is left to the application."""
    root = logging.getLogger("ktlite")
    if not any(isinstance(h, StderrHandler) for h in root.handlers):
        root.addHandler(StderrHandler())
    value = level if level is not None else os.environ.get(ENV, "")
    if not value:
        return
    parsed = parse_level(value)
    if parsed is None:
        if value in _refused:
            return
        _refused.add(value)
        logger.warning(
            "%s=%r is not a log level; give one of %s (default WARNING)",
            ENV,
            value,
            ", ".join(LEVELS),
        )
        return
    root.setLevel(parsed)


def pod_env() -> dict[str, str]:
    """What a pod's environment gets so that its server logs at this process's level:
    ``KTLITE_LOG_LEVEL`` when set here, nothing otherwise (the pods' default is WARNING)."""
    value = os.environ.get(ENV, "")
    return {ENV: value} if value and parse_level(value) is not None else {}


def http_hook(log: logging.Logger) -> Any:
    """An httpx response hook writing one DEBUG record to ``log`` per request: method,
    address, path and status, never a header or the query (where a token could travel)."""

    def hook(response: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):
            request, url = response.request, response.request.url
            log.debug(
                "%s %s://%s%s -> %d",
                request.method,
                url.scheme,
                url.netloc.decode(),
                url.path,
                response.status_code,
            )

    return hook
