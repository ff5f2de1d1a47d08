"""LIST paging of the fake API server: ``limit`` and ``continue``, as a v1.31 API server
serves them.

A LIST with ``limit=L`` answers at most ``L`` items and, when more match, a ``continue`` token
in its ``metadata`` (with ``remainingItemCount``); the token's LIST answers the next page of
the same snapshot (the first page's ``resourceVersion``: objects made or deleted since do not
show, as etcd serves a continuation at the first page's revision). Without ``limit`` the whole
list comes in one answer, as a real server sends it.

Faults and limits, for tests: ``max_page`` caps every page below the client's ``limit`` (a
server may answer fewer items than asked, even none, as long as it sends a token);
``expire()`` forgets every snapshot, so a continuation answers 410 ``Expired`` (as after
etcd's compaction); a token that was never issued, or one used with other selectors, answers
400. ``served`` counts the pages answered.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections import OrderedDict

from kube_fake_api import ApiError, Obj, _bad

KEEP = 64  # snapshots kept; an older token is expired


class Pages:
    """The snapshots behind the continue tokens the fake has issued."""

    def __init__(self) -> None:
        self.max_page: int | None = None
        self.served = 0
        self._snapshots: OrderedDict[str, tuple[str, str, str]] = OrderedDict()  # items as JSON
        self._ids = itertools.count(1)

    def expire(self) -> None:
        """Forget every snapshot: a continuation now answers 410, as after a compaction."""
        self._snapshots.clear()

    def page(self, query: dict[str, str], items: list[Obj], rv: str) -> tuple[list[Obj], Obj]:
        """The page ``query`` asks for of ``items`` (the list now, at ``rv``), and the list's
        ``metadata``. A continuation reads its snapshot, not ``items``."""
        token = query.get("continue")
        selectors = json.dumps([query.get("labelSelector"), query.get("fieldSelector")])
        start = 0
        if token:
            key, start = _decode(token)
            if key not in self._snapshots:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                )
            rv, frozen, asked = self._snapshots[key]
            items = json.loads(frozen)
            if asked != selectors:
                raise _bad("the continue token was issued for other selectors")
        limit = _limit(query.get("limit"))
        if limit is None:
            return items[start:], {"resourceVersion": rv}
        size = min(limit, self.max_page) if self.max_page else limit
        end = start + size
        self.served += 1
        meta: Obj = {"resourceVersion": rv}
        if end < len(items):
            if not token:
                key = str(next(self._ids))  # later pages read a copy: the objects change
                self._snapshots[key] = (rv, json.dumps(items), selectors)
                while len(self._snapshots) > KEEP:
                    self._snapshots.popitem(last=False)
            meta["continue"] = _encode(key, end)
            meta["remainingItemCount"] = len(items) - end
        return items[start:end], meta


def _limit(text: str | None) -> int | None:
    if text is None or text in ("", "0"):
        return None
    try:
        limit = int(text)
    except ValueError:
        raise _bad(f"limit={text!r}: not a whole number") from None
    if limit < 0:
        raise _bad(f"limit={text!r}: must be >= 0")
    return limit


def _encode(key: str, start: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"k": key, "s": start}).encode()).decode()


def _decode(token: str) -> tuple[str, int]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(data["k"]), int(data["s"])
    except (ValueError, KeyError, TypeError):
        raise _bad(f"continue key is not valid: {token[:40]!r}") from None
