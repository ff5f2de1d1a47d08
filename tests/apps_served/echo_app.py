"""A small HTTP app a served kt.app runs in tests (stdlib only): its behaviour by MODE."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("MODE", "ok")
if MODE == "exit":
    print("echo_app: cannot start: MODE=exit", flush=True)
    sys.exit(3)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: bytes, chunked: bool = False) -> None:
        self.send_response(status)
        if chunked:
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 1000):
                piece = body[i : i + 1000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/health":
            self._send(503 if MODE == "sick" else 200, MODE.encode())
        elif self.path.startswith("/headers"):
            self._send(200, json.dumps(dict(self.headers.items())).encode())
        elif self.path == "/stream":
            self._send(200, b"".join(b"line %d\n" % i for i in range(500)), chunked=True)
        else:
            self._send(200, f"hello from pod {os.environ.get('KTLITE_POD_NAME')}".encode())

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        self._send(200, self.rfile.read(length))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        print("echo_app:", format % args, flush=True)


server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print(f"echo_app: serving on {server.server_address[1]} (MODE={MODE})", flush=True)
server.serve_forever()
