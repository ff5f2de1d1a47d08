"""The HTTP header names of the pod server's API."""

from __future__ import annotations

# Not "authorization": the Kubernetes API server consumes that header (its own credentials)
# and never forwards it through the pod proxy.
TOKEN_HEADER = "x-ktlite-token"
CALL_HEADER = "x-ktlite-call"
VERSION_HEADER = "x-ktlite-protocol"
# A body sent chunked (through the Kubernetes API server's proxy) names its length here, so
# the pod can still refuse an oversized one before reading it
LENGTH_HEADER = "x-ktlite-length"
# A caller re-attaching to a call it lost the stream of: the number of the first frame it lacks
RESUME_HEADER = "x-ktlite-resume"
# A pod refusing a call for want of code says how long its server has been up (seconds): a
# caller whose earlier attempt was cut knows then whether that attempt met this same server
UPTIME_HEADER = "x-ktlite-uptime"
# A code push relayed down the call tree (``POST /deploy``): the pods, and the subtree the
# receiving pod installs the launch on (ktlite_wire.calltree.LaunchRelay, JSON)
TREE_HEADER = "x-ktlite-tree"
# A refusal's error code (ktlite_wire.errors.ErrorCode): callers classify errors by it
ERROR_CODE_HEADER = "x-ktlite-error"


def bearer(token: str) -> str:
    return f"Bearer {token}"


# hop-by-hop headers (RFC 9110 7.6.1) and what each hop sets itself: never passed on by a
# forwarding hop (the pod server's /ports/ route, the client's port forward)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
