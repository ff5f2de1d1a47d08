"""Reference peer: the least a FastAPI + httpx + cloudpickle RPC can do per call.

One POST endpoint that cloudpickle-loads the body ``(args, kwargs)``, calls a no-op in the
server process and answers with the cloudpickled result. Run by ``bench.py`` as a
subprocess; prints ``PORT <n>`` once it accepts connections and exits when its parent does.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import sys

import cloudpickle
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response


def noop(*args: object, **kwargs: object) -> None:
    return None


app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.post("/call")
async def call(request: Request) -> Response:
    args, kwargs = cloudpickle.loads(await request.body())
    return Response(cloudpickle.dumps(noop(*args, **kwargs)), media_type="application/octet-stream")


async def _watch_parent(ppid: int, server: uvicorn.Server) -> None:
    while os.getppid() == ppid:
        await asyncio.sleep(0.5)
    server.should_exit = True


def serve(app: object, parent_pid: int, with_pid: bool = False, **config: object) -> None:
    """Serve ``app`` with uvicorn on a free loopback port (uvloop and httptools where
    installed) until the parent process goes; print ``PORT port loop http`` (and the pid with
    ``with_pid``) once it listens. The raw peers' shared start (``_raw_bulk.py`` too)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    server = uvicorn.Server(
        uvicorn.Config(
            app,  # type: ignore[arg-type]
            log_level="warning",
            access_log=False,
            loop=loop,
            http=http,
            lifespan="off",
            **config,  # type: ignore[arg-type]
        )
    )
    banner = f"PORT {port} {loop} {http}" + (f" {os.getpid()}" if with_pid else "")

    async def run() -> None:
        running = asyncio.get_running_loop()
        running.create_task(_watch_parent(parent_pid, server))
        serving = running.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if server.started:
            print(banner, flush=True)
        await serving

    if loop == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())
    sys.exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parent-pid", type=int, default=os.getppid())
    args = p.parse_args()
    serve(app, args.parent_pid, timeout_keep_alive=300)


if __name__ == "__main__":
    main()
