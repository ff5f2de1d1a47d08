"""``python -m ktlite_server.ray_probe ADDRESS WANT TIMEOUT``: the Ray cluster's nodes as JSON.

Polls the GCS at ADDRESS every 0.1 s until WANT nodes are alive or TIMEOUT seconds pass,
then prints ``{"nodes": [{"node_id", "ip", "port", "alive", "head", "resources"}]}``. Run
by the head's pod server in a process of its own, so the server itself never imports Ray.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _nodes(client: Any) -> list[dict[str, Any]]:
    out = []
    for info in client.get_all_node_info(timeout=5).values():
        out.append(
            {
                "node_id": info.node_id.hex(),
                "ip": info.node_manager_address,
                "port": int(info.node_manager_port),
                "alive": info.state == 0,
                "head": bool(info.is_head_node),
                "resources": dict(info.resources_total),
            }
        )
    return sorted(out, key=lambda n: (not n["head"], n["ip"], n["port"]))


def main() -> None:
    address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    # Ray's own client of its GCS; ray._raylet is compiled and its stub does not list it
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    client = GcsClient(address=address)
    deadline = time.monotonic() + timeout
    while True:
        nodes = _nodes(client)
        if sum(n["alive"] for n in nodes) >= want or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    print(json.dumps({"nodes": nodes}))


if __name__ == "__main__":
    main()
