"""A FastAPI app on a pod, in Kubetorch's form (only the import differs):

    ktlite run python examples/served_app.py            # deploys it, waits for /health
    ktlite port-forward served-hello 8000               # then: curl http://127.0.0.1:8000/
    ktlite teardown served-hello

`kt.app(port=..., health_check=...)` at the top deploys this script on a pod and returns once
GET /health answers there; on the pod (and under a plain `python served_app.py`) it returns
None and the script goes on to serve. `--port N` serves on another port.
"""

import argparse
import os

import ktlite as kt  # Kubetorch: import kubetorch as kt

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=8000)
PORT = parser.parse_args().port

kt.app(name="served-hello", port=PORT, health_check="/health", cpus="0.5")

import uvicorn  # noqa: E402  (after kt.app: the caller deploys before importing the app)
from fastapi import FastAPI  # noqa: E402

app = FastAPI()


@app.get("/health")
def health() -> dict[str, bool]:
    return {"ok": True}


@app.get("/")
def hello() -> dict[str, str]:
    return {"hello": "from a pod", "pod": os.environ.get("KTLITE_POD_NAME", "")}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
