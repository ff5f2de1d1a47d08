"""HTTP client for a deployment's pods (httpx, injectable transport).

Translates transport failures into ktlite errors where they enter: connection errors
become :class:`PodUnreachable`, 401 :class:`AuthError`, a version clash
:class:`ProtocolMismatch` (a refusal's error: :mod:`ktlite.net.refusals`; a call's reply stream:
:mod:`ktlite.net.call_reply`). Holds the token privately; it never appears in a repr. A
pod at an ``https://`` address is reached over TLS that trusts only the deployment's own
certificate (:mod:`ktlite.net.tls`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from ktlite.errors import (
    ConfigError,
    PodUnreachable,
    ProtocolMismatch,
)
from ktlite.logconfig import http_hook
from ktlite.net import proxycall, tls
from ktlite.net.call_reply import CallReply as CallReply
from ktlite.net.call_reply import (
    FrameReader,
    LogSink,
    NoticeSink,
    Outcomes,
    answered,
    call_error,
    coordinator,
    refused,
)
from ktlite.net.callmux import CallMux
from ktlite.net.connection import ConnectionRefused, Pool
from ktlite.net.podlinks import BODY_MAX, LinkMux
from ktlite.net.refusals import PROXY_ERRORS, ProxyRefusal, raise_for_status
from ktlite.net.transport import PodSilent, PodTransport, Reply, shared_http
from ktlite_wire import envelope, heartbeat, linkframes, version
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import (
    CALL_HEADER,
    ERROR_CODE_HEADER,
    LENGTH_HEADER,
    TOKEN_HEADER,
    TREE_HEADER,
    VERSION_HEADER,
    bearer,
)
from ktlite_wire.outcome import CallResult
from ktlite_wire.plan import CallPlan

logger = logging.getLogger(__name__)

# The server sends a heartbeat frame every 2 s; silence this long means the pod is gone:
# KTLITE_SILENCE_TIMEOUT (ktlite_wire.heartbeat), read at the first call (None until then).
SILENCE_TIMEOUT: float | None = None


_pool = Pool()  # one keep-alive pool for every deployment of this process (tokens go per request)
atexit.register(_pool.close)
_mux = CallMux(_pool)  # reads the answers of calls started without waiting (start_call)
_links = LinkMux()  # ... and of those sent over a link to their pod (start_call: the usual)


def silence_timeout() -> float:
    """How long a call's stream may stay silent (no frame, no heartbeat) before its pod is
    taken for gone: ``KTLITE_SILENCE_TIMEOUT``, read and checked once, at the first call."""
    global SILENCE_TIMEOUT
    if SILENCE_TIMEOUT is None:
        try:
            SILENCE_TIMEOUT = heartbeat.silence_timeout()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return SILENCE_TIMEOUT


class PodClient:
    def __init__(
        self,
        token: str,
        http: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._token = token
        self._own_headers: dict[str, str] = {}
        self._own_for = -1  # the protocol version _own_headers name
        self._owns = transport is not None
        # calls to plain http:// pods take the lean connection unless a client was injected
        self._lean = http is None and transport is None
        self.reattempts = 0  # proxied requests sent again after a broken connection (a count)
        if transport is not None:
            http = httpx.Client(
                transport=transport,
                timeout=httpx.Timeout(30.0, connect=10.0),
                event_hooks={"response": [http_hook(logger)]},
            )
        # direct pods (nothing injected) take the lean pool, every endpoint; https:// ones
        # over TLS pinned to the deployment's certificate (made from the token when first used)
        self.transport = PodTransport(
            _pool, http, logger, pinned=functools.partial(tls.pinned_context, token)
        )
        self.http = http or shared_http()

    def __repr__(self) -> str:
        return "PodClient(token=<hidden>)"

    def close(self) -> None:
        if self._owns:
            self.http.close()

    def forget(self, url: str) -> None:
        """Drop pooled connections to a pod that is gone (after a teardown). Every request
        to a direct pod goes through this pool; a proxied pod's go to the proxy, not the pod."""
        _pool.drop(url)
        _links.drop(url)

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        own = self._own()
        return {**own, **extra} if extra else dict(own)

    def _own(self) -> dict[str, str]:
        """The token and protocol version, built once per version (never changed: copied
        where a request adds to them)."""
        v = version.PROTOCOL_VERSION
        if self._own_for != v:
            self._own_headers = {TOKEN_HEADER: bearer(self._token), VERSION_HEADER: str(v)}
            self._own_for = v
        return self._own_headers

    @staticmethod
    def _check(resp: httpx.Response | Reply, url: str) -> None:
        """Raise the ktlite error of a refusal (by its error code)."""
        if isinstance(resp, httpx.Response):  # a streamed call's answer (the proxied path)
            if resp.status_code < 400:
                return
            try:
                content = resp.read()
            except httpx.HTTPError:  # the refusal's text is lost; its status and code are not
                content = b""
            resp = Reply(resp.status_code, {k.lower(): v for k, v in resp.headers.items()}, content)
        if resp.status < 400:
            return
        try:
            detail = resp.json().get("detail", resp.text)
        except (ValueError, AttributeError):
            detail = resp.text
        raise_for_status(resp.status, str(detail), url, resp.headers.get(ERROR_CODE_HEADER))

    def health(self, url: str, timeout: float = 2.0) -> dict[str, Any]:
        resp = self.transport.request(
            "GET", url, "/health", headers=self._headers(), what="/health", timeout=timeout
        )
        if resp.status in (502, 503, 504):  # a proxy (the API server's) cannot reach it yet
            raise PodUnreachable(
                f"pod at {url} is not reachable through the proxy yet "
                f"(HTTP {resp.status}): {resp.text[:300]}"
            )
        self._check(resp, url)
        data: dict[str, Any] = resp.json()
        if data.get("protocol") != version.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                version.mismatch(
                    data.get("protocol"),
                    version.PROTOCOL_VERSION,
                    them=f"the pod at {url} (ktlite {data.get('version')})",
                    us="this client",
                )
            )
        return data

    def ready(self, url: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """``GET /health?ready=1``: the pod's health when it has a launch loaded, None when it
        answers but has none yet (or the proxy cannot reach it yet); PodUnreachable when the
        pod does not answer at all."""
        resp = self.transport.request(
            "GET",
            url,
            "/health",
            params={"ready": "1"},
            headers=self._headers(),
            what="/health",
            timeout=timeout,
        )
        if resp.status in (502, 503, 504):
            return None
        self._check(resp, url)
        data: dict[str, Any] = resp.json()
        return data

    def deploy(
        self, url: str, message: bytes, timeout: float, relay: str | None = None
    ) -> Outcomes:
        """Install a launch on the pod at ``url`` (with ``relay``, the ``x-ktlite-tree``
        header, on every pod it names, through it). A pod installs a launch once, so a request
        whose answer a proxy dropped is sent again (chunked, for the reason in
        :meth:`_call_resumable`)."""
        window_end = 0.0
        while True:
            sized = len(message) > proxycall.CHUNKED_MAX  # as for calls: see proxycall
            headers = self._headers({LENGTH_HEADER: str(len(message))})
            if relay is not None:
                headers[TREE_HEADER] = relay
            content = (
                message if sized or self.transport.direct(url) else proxycall.chunks([message])
            )
            try:
                resp = self.transport.request(
                    "POST",
                    url,
                    "/deploy",
                    what="the deploy",
                    timeout=timeout,
                    headers=headers,
                    content=content,
                )
                if resp.status not in PROXY_ERRORS:
                    break
                error: Exception = ProxyRefusal(resp.status, resp.text)
            except PodSilent:
                raise
            except PodUnreachable as e:
                error = e
            now = time.monotonic()
            window_end = window_end or now + proxycall.RESUME_WINDOW_S
            if now >= window_end:
                raise PodUnreachable(f"could not deploy to pod at {url}: {error!r}") from error
            time.sleep(0.1)
        self._check(resp, url)
        try:
            return CallResult.decode(bytearray(resp.content)).outcomes
        except ProtocolError as e:
            raise PodUnreachable(
                f"pod at {url} answered the deploy with a malformed result: {e}"
            ) from e

    def status(
        self,
        url: str,
        stuck_after: float | None = None,
        relay: str | None = None,
        timeout: float = 5.0,
    ) -> Any:
        """The pod's status; with ``relay`` (``x-ktlite-tree``) a list, every pod it names."""
        params = {} if stuck_after is None else {"stuck_after": str(stuck_after)}
        resp = self.transport.request(
            "GET",
            url,
            "/status",
            headers=self._headers({} if relay is None else {TREE_HEADER: relay}),
            params=params,
            what="/status",
            timeout=timeout,
        )
        self._check(resp, url)
        return resp.json()

    def restart_failed(
        self, url: str, timeout: float, regroup: bool = False, relay: str | None = None
    ) -> Any:
        """Restart the pod's dead ranks; with ``relay`` every pod's, a list of answers."""
        resp = self.transport.request(
            "POST",
            url,
            "/restart_failed",
            headers=self._headers({} if relay is None else {TREE_HEADER: relay}),
            timeout=timeout,
            params={"regroup": "true"} if regroup else None,
            what="/restart_failed",
        )
        self._check(resp, url)
        return resp.json()

    def cancel(
        self, url: str, call_id: str, reason: str = "cancelled by the caller", timeout: float = 5.0
    ) -> None:
        # best effort: the pod also cancels when our stream closes
        with contextlib.suppress(PodUnreachable):
            self.transport.request(
                "POST",
                url,
                f"/cancel/{call_id}",
                params={"reason": reason},
                headers=self._headers(),
                timeout=timeout,
                what="the cancel",
            )

    def call(
        self,
        url: str,
        plan: CallPlan,
        parts: list[Any],
        on_log: LogSink | None,
        on_notice: NoticeSink | None = None,
        pod: str = "",
    ) -> CallReply:
        """Run the call ``plan`` through the coordinator ``pod`` at ``url``: its outcomes."""
        who, silence = coordinator(url, pod), silence_timeout()
        frames = FrameReader(on_log, on_notice, url)
        try:
            if self._lean and self.transport.direct(url):
                headers = self._headers(
                    {CALL_HEADER: plan.encode(), "content-type": "application/octet-stream"}
                )
                return self._call_lean(url, headers, parts, frames, silence)
            return proxycall.call_resumable(
                self.http,
                self._headers,
                self._check,
                self._reattempted,
                url,
                plan,
                parts,
                frames,
                who,
                silence,
            )
        except Exception as e:  # noqa: BLE001 - each becomes the ktlite error that says it
            error = call_error(e, who, silence)
            if error is e:
                raise
            raise error from e

    def _reattempted(self) -> None:
        self.reattempts += 1

    def can_start(self, url: str) -> bool:
        """Whether :meth:`start_call` takes a call to ``url``: a pod reached directly."""
        return self._lean and self.transport.direct(url)

    def start_call(
        self,
        url: str,
        plan: CallPlan,
        parts: list[Any],
        on_log: LogSink | None,
        done: Callable[[CallReply | None, BaseException | None], None],
        pod: str = "",
    ) -> None:
        """:meth:`call`, without waiting: the call leaves now over the pod's link (``podlinks``;
        a larger body as a request of its own, ``callmux``), its answer read on one thread,
        which calls ``done(reply, None)`` or ``done(None, error)`` with the error :meth:`call`
        would raise. Only for a pod that :meth:`can_start` takes."""
        silence = silence_timeout()
        frames = FrameReader(on_log, None, url)
        end = answered(frames, coordinator(url, pod), silence, done)
        ctx = self.transport.context(url)
        if envelope.parts_size(parts) <= BODY_MAX:
            lean = linkframes.caller_run(plan)  # a RUN, where the call needs no plan
            meta = plan.encode() if lean is None else lean
            on = (frames.frame, end)
            _links.start(url, self._own(), meta, parts, ctx, silence, *on, on_done=frames.done)
            return
        meta = plan.encode()
        headers = self._headers({CALL_HEADER: meta, "content-type": "application/octet-stream"})
        _mux.start(url, "/call", headers, parts, ctx, silence, frames.frame, end)

    def _call_lean(
        self,
        url: str,
        headers: dict[str, str],
        parts: list[Any],
        frames: FrameReader,
        silence: float,
    ) -> CallReply:
        try:
            conn, status, hdrs = _pool.post(
                url,
                "/call",
                headers,
                parts,
                connect_timeout=10.0,
                read_timeout=silence,
                context=self.transport.context(url),
            )
            logger.debug("POST %s/call -> %d (direct connection)", url, status)
        except ConnectionRefused as e:
            raise PodUnreachable(
                f"cannot connect to the coordinator pod at {url}: {e}", delivered=False
            ) from e
        try:
            if status >= 400:
                refused(status, b"".join(conn.body(hdrs)), url, hdrs)
            result = frames.take(conn.frames(hdrs))
        except BaseException:
            conn.close()
            raise
        _pool.release(conn)
        return result
