"""Watches for the fake API server (``kube_fake.FakeKube``), as a v1.31 API server serves them,
and a timeline of actions at given clock times for tests that change the cluster mid-wait.

``GET <collection>?watch=true``: ``labelSelector``, ``fieldSelector``, ``resourceVersion``
(empty or "0": every matching object as ADDED first, then the changes; a version older than
the watch cache's window: a 410 ``Expired`` ERROR event, then the end), ``timeoutSeconds``
(the server closes the watch then; default 1,800 s), ``allowWatchBookmarks`` (a BOOKMARK every
60 s and one just before the server closes the watch). The body is chunked JSON lines,
``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``; an object that stops
matching the selector is DELETED for that watch, one that starts is ADDED.

Changes are recorded at the end of each of the fake's ticks (``record``): several changes to
one object between two ticks are one event, as a watch that falls behind sees them.

Time: on a ``FakeClock`` a waiting watch moves the clock itself, to the next scheduled change
(a pod script's next step, a pod's end of termination, a claim binding, a timeline action)
or its own end, so a client blocked on it sees time pass as on a cluster; on a real clock it
waits, looking again every 0.1 s (pod states may follow real processes).

Faults, for tests: ``compact()`` forgets the history (a resume gets 410, as after etcd
compaction); ``drop()`` cuts every open watch (the client sees the chunked body end early);
``stall()`` makes open and new watches go silent, past their ``timeoutSeconds``: on a
``FakeClock`` the clock moves by the client's read timeout and the read times out, as a real
transport's would; on a real clock the client's own read timeout ends them.
"""

from __future__ import annotations

import bisect
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from kube_fake import FakeKube

Obj = dict[str, Any]
HISTORY = 200_000  # events kept: a resume from before the oldest gets 410
BOOKMARK_S = 60.0
DEFAULT_TIMEOUT_S = 1800.0
UNRECORDED = {"events"}  # no one watches them here; they are the most numerous objects


class Watches:
    """The fake's watch cache (every change since it began, up to ``HISTORY``), its open
    watches, and its timeline."""

    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake
        self.rvs: list[int] = []  # the events' resourceVersions, ascending
        self.events: list[tuple[str, str, Obj, Obj | None]] = []  # (type, res, object, old)
        self.oldest = 0  # a watch may start at any version >= this
        self.seen: dict[tuple[str, str, str], tuple[str, Obj]] = {}  # key -> (rv, copy)
        self.timeline: list[tuple[float, Callable[[], None]]] = []
        self.changed = threading.Condition(fake.lock)
        self.opened = 0  # watches served (tests count them)
        self._epoch = 0  # drop() moves it: open watches of an older epoch end
        self._stalled = False
        self.read_timeout: float | None = None  # the current request's (handle_request sets it)

    # ---- test controls -------------------------------------------------------------------
    def schedule(self, at: float, action: Callable[[], None]) -> None:
        """Run ``action`` (under the fake's lock) once the clock reaches ``at``."""
        with self.fake.lock:
            self.timeline.append((at, action))
            self.timeline.sort(key=lambda item: item[0])

    def compact(self) -> None:
        with self.fake.lock:
            self.oldest = int(self.fake._last_rv()) + 1
            self.rvs, self.events = [], []

    def drop(self) -> None:
        with self.fake.lock:
            self._epoch += 1
            self.changed.notify_all()

    def stall(self, on: bool = True) -> None:
        with self.fake.lock:
            self._stalled = on
            self.changed.notify_all()

    # ---- the fake's hooks (under its lock) ---------------------------------------------------
    def run_due(self) -> None:
        now = self.fake.clock()
        while self.timeline and self.timeline[0][0] <= now:
            _, action = self.timeline.pop(0)
            action()

    def record(self) -> None:
        """Compare the store with what was seen; every difference is an event."""
        store, new = self.fake._store, []
        for key, obj in store.items():
            if key[0] in UNRECORDED:
                continue
            rv = obj["metadata"].get("resourceVersion", "")
            old = self.seen.get(key)
            if old is not None and old[0] == rv:
                continue
            if old is not None and old[1]["metadata"].get("uid") != obj["metadata"].get("uid"):
                # a successor under the same name: the predecessor's end comes first
                new.append((int(rv), 0, "DELETED", key, old[1], None))
                old = None
            snapshot = copy.deepcopy(obj)
            self.seen[key] = (rv, snapshot)
            kind = "ADDED" if old is None else "MODIFIED"
            new.append((int(rv), 1, kind, key, snapshot, None if old is None else old[1]))
        for key in [k for k in self.seen if k not in store]:
            _, last = self.seen.pop(key)
            gone = copy.deepcopy(last)
            gone["metadata"]["resourceVersion"] = rv = self.fake._next_rv()
            new.append((int(rv), 0, "DELETED", key, gone, None))
        if not new:
            return
        for rv_, _, kind, key, obj, old_obj in sorted(new, key=lambda e: e[:2]):
            self.rvs.append(rv_)
            self.events.append((kind, key[0] + "/" + key[1], obj, old_obj))
        if len(self.rvs) > HISTORY:
            cut = len(self.rvs) - HISTORY
            self.oldest = self.rvs[cut - 1] + 1
            del self.rvs[:cut], self.events[:cut]
        self.changed.notify_all()

    def next_change_at(self) -> float | None:
        """The clock time of the next scheduled change (None: nothing is scheduled)."""
        fake, times = self.fake, [t for t, _ in self.timeline[:1]]
        for meta in fake._pods.values():
            if meta.delete_at is not None:
                times.append(meta.delete_at)
            later = [meta.start + t for i, (t, _) in enumerate(meta.steps) if i > meta.step]
            times += later[:1]
        times += list(fake._pvc_bind_at.values())
        now = fake.clock()
        future = [t for t in times if t > now]
        return min(future) if future else None

    def serve(self, res: str, ns: str | None, query: dict[str, str]) -> httpx.Response:
        """A watch's response; its body is produced as the client reads it."""
        self.opened += 1
        return httpx.Response(
            200,
            headers={"content-type": "application/json", "transfer-encoding": "chunked"},
            stream=_WatchStream(self, res, ns, query, self.read_timeout),
        )


def _line(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


class _WatchStream(httpx.SyncByteStream):
    def __init__(
        self, watches: Watches, res: str, ns: str | None, query: dict[str, str], read: Any
    ) -> None:
        self.w, self.res, self.ns, self.query = watches, res, ns, query
        self.read_timeout = float(read) if read else 30.0
        self.bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        self.timeout = float(query.get("timeoutSeconds") or DEFAULT_TIMEOUT_S)

    def _matches(self, obj: Obj | None, res: str) -> bool:
        from kube_fake_api import _labels, field_selector_matches, label_selector_matches

        if obj is None:
            return False
        kind, ns = res.split("/", 1)
        return (
            kind == self.res
            and self.ns in (None, ns)
            and label_selector_matches(self.query.get("labelSelector"), _labels(obj))
            and field_selector_matches(self.query.get("fieldSelector"), obj)
        )

    def _pending(self, cursor: int) -> tuple[list[bytes], int]:
        w, out = self.w, []
        start = bisect.bisect_right(w.rvs, cursor)
        for rv, (kind, res, obj, old) in zip(w.rvs[start:], w.events[start:], strict=True):
            cursor = rv
            was, now = self._matches(old, res), self._matches(obj, res)
            if kind == "DELETED":
                if now:
                    out.append(_line("DELETED", obj))
            elif now:
                out.append(_line("MODIFIED" if was else "ADDED", obj))
            elif was:
                out.append(_line("DELETED", obj))
        return out, cursor

    def _bookmark(self) -> bytes:
        api_version, kind = _resource(self.res)
        meta = {"resourceVersion": self.w.fake._last_rv()}
        return _line("BOOKMARK", {"kind": kind, "apiVersion": api_version, "metadata": meta})

    def __iter__(self) -> Iterator[bytes]:
        w, fake = self.w, self.w.fake
        expired = None
        with fake.lock:
            fake._tick()
            epoch, end = w._epoch, fake.clock() + self.timeout
            version = self.query.get("resourceVersion") or "0"
            cursor = int(fake._last_rv()) if version == "0" else int(version)
            lines = []
            if version == "0":  # the state first, then the changes
                lines = [_line("ADDED", o) for o in fake._select(self.res, self.ns, self.query)]
            elif cursor < w.oldest - 1:
                expired = _line("ERROR", _expired(cursor, w.oldest))
        if expired is not None:
            yield expired
            return
        if lines:
            yield b"".join(lines)
        bookmark_at = fake.clock() + BOOKMARK_S
        while True:
            with fake.lock:
                fake._tick()
                dropped, stalled = w._epoch != epoch, w._stalled
                if not stalled and cursor < w.oldest - 1:
                    expired = _line("ERROR", _expired(cursor, w.oldest))
                elif not stalled:
                    lines, cursor = self._pending(cursor)
                now = fake.clock()
            if dropped:
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body "
                    "(incomplete chunked read)"
                )
            if expired is not None:
                yield expired
                return
            if stalled:
                self._stall(end)
                return
            if lines:
                yield b"".join(lines)
                continue
            if now >= end:
                if self.bookmarks:
                    yield self._bookmark()
                return
            if self.bookmarks and now >= bookmark_at:
                bookmark_at = now + BOOKMARK_S
                yield self._bookmark()
                continue
            self._wait(min(end, bookmark_at) if self.bookmarks else end)

    def _wait(self, until: float) -> None:
        fake = self.w.fake
        advance = getattr(fake.clock, "advance", None)
        with fake.lock:
            if advance is None:  # a real clock: wait for a change, or look again soon
                self.w.changed.wait(timeout=max(0.0, min(0.1, until - fake.clock())))
                return
            at = self.w.next_change_at()
            advance(max(0.0, min(until, at if at is not None else until) - fake.clock()))

    def _stall(self, end: float) -> None:
        fake = self.w.fake
        advance = getattr(fake.clock, "advance", None)
        if advance is not None:  # the client's transport gives up after its read timeout
            with fake.lock:
                advance(self.read_timeout)
            raise httpx.ReadTimeout("timed out")
        # silent, past its own end, as a stalled watch is: the client's read timeout ends it
        # (bounded, so a client that never gives up does not hold this thread for ever)
        while self.w._stalled and fake.clock() < end + 600:
            time.sleep(0.05)


def _resource(res: str) -> tuple[str, str]:
    from kube_fake_api import _RESOURCES

    return _RESOURCES[res]


def _expired(cursor: int, oldest: int) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {cursor} ({oldest - 1})",
        "reason": "Expired",
        "code": 410,
    }
