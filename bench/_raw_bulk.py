"""Reference peer of ``bench_data.py``: the least a uvicorn server does to move a large body.

``POST /upload`` reads the body (``receive()`` messages) into a buffer allocated for it and
answers its length; ``GET /download?n=N`` answers N bytes from a buffer built once (sent in
4 MiB pieces, as an app streams a large answer). uvloop + httptools when installed, as the
pod server runs. Prints ``PORT <n>`` once it accepts connections; exits when its parent does.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from _raw_server import serve

PIECE = 4 << 20
_HELD: dict[int, bytes] = {}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "POST":
        size = int(dict(scope["headers"]).get(b"content-length", b"0"))
        view, got = memoryview(bytearray(size)), 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
            if not msg.get("more_body"):
                break
        body = str(got).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    n = int(scope["query_string"].decode().partition("=")[2] or 0)
    blob = memoryview(_HELD.setdefault(n, b"\x07" * n))
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(n).encode())],
        }
    )
    for i in range(0, n, PIECE):
        await send(
            {"type": "http.response.body", "body": blob[i : i + PIECE], "more_body": i + PIECE < n}
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parent-pid", type=int, default=os.getppid())
    args = p.parse_args()
    serve(app, args.parent_pid, with_pid=True)


if __name__ == "__main__":
    main()
