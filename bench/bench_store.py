"""The data store (``kt.put`` / ``kt.get``), next to its floors and Ray's object store.

    python bench/bench_store.py            # 100 MB, best of 3
    python bench/bench_store.py --mb 20 --reps 2 --skip-ray

Rows, each put then get of one file of random bytes (MB = 10^6 bytes, throughput in MB/s,
best of ``--reps`` after a warm-up):

- ktlite, local backend: ``kt.put(key, path)`` / ``kt.get(key, dest)`` into
  ``$KTLITE_HOME/store`` (fsync before the rename that publishes it). Floor: ``shutil.copyfile``
  there and back, with the same fsync.
- ktlite, store server over HTTP: the path a rank on a Kubernetes pod takes (the store pod's
  server, ``python -m ktlite_server`` with ``KTLITE_STORE_ROOT``, on loopback), 1 MiB chunks
  both ways with the token. Floor: a bare uvicorn + FastAPI app that streams the upload to a
  file (fsync) and serves it back with ``FileResponse``, called with httpx streaming 1 MiB chunks.
- Ray: ``ray.put(bytes)`` / ``ray.get(ref)`` of the same bytes in its object store (shared
  memory, no disk: an in-memory peer, not like for like), in a process of its own.

Numbers are printed, never asserted; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from _rounds import LoadLog

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20


def _best(reps: int, run: Any) -> float:
    run()  # warm-up
    return min(_timed(run) for _ in range(reps))


def _timed(run: Any) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_file(path: Path, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def _copy_synced(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def bench_local(data: Path, work: Path, reps: int) -> dict[str, float]:
    import ktlite as kt

    os.environ["KTLITE_HOME"] = str(work / "home")
    out = work / "local.out"
    put = _best(reps, lambda: kt.put("bench/data", data))
    get = _best(reps, lambda: kt.get("bench/data", out))
    assert out.stat().st_size == data.stat().st_size
    floor = work / "floor"
    floor.mkdir(exist_ok=True)
    fput = _best(reps, lambda: _copy_synced(data, floor / "data"))
    fget = _best(reps, lambda: shutil.copyfile(floor / "data", work / "floor.out"))
    return {"put": put, "get": get, "floor_put": fput, "floor_get": fget}


_FLOOR_APP = textwrap.dedent("""
    import os, sys
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse
    import uvicorn

    root = sys.argv[2]
    app = FastAPI()

    @app.put("/blob/{name}")
    async def put(name: str, request: Request):
        path = os.path.join(root, name)
        with open(path + ".tmp", "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        return {"ok": True}

    @app.get("/blob/{name}")
    async def get(name: str):
        return FileResponse(os.path.join(root, name))

    open(sys.argv[3], "w").close()
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
""")


def bench_http(data: Path, work: Path, reps: int) -> dict[str, float]:
    import httpx

    import ktlite as kt
    from ktlite_server.store import remember

    port, ready = _free_port(), work / "store.ready"
    token = "bench-store-token"
    env = {**os.environ, "KTLITE_STORE_ROOT": str(work / "pvc"), "KTLITE_TOKEN": token}
    store = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ktlite_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ready-file",
            str(ready),
        ],
        env=env,
    )
    fport, fready = _free_port(), work / "floor.ready"
    (work / "floor-root").mkdir(exist_ok=True)
    floor = subprocess.Popen(
        [sys.executable, "-c", _FLOOR_APP, str(fport), str(work / "floor-root"), str(fready)]
    )
    saved = {
        k: os.environ.get(k) for k in ("KTLITE_POD_IPS_FILE", "KTLITE_BACKEND", "KTLITE_NAMESPACE")
    }
    try:
        _wait_file(ready, store, "the store server")
        _wait_file(fready, floor, "the FastAPI floor")
        time.sleep(0.5)  # uvicorn binds after the floor's ready file
        ips = work / "ktlite-pod-ips-0.json"
        os.environ.update(
            KTLITE_POD_IPS_FILE=str(ips), KTLITE_BACKEND="kubernetes", KTLITE_NAMESPACE="default"
        )
        remember(
            {
                "url": f"http://127.0.0.1:{port}",
                "token": token,
                "pod": "ktlite-store-0",
                "namespace": "default",
            },
            str(ips),
        )
        out = work / "http.out"
        put = _best(reps, lambda: kt.put("bench/data", data))
        get = _best(reps, lambda: kt.get("bench/data", out))
        assert out.stat().st_size == data.stat().st_size

        client = httpx.Client(base_url=f"http://127.0.0.1:{fport}", timeout=120)

        def fput() -> None:
            with open(data, "rb") as f:
                client.put(
                    "/blob/data", content=iter(lambda: f.read(CHUNK), b"")
                ).raise_for_status()

        def fget() -> None:
            with (
                client.stream("GET", "/blob/data") as resp,
                open(work / "floor-http.out", "wb") as f,
            ):
                resp.raise_for_status()
                for chunk in resp.iter_bytes(CHUNK):
                    f.write(chunk)

        return {
            "put": put,
            "get": get,
            "floor_put": _best(reps, fput),
            "floor_get": _best(reps, fget),
        }
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for proc in (store, floor):
            proc.terminate()
            proc.wait(10)


_RAY_PEER = textwrap.dedent("""
    import json, os, sys, time
    import ray

    size, reps = int(sys.argv[1]), int(sys.argv[2])
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             object_store_memory=max(4 * size, 200 * 10**6), _temp_dir=sys.argv[3])
    payload = os.urandom(size)

    def best(run):
        run()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
        return min(times)

    refs = []
    put = best(lambda: refs.append(ray.put(payload)))
    get = best(lambda: ray.get(refs[-1]))
    print(json.dumps({"put": put, "get": get}))
    ray.shutdown()
""")


def bench_ray(size: int, work: Path, reps: int) -> dict[str, float] | None:
    import json

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    try:
        out = subprocess.run(
            [sys.executable, "-c", _RAY_PEER, str(size), str(reps), temp],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    if out.returncode != 0:
        print(
            f"ray: skipped ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})"
        )
        return None
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-ray", action="store_true")
    args = p.parse_args()
    size = args.mb * 10**6
    with tempfile.TemporaryDirectory(prefix="ktlite-bench-store-") as tmp:
        work = Path(tmp)
        data = work / "data.bin"
        with open(data, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(10**6))
        load = LoadLog()
        with load.step("local store and its floor"):
            local = bench_local(data, work, args.reps)
        with load.step("store server over HTTP and its floor"):
            http = bench_http(data, work, args.reps)
        ray = None
        if not args.skip_ray:
            with load.step("Ray object store"):
                ray = bench_ray(size, work, args.reps)

    def mbs(seconds: float) -> str:
        return f"{size / 1e6 / seconds:8.0f} MB/s"

    print(
        f"\n{args.mb} MB, best of {args.reps} (throughput; ratio = ktlite time / peer time, < 1 is faster)"
    )
    print(load.summary())
    print(f"{'row':46} {'put':>13} {'get':>13} {'put ratio':>10} {'get ratio':>10}")
    rows = [
        ("ktlite local store (kt.put/kt.get)", local["put"], local["get"], None),
        ("  floor: copyfile + fsync / copyfile", local["floor_put"], local["floor_get"], local),
        ("ktlite store server over HTTP (as from a pod)", http["put"], http["get"], None),
        (
            "  floor: bare FastAPI stream + fsync / FileResponse",
            http["floor_put"],
            http["floor_get"],
            http,
        ),
    ]
    if ray is not None:
        rows += [("  Ray object store (ray.put/ray.get, in memory)", ray["put"], ray["get"], http)]
    for label, put, get, ours in rows:
        ratio = "" if ours is None else f"{ours['put'] / put:10.2f} {ours['get'] / get:10.2f}"
        print(f"{label:46} {mbs(put):>13} {mbs(get):>13} {ratio}")
    print(
        "load average (1 min) before -> after each step:\n"
        + "\n".join(f"  {line}" for line in load.lines())
    )


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "server")]
    main()
