"""The fake API server's pod proxy (to ``proxy_handlers``) and a Knative Service's activator.

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import copy

import httpx
from kube_fake_api import (
    ApiError,
    _bad,
    _json,
    status_body,
)


class Proxies:
    def _activator(self, request: httpx.Request, ns: str, service: str) -> httpx.Response:
        """A request through a Knative revision's Service reaches Knative's activator: with the
        routing headers its ingress sets, the revision gets a replica (played here by
        ``knative_scale``); the fake answers at once. Anything else: no such Service."""
        revision = request.headers.get("knative-serving-revision")
        for ksvc in self.objects("ksvc") if self.knative else []:
            md = ksvc["metadata"]
            if (
                md["namespace"] == ns
                and revision == service
                and service.startswith(md["name"] + "-")
                and request.headers.get("knative-serving-namespace") == ns
            ):
                key = (ns, md["name"])
                self.knative_scale[key] = max(1, self.knative_scale.get(key, 0))
                self._tick()
                return _json(200, {"status": "ok"})
        return _json(404, status_body(404, "NotFound", f'services "{service}" not found'))

    def _proxy(self, request: httpx.Request, ns: str, target: str, rest: str) -> httpx.Response:
        parts = target.split(":")
        if len(parts) > 3:
            raise _bad(f"invalid pod request {target!r}")
        scheme = parts[0] if len(parts) == 3 else "http"
        name, port = (parts[1:] if len(parts) == 3 else parts + [""])[:2]
        with self.lock:
            self._tick()
            pod = copy.deepcopy(self._get("pods", ns, name))
        if not port:
            port = next(
                (
                    str(c["ports"][0]["containerPort"])
                    for c in pod["spec"]["containers"]
                    if c.get("ports")
                ),
                "",
            )
        ip = pod["status"].get("podIP")
        if not ip:
            raise _bad("address not allowed")
        host = f"{ip}:{port or (443 if scheme == 'https' else 80)}"
        handler = self.proxy_handlers.get((name, int(port))) if port.isdigit() else None
        if handler is None:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: connect: connection refused",
            )
        query = ("?" + request.url.query.decode()) if request.url.query else ""
        headers = [
            (k, v)
            for k, v in request.headers.multi_items()
            if k.lower() not in ("authorization", "host", "content-length", "transfer-encoding")
        ]
        forwarded = httpx.Request(
            request.method,
            f"{scheme}://{host}{rest}{query}",
            headers=headers,
            content=request.content,
        )
        try:
            answer = handler(forwarded)
        except httpx.ConnectTimeout:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: i/o timeout",
            ) from None
        except httpx.ConnectError:
            raise ApiError(
                503,
                "ServiceUnavailable",
                f"error trying to reach service: dial tcp {host}: connect: connection refused",
            ) from None
        except httpx.TransportError as err:  # connected, then lost: Go says what the read saw
            raise ApiError(
                503, "ServiceUnavailable", f"error trying to reach service: read tcp {host}: {err}"
            ) from None
        # marked: a pod answered (a proxy can lose only such a response, never its own errors)
        return httpx.Response(
            answer.status_code,
            headers=answer.headers,
            stream=answer.stream,
            extensions={"ktlite_from_pod": True},
        )
