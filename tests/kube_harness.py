"""A stand-in cluster for the Kubernetes backend: the fake API server (``kube_fake``) served
over real HTTP, with a real ``ktlite_server`` process behind each pod it creates.

    python tests/kube_harness.py DIR     # writes DIR/kubeconfig, serves until SIGTERM

Only the control plane is fake. Each pod is a real server process bound to its own loopback
address (127.X.0.10, .11, ..., a 127.X.0.0/16 the stand-in claims for itself) on the pod port, in its own UTS and mount namespace (hostname =
pod name, resolved by the pod's own /etc/hosts as the kubelet writes it; PVCs bind-mounted from DIR/pvc/<claim>; /tmp and tests/ empty, since a real pod
sees none of the caller's files), started with the env the pod spec names
(``envFrom`` Secrets, downward-API fields) and with its secret volumes' files (the token's too;
mounted read-only, on a fresh tmpfs at the pod's HOME where they go there; the Python this
machine runs from stays visible), as the user its securityContext names (``setpriv``: that
uid and gid, the fsGroup as a supplementary group that owns its volumes and group-reads its
Secret files, no capabilities, no new privileges; a fresh /root it may pass through), running
its container's own command (the real bootstrap) with an image's Python that has the server's
packages but no ktlite (``image_python``, first on PATH; for an image named
``*no-server-packages*`` a Python with nothing installed), so it runs the source (and then the
packages) the client shipped in Secrets, and reported Ready once it accepts
connections (a pod whose readinessProbe asks another path, a served replica's
``/health?ready=1``, while that path answers 200). The pod proxy forwards to it; its output becomes the pod log; deleting the pod
stops it. Images named ``*does-not-exist*`` fail to pull and CPU requests above 64 cores are
unschedulable, as on a small real cluster; a pod whose ``KTLITE_INSTALL`` names a
``*does-not-exist*`` package exits 78 and crash-loops, as the bootstrap does in an image
without ktlite that cannot install it.

A pod with a projected ServiceAccount token gets one the fake issued for its account, which
the fake authorizes by the account's Roles (``kube_rbac``); pods reach the API server at
``KTLITE_KUBE_API`` (this stand-in's address), or, with ``KTLITE_HARNESS_POD_API=unreachable``,
do not (an address that swallows connections, as the ``kubernetes`` Service's does on a
cluster without kube-proxy).

``KTLITE_HARNESS_KNATIVE=1`` makes it a cluster with Knative Serving (``kube_fake``'s ``knative``),
``KTLITE_HARNESS_CUSTOM_METRICS=1`` one with a custom metrics adapter.

Needs root (``unshare``), like the pods it imitates.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from kube_harness_pods import NAMESPACE, TOKEN, Pods  # noqa: E402
from kube_harness_sandbox import _black_hole  # noqa: E402


class Cuts:
    """Which proxied responses the pod proxy cuts short (``KTLITE_HARNESS_CUT``, e.g.
    ``sized=0.1,post=0.02``): ``sized``, requests that carry a Content-Length body (what Go's
    HTTP/1 server races on: it closes the request body while its reverse proxy still reads it,
    and the proxy then drops its connection to the pod); ``post``, any POST. GETs never."""

    def __init__(self, spec: str) -> None:
        rates = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        self.sized, self.post = float(rates.get("sized", 0)), float(rates.get("post", 0))
        self.random = random.Random(1)  # the same sequence every run
        self.lock = threading.Lock()
        self.count = 0

    def cut(self, method: str, sized: bool) -> bool:
        if method != "POST":
            return False
        with self.lock:
            draw = self.random.random()
            hit = draw < self.post or (sized and draw < self.sized)
            self.count += hit
        return hit


def serve(root: Path) -> None:
    pods = Pods(root)
    fake = pods.fake
    cuts = Cuts(os.environ.get("KTLITE_HARNESS_CUT", ""))

    class Bridge(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("content-length") or 0)
            return self.rfile.read(n) if n else b""

        def _any(self) -> None:
            sized = int(self.headers.get("content-length") or 0) > 0
            body = self._body()
            headers = [
                (k, v)
                for k, v in self.headers.items()
                if k.lower() not in ("host", "content-length", "transfer-encoding")
            ]
            resp = fake.handle_request(
                httpx.Request(
                    self.command, f"http://fake{self.path}", headers=headers, content=body
                )
            )
            # only what a pod answered is cut: the API server's own errors (503 "connection
            # refused" while a pod boots) never went through the racing copy
            if (
                "/proxy" in self.path
                and resp.extensions.get("ktlite_from_pod")
                and cuts.cut(self.command, sized)
            ):
                self._cut(resp)
                return
            self.send_response(resp.status_code)
            for k, v in resp.headers.multi_items():
                if k.lower() not in (
                    "content-length",
                    "transfer-encoding",
                    "connection",
                    "content-encoding",
                ):
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            try:
                for chunk in resp.stream:  # type: ignore[union-attr]
                    if chunk:
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            finally:
                close = getattr(resp.stream, "close", None)
                if close:
                    close()

        def _cut(self, resp: httpx.Response) -> None:
            """Drop the connection to the pod right after its response headers, as the API
            server does when Go's race hits: the caller gets a truncated chunked body."""
            self.send_response(resp.status_code)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            resp.close()  # the pod sees its client go
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Bridge)
    port = server.server_address[1]
    pods.api_url = f"http://127.0.0.1:{port}"
    if os.environ.get("KTLITE_HARNESS_POD_API") == "unreachable":
        hole = _black_hole("127.0.0.1", 0)
        pods.holes.append(hole)
        pods.api_url = f"http://127.0.0.1:{hole[0].getsockname()[1]}"
    tmp = root / "kubeconfig.tmp"
    tmp.write_text(f"""apiVersion: v1
kind: Config
current-context: harness
clusters:
- name: harness
  cluster: {{server: "http://127.0.0.1:{port}"}}
contexts:
- name: harness
  context: {{cluster: harness, user: harness, namespace: {NAMESPACE}}}
users:
- name: harness
  user: {{token: {TOKEN}}}
""")
    os.replace(tmp, root / "kubeconfig")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    finally:
        pods.stop_all()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
