"""Who may use the dashboard's API: the holder of the run's secret, from the dashboard's own
page.

The secret is a random token made at start and printed in the page's address, after ``#``
(a fragment: never sent to a server, never in a Referer); the page sends it back in the
``x-ktlite-dashboard`` header of every API request. A page of another site open in the same
browser cannot: a custom header on a cross-origin request needs a CORS preflight, which this
server never grants. Every API request must also name this server in ``Host`` (a page of
another site whose name was re-pointed at 127.0.0.1, DNS rebinding, names its own), and a
request that changes something (``POST``) must come from this server's own origin when the
browser says where it comes from (``Origin``).
"""

from __future__ import annotations

import hmac
import secrets

HEADER = "x-ktlite-dashboard"
LOOPBACK_NAMES = ("127.0.0.1", "localhost")


def new_token() -> str:
    return secrets.token_urlsafe(32)


class Refused(Exception):
    """An API request without the right to it: ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Access:
    """The checks of the module's docstring for a server on 127.0.0.1:``port``."""

    def __init__(self, token: str, port: int) -> None:
        self.token = token
        self.port = port
        self.hosts = {f"{name}:{port}" for name in LOOPBACK_NAMES}
        self.origins = {f"http://{host}" for host in self.hosts}

    def check(self, method: str, headers: dict[str, str]) -> None:
        """Raise :class:`Refused` unless a request with these (lower-case) headers may go on."""
        host = headers.get("host", "")
        if host not in self.hosts:
            raise Refused(
                403,
                f"this dashboard answers requests to {' or '.join(sorted(self.hosts))}, "
                f"not to {host[:100]!r}",
            )
        given = headers.get(HEADER)
        if not given:
            raise Refused(
                401,
                f"the dashboard's API needs its secret in the {HEADER} header: open the "
                "address `ktlite dashboard` printed (it carries the secret after #token=)",
            )
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Refused(
                403,
                "wrong dashboard secret: each `ktlite dashboard` run makes a new one; "
                "open the address this run printed",
            )
        origin = headers.get("origin")
        if method not in ("GET", "HEAD") and origin is not None and origin not in self.origins:
            raise Refused(
                403,
                f"a request from {origin[:100]!r} may not change anything here; "
                "use the dashboard's own page",
            )
