"""A call through a proxy (the Kubernetes API server's): a stream that breaks is re-attached by
call id, reading on from the first frame not received; the pod keeps the call running meanwhile
and never runs it twice (``PodClient.call`` for a pod it does not reach directly).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx

from ktlite.errors import NotDeployedError, PodUnreachable
from ktlite.net.call_reply import CallReply, FrameReader
from ktlite.net.connection import PROGRESS_BYTES
from ktlite.net.progress import Progress
from ktlite.net.refusals import ProxyRefusal, proxy_refusal
from ktlite_wire import envelope
from ktlite_wire.errors import ProtocolError
from ktlite_wire.headers import CALL_HEADER, LENGTH_HEADER, RESUME_HEADER, UPTIME_HEADER
from ktlite_wire.plan import CallPlan

# After a proxied call's stream breaks, re-attach attempts go on this long; the pod keeps the
# call (and waits for us) for REATTACH_S, longer, so the window always ends first.
RESUME_WINDOW_S = 5.0
REATTACH_S = 10.0
CHUNKED_MAX = 8 << 20  # proxied bodies up to this size go chunked (see call_resumable)


def call_resumable(
    http: httpx.Client,
    headers_with: Callable[[dict[str, str]], dict[str, str]],
    check: Callable[[httpx.Response, str], None],
    reattempted: Callable[[], None],
    url: str,
    plan: CallPlan,
    parts: list[Any],
    frames: FrameReader,
    who: str,
    silence: float,
) -> CallReply:
    """The call ``plan`` through ``http`` (the proxy), re-attached while its window lasts
    (``headers_with`` adds the token and version, ``check`` raises a refusal's error,
    ``reattempted`` counts each attempt sent again).

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
        headers = headers_with({CALL_HEADER: header, "content-type": "application/octet-stream"})
        if accepted:
            headers[RESUME_HEADER] = str(frames.seen)
            content: Any = b""
        elif size > CHUNKED_MAX:
            headers["content-length"] = str(size)
            content = _sending(envelope.chunked(parts), size, who)
        else:  # sent again in whole until accepted: a pod that has the call id attaches
            headers[LENGTH_HEADER] = str(size)
            content = _sending(chunks(parts), size, who)
        sent_at = time.monotonic()
        try:
            with http.stream(
                "POST", f"{url}/call", content=content, headers=headers, timeout=timeout
            ) as resp:
                refusal = proxy_refusal(resp)
                if refusal is not None:
                    raise refusal
                try:
                    check(resp, url)
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
                isinstance(e, httpx.ConnectError) or (isinstance(e, ProxyRefusal) and e.undelivered)
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
            reattempted()
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


def chunks(parts: list[Any]) -> Iterator[bytes]:
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
