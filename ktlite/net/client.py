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
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx

from ktlite.errors import (
    ConfigError,
    NotDeployedError,
    PodUnreachable,
    ProtocolMismatch,
)
from ktlite.logconfig import http_hook
from ktlite.net import tls
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
from ktlite.net.connection import PROGRESS_BYTES, ConnectionRefused, Pool
from ktlite.net.podlinks import BODY_MAX, LinkMux
from ktlite.net.progress import Progress
from ktlite.net.refusals import PROXY_ERRORS, ProxyRefusal, proxy_refusal, raise_for_status
from ktlite.net.transport import PodSilent, PodTransport, Reply, shared_http
from ktlite_wire import envelope, heartbeat, version
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import (
    CALL_HEADER,
    ERROR_CODE_HEADER,
    LENGTH_HEADER,
    RESUME_HEADER,
    TOKEN_HEADER,
    TREE_HEADER,
    UPTIME_HEADER,
    VERSION_HEADER,
    bearer,
)
from ktlite_wire.outcome import CallResult
from ktlite_wire.plan import CallPlan

logger = logging.getLogger(__name__)

# The server sends a heartbeat frame every 2 s; silence this long means the pod is gone:
# KTLITE_SILENCE_TIMEOUT (ktlite_wire.heartbeat), read at the first call (None until then).
SILENCE_TIMEOUT: float | None = None
# After a proxied call's stream breaks, re-attach attempts go on this long; the pod keeps the
# call (and waits for us) for REATTACH_S, longer, so the window always ends first.
RESUME_WINDOW_S = 5.0
REATTACH_S = 10.0
CHUNKED_MAX = 8 << 20  # proxied bodies up to this size go chunked (see _call_resumable)


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
        own = {TOKEN_HEADER: bearer(self._token), VERSION_HEADER: str(version.PROTOCOL_VERSION)}
        return {**own, **extra} if extra else own

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
            sized = len(message) > CHUNKED_MAX  # as for calls: see _call_resumable
            headers = self._headers({LENGTH_HEADER: str(len(message))})
            if relay is not None:
                headers[TREE_HEADER] = relay
            content = message if sized or self.transport.direct(url) else _chunks([message])
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
            window_end = window_end or now + RESUME_WINDOW_S
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
            return self._call_resumable(url, plan, parts, frames, who, silence)
        except Exception as e:  # noqa: BLE001 - each becomes the ktlite error that says it
            error = call_error(e, who, silence)
            if error is e:
                raise
            raise error from e

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
        ctx, meta = self.transport.context(url), plan.encode()
        if envelope.parts_size(parts) <= BODY_MAX:
            _links.start(url, self._headers(), meta, parts, ctx, silence, frames.frame, end)
            return
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

    def _call_resumable(
        self,
        url: str,
        plan: CallPlan,
        parts: list[Any],
        frames: FrameReader,
        who: str,
        silence: float,
    ) -> CallReply:
        """A call through a proxy (the Kubernetes API server's). A stream that breaks is
        re-attached by call id, reading on from the first frame not received; the pod keeps
        the call running meanwhile and never runs it twice.

        Why bodies go chunked: Go's HTTP/1 server (the API server) races its reverse proxy
        when a backend answers as soon as a Content-Length body has arrived: it closes the
        request body while the proxy still checks it for EOF, and the proxy then drops its
        backend connection mid-response ("incomplete chunked read" here). A chunked body's end
        is seen by the proxy before the pod can answer, so the race cannot happen. Bodies over
        CHUNKED_MAX keep their Content-Length all the same: Go forwards chunked bodies in small
        pieces, at about two thirds of the throughput, while the race costs such a call only a
        re-attach (the pod had answered 200: nothing is sent again).
        """
        header = replace(plan, reattach=REATTACH_S).encode()
        timeout = httpx.Timeout(connect=10.0, read=silence, write=300.0, pool=30.0)
        size = envelope.parts_size(parts)
        window_end, attempt = 0.0, 0
        delivered = False  # did any attempt possibly reach a pod server?
        first_delivered = 0.0  # when the first attempt that may have reached one was sent
        accepted = False  # did the pod answer 200: it holds the call, and a re-attach needs no body
        while True:
            headers = self._headers(
                {CALL_HEADER: header, "content-type": "application/octet-stream"}
            )
            if accepted:
                headers[RESUME_HEADER] = str(frames.seen)
                content: Any = b""
            elif size > CHUNKED_MAX:
                headers["content-length"] = str(size)
                content = _sending(envelope.chunked(parts), size, who)
            else:  # sent again in whole until accepted: a pod that has the call id attaches
                headers[LENGTH_HEADER] = str(size)
                content = _sending(_chunks(parts), size, who)
            sent_at = time.monotonic()
            try:
                with self.http.stream(
                    "POST", f"{url}/call", content=content, headers=headers, timeout=timeout
                ) as resp:
                    refusal = proxy_refusal(resp)
                    if refusal is not None:
                        raise refusal
                    try:
                        self._check(resp, url)
                    except NotDeployedError as e:
                        if not delivered or _up_since(resp, first_delivered):
                            # nothing reached a server with our code: this one, up since before
                            # the first attempt that may have got anywhere, got them all
                            raise
                        # the server that had the call is gone: this one (a new pod, a restarted
                        # container) never saw it, and must not run it now
                        raise PodUnreachable(
                            f"{who} was restarted or replaced while the call ran "
                            f"(the server now there says: {e}); the call was lost "
                            "with it"
                        ) from e
                    accepted = True
                    return frames.read(resp.iter_raw())
            except (httpx.ReadTimeout, httpx.PoolTimeout):
                raise
            except (httpx.TransportError, ProtocolError, ProxyRefusal) as e:
                if not delivered and not (
                    isinstance(e, httpx.ConnectError)
                    or (isinstance(e, ProxyRefusal) and e.undelivered)
                ):
                    delivered, first_delivered = True, sent_at
                now = time.monotonic()
                window_end = window_end or now + RESUME_WINDOW_S
                if now >= window_end:
                    if isinstance(e, ProxyRefusal):
                        raise PodUnreachable(
                            f"{who} is not reachable through the proxy (HTTP "
                            f"{e.status}: {e.text[:300]})",
                            delivered=delivered,
                        ) from e
                    raise PodUnreachable(
                        f"lost the connection to {who} and could not re-attach to "
                        f"the call within {RESUME_WINDOW_S:g}s: {e!r}",
                        delivered=delivered,
                    ) from e
                attempt += 1
                self.reattempts += 1
                time.sleep(min(0.01 * 2**attempt, 0.5))


def _up_since(resp: httpx.Response, since: float, margin: float = 0.1) -> bool:
    """Whether the server that answered ``resp`` was already up at ``since`` (monotonic), by
    the uptime it reports (from its process's start, in clock ticks), with ``margin``
    seconds to spare for the clocks' granularity. A server answers only after its boot
    (imports, bind: ~0.5 s), so one that got an attempt sent at ``since`` started well
    before it."""
    try:
        uptime = float(resp.headers.get(UPTIME_HEADER, ""))
    except ValueError:
        return False
    return uptime > time.monotonic() - since + margin


def _chunks(parts: list[Any]) -> Iterator[bytes]:
    # a generator: httpx sends it with Transfer-Encoding: chunked
    # httpx writes each chunk as it is; a memoryview saves a copy (the checker wants bytes)
    yield from envelope.chunked(parts, size=1 << 20)  # type: ignore[misc]


def _sending(chunks: Iterator[Any], size: int, who: str) -> Iterator[Any]:
    """``chunks`` as they go; a large body (a GiB argument takes seconds through a proxy)
    shows a bar once it has lasted a second."""
    if size < PROGRESS_BYTES:
        yield from chunks
        return
    bar = Progress(f"sending to {who}", size, delay_s=1.0)
    for chunk in chunks:
        bar.add(memoryview(chunk).nbytes)
        yield chunk
    bar.close()
