"""The protocol version: a client and a pod server speak the same one, or refuse each other."""

from __future__ import annotations

# 11: the caller sends its call to one pod that needs no plan as a RUN flagged COORDINATE
#     over its link (the pod picks the process group; ``callerrun``), answered with a DONE;
#     an older pod would run it in generation 0 as a member's share.
# 10: a coordinator stops a call on the pods it sent it to with a STOP on their link, not a
#     POST /cancel; an older pod would close the link at the first STOP as a malformed message.
# 9: a coordinator sends its members that relay to no other pod a binary RUN over their
#    link, answered with a binary DONE and no head; a pod says GOAWAY before it closes an
#    idle link; an older pod would close the link at the first RUN as a malformed message.
# 8: a call result says how many ranks may still map the call's argument file (``held``),
#    and a rank's Result whether it let go of it: a caller on the pods' host writes its next
#    argument into the same file only when none does; an older pod never says so.
# 7: a relay's call plan and a relayed push's header name only the pods of its subtree
#    (``first_pod``/``first_rank``, ``first``), and a relayed push nests its children's
#    results as a call does; an older pod would index the window as the whole pod list.
# 6: a relay passes its children's call results on untouched (a result nests them:
#    ``subtrees``), and a pod's ranks that returned a value are one ``runs`` entry, not a row
#    each; an older caller would miss every nested rank. 5: a served deployment's launches carry their generation, a pod refuses an older one
#    (stale_launch; Launch.expect is gone). 4: typed JSON messages (launch, call result, rank
#    channel), error codes; the pod server never unpickles. 3: chunked bodies, re-attachable
#    calls, notices, shipped sources.
PROTOCOL_VERSION = 11
# the ktlite release this wire ships with (``ktlite.__version__``; a pod server reports it)
RELEASE = "0.1.0"

FIX = "install the same ktlite version on the client and in the pods (their image or venv)"


def mismatch(
    theirs: object,
    ours: int = PROTOCOL_VERSION,
    *,
    them: str = "the other side",
    us: str = "this side",
) -> str:
    """The message for a version clash: both versions, and what to do."""
    return f"protocol version mismatch: {them} speaks {theirs}, {us} speaks {ours}; {FIX}"
