"""The question a destructive command asks before it deletes: one rule for every command.

A user at a terminal is asked ``[y/N]``; ``--yes`` (``-y``) skips the question. Without a
terminal (a script, CI, a pipe) there is nobody to answer, so the command refuses and says
to pass ``--yes``: data is never deleted because nobody was there to say no.
"""

from __future__ import annotations

import sys

NO_TERMINAL = 2  # the exit status of a refusal for want of a terminal (a usage error)
DECLINED = 1  # the user answered no


def confirm(*, yes: bool, command: str, question: str) -> int | None:
    """Ask ``question`` (``[y/N]`` is added) unless ``yes``; ``None`` to go ahead, else the
    exit status the command returns, having said why (nothing was deleted).

    ``command`` names what asks, for the refusal without a terminal: "teardown --all asks
    before it tears down 2 deployment(s) (a, b)".
    """
    if yes:
        return None
    if sys.stdin is None or not sys.stdin.isatty():
        print(
            f"ktlite: error: {command}, and there is no terminal to ask on: pass --yes (-y)",
            file=sys.stderr,
        )
        return NO_TERMINAL
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:  # the terminal closed (Ctrl-D): no
        answer = ""
    if answer.strip().lower() in ("y", "yes"):
        return None
    print("nothing torn down")
    return DECLINED
