"""Hello, ktlite: ship one function to a pod, call it, tear the pod down.

Run from the repository root:

    python examples/hello.py

On the local backend (the default) the "pod" is a ktlite server process on this machine.
"""

from __future__ import annotations

import os
import socket

import ktlite as kt


def hello(name: str) -> str:
    # runs inside the pod's rank process, not in this script
    print(f"hello from pid {os.getpid()}")  # streamed back as "[rank 0 @ hello-0] ..."
    return f"Hello, {name}! (from {os.environ['KTLITE_POD_NAME']} on {socket.gethostname()})"


def main() -> None:
    remote = kt.fn(hello).to(kt.Compute(cpus=1))
    try:
        print(remote("world"))
    finally:
        remote.teardown()


if __name__ == "__main__":
    main()
