"""What tests ask of the fake API server directly: its objects, seeding one, scripting a
pod, log text, events, injected errors, the recorded requests, an object's status.

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import copy
import re

from kube_fake_api import (
    Obj,
    RecordedRequest,
    _Failure,
    status_body,
)
from kube_fake_pods import (
    PodScript,
)


class Conveniences:
    def objects(self, kind: str, ns: str | None = None) -> list[Obj]:
        """Stored objects of ``kind`` ("pods", "Pod", "statefulset"...), all namespaces if None."""
        res = self._resource(kind)
        with self.lock:
            self._tick()
            return [
                copy.deepcopy(o)
                for (r, n, _), o in sorted(self._store.items())
                if r == res and ns in (None, n)
            ]

    def get(self, kind: str, ns: str, name: str) -> Obj | None:
        with self.lock:
            self._tick()
            return copy.deepcopy(self._store.get((self._resource(kind), ns, name)))

    def create(self, kind: str, ns: str, body: Obj) -> Obj:
        """Seed an object as if POSTed (raises ``ApiError`` where the server would refuse)."""
        with self.lock:
            obj = copy.deepcopy(self._create(self._resource(kind), ns, body))
            self._tick()
            return obj

    def service_account_token(self, ns: str, name: str) -> str | None:
        """A token for ServiceAccount ``name`` (None if there is none), as the kubelet
        projects into a pod: the API server authorizes it by the account's Roles."""
        with self.lock:
            account = self._store.get(("serviceaccounts", ns, name))
            if account is None:
                return None
            return self.accounts.issue(ns, name, account["metadata"]["uid"])

    def set_pod_script(self, pod_name: str, script: PodScript, ns: str | None = None) -> None:
        """Script this pod name from now on, the live pod (timed from now) and any re-creation
        (timed from its creation); ``None`` goes back to ``pod_behavior``."""
        ns = ns or self.namespaces[0]
        with self.lock:
            if script is None:
                self._overrides.pop((ns, pod_name), None)
            else:
                self._overrides[(ns, pod_name)] = script
            pod = self._store.get(("pods", ns, pod_name))
            if pod is not None:
                meta = self._pods[pod["metadata"]["uid"]]
                meta.steps, meta.start, meta.step = self._script_for(pod), self.clock(), -1
                self._tick()

    def set_logs(
        self,
        pod_name: str,
        text: str,
        previous: bool = False,
        *,
        container: str | None = None,
        ns: str | None = None,
    ) -> None:
        """Log text of the pod's current (or previous) container; cleared when the pod goes."""
        with self.lock:
            self._logs[(ns or self.namespaces[0], pod_name, container, previous)] = text

    def append_logs(
        self, pod_name: str, text: str, *, container: str | None = None, ns: str | None = None
    ) -> None:
        with self.lock:
            key = (ns or self.namespaces[0], pod_name, container, False)
            self._logs[key] = self._logs.get(key, "") + text

    def add_event(
        self,
        involved_pod_name: str,
        reason: str,
        message: str,
        type: str = "Warning",
        *,
        ns: str | None = None,
        kind: str = "Pod",
        component: str = "kubelet",
    ) -> Obj:
        with self.lock:
            ns = ns or self.namespaces[0]
            res = self._resource(kind)
            obj = self._store.get((res, ns, involved_pod_name))
            return copy.deepcopy(
                self._event(
                    ns,
                    kind,
                    involved_pod_name,
                    obj["metadata"]["uid"] if obj else "",
                    type,
                    reason,
                    message,
                    component,
                )
            )

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int = 500,
        reason: str = "InternalError",
        message: str | None = None,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` requests matching (method or "*", re.search on the path)
        with this Status error, before any other processing."""
        with self.lock:
            self._failures.append(
                _Failure(
                    method.upper(),
                    re.compile(path_regex),
                    status_body(status, reason, message or f"injected {reason} ({status})"),
                    times,
                )
            )

    def find_requests(
        self, method: str | None = None, path_regex: str = ""
    ) -> list[RecordedRequest]:
        with self.lock:
            return [
                r
                for r in self.requests
                if method in (None, r.method) and re.search(path_regex, r.path)
            ]

    def set_status(self, kind: str, ns: str, name: str, status: Obj) -> None:
        """Set an object's status as its controller would (an HPA's, for tests that play it)."""
        with self.lock:
            obj = self._get(self._resource(kind), ns, name)
            obj["status"] = {
                "observedGeneration": obj["metadata"].get("generation", 1),
                **copy.deepcopy(status),
            }
            obj["metadata"]["resourceVersion"] = self._next_rv()
