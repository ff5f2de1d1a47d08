"""The storage verbs of the fake API server: get, list, create, update, patch, delete and
deletecollection of stored objects, with resourceVersions, owners and a pod's end.

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import copy
import json
import uuid

import httpx
from kube_fake_api import (
    _HAS_STATUS,
    _NODES,
    _RESOURCES,
    _RETURNS_OBJECT,
    ApiError,
    Obj,
    _bad,
    _conflict,
    _details,
    _hash,
    _invalid,
    _json,
    _labels,
    _not_found,
    _qualified,
    field_selector_matches,
    label_selector_matches,
    merge_patch,
)
from kube_fake_pods import (
    PodState,
    _PodMeta,
    _steps,
)


class Storage:
    @staticmethod
    def _resource(kind: str) -> str:
        k = kind.lower()
        if k in ("ksvc", "knativeservice", "knativeservices"):
            return "ksvc"
        if k == "hpa":
            return "horizontalpodautoscalers"
        for res in (k, k + "s"):
            if res in _RESOURCES:
                return res
        raise KeyError(f"unknown kind {kind!r}; one of {sorted(_RESOURCES)}")

    @staticmethod
    def _body(content: bytes) -> Obj:
        try:
            body = json.loads(content)
        except ValueError as err:
            raise _bad(f"the request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def _get(self, res: str, ns: str, name: str) -> Obj:
        obj = self._store.get((res, ns, name))
        if obj is None:
            raise _not_found(res, name)
        return obj

    def _select(self, res: str, ns: str | None, query: dict[str, str]) -> list[Obj]:
        return [
            o
            for (r, n, _), o in sorted(self._store.items())
            if r == res
            and ns in (None, n)
            and label_selector_matches(query.get("labelSelector"), _labels(o))
            and field_selector_matches(query.get("fieldSelector"), o)
        ]

    def _list(
        self, res: str, ns: str | None, query: dict[str, str], objs: list[Obj] | None = None
    ) -> Obj:
        items = [
            {k: v for k, v in o.items() if k not in ("kind", "apiVersion")}
            for o in (self._select(res, ns, query) if objs is None else objs)
        ]
        api_version, kind = _RESOURCES[res]
        items, meta = self.pages.page(query, items, self._last_rv())  # limit, continue
        return {"kind": kind + "List", "apiVersion": api_version, "metadata": meta, "items": items}

    def _create(self, res: str, ns: str, body: Obj) -> Obj:
        if ns not in self.namespaces:
            raise ApiError(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        self._check_body(res, ns, body)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + _hash(str(uuid.uuid4()), 5)
        name = meta.get("name") or ""
        if not name:
            raise _invalid(
                res,
                name,
                "metadata.name",
                "Required value: name or generateName is required",
                "FieldValueRequired",
            )
        if (res, ns, name) in self._store:
            qualified = _qualified(res)
            raise ApiError(
                409, "AlreadyExists", f'{qualified} "{name}" already exists', _details(res, name)
            )
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(k, None)
        obj["apiVersion"], obj["kind"] = _RESOURCES[res]
        meta.update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_rv(),
            creationTimestamp=self._iso(),
        )
        self._prepare(res, obj, None)
        if res in ("pods", "statefulsets", "deployments", "ksvc", "horizontalpodautoscalers"):
            meta["generation"] = 1
        self._store[(res, ns, name)] = obj
        if res == "pods":
            now = self.clock()
            n = next(self._counter)
            self._pods[meta["uid"]] = _PodMeta(
                self._script_for(obj), now, now, f"10.244.{n // 250}.{n % 250 + 2}", _NODES[n % 3]
            )
        if res == "statefulsets":
            self._current_rev[meta["uid"]] = self._revision(obj)
        return obj

    def _script_for(self, pod: Obj) -> list[tuple[float, PodState]]:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if key in self._overrides:
            return _steps(self._overrides[key])
        return _steps(self.pod_behavior(copy.deepcopy(pod)) if self.pod_behavior else None)

    def _update(self, res: str, ns: str, name: str, body: Obj) -> Obj:
        old = self._get(res, ns, name)
        self._check_body(res, ns, body)
        meta = body.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise _bad(
                f"the name of the object ({meta['name']}) does not match the name on the "
                f"URL ({name})"
            )
        if meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise _conflict(
                res,
                name,
                "the object has been modified; please apply your changes "
                "to the latest version and try again",
            )
        if meta.get("uid") not in (None, "", old["metadata"]["uid"]):
            raise _conflict(
                res,
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        new = copy.deepcopy(body)
        new["apiVersion"], new["kind"] = _RESOURCES[res]
        for k in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if k in old["metadata"]:
                new["metadata"][k] = old["metadata"][k]
            else:
                new["metadata"].pop(k, None)
        if res in _HAS_STATUS:
            new["status"] = copy.deepcopy(old.get("status", {}))
        self._prepare(res, new, old)
        if new == old:
            return old  # a no-op write keeps its resourceVersion
        if "generation" in old["metadata"] and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._store[(res, ns, name)] = new
        return new

    def _patch(
        self, res: str, ns: str, name: str, content: bytes, ctype: str, query: dict[str, str]
    ) -> httpx.Response:
        kind = ctype.split(";")[0].strip()
        if kind not in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
            "application/apply-patch+yaml",
        ):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an "
                f"unknown format - accepted media types include: "
                f"application/merge-patch+json, application/strategic-merge-patch+json, "
                f"application/apply-patch+yaml (fake API server; got {kind!r})",
            )
        patch = self._body(content)
        if kind == "application/apply-patch+yaml":  # JSON is YAML; the fake takes JSON only
            if not query.get("fieldManager"):
                raise _invalid(
                    res,
                    name,
                    "fieldManager",
                    "Required value: is required for apply patch",
                    "FieldValueRequired",
                )
            if patch.get("metadata", {}).get("name") != name:
                raise _bad(f"the name of the object does not match the name on the URL ({name})")
            if (res, ns, name) not in self._store:
                return _json(201, self._create(res, ns, patch))
        old = self._get(res, ns, name)
        merged = merge_patch(old, patch, strategic=kind != "application/merge-patch+json")
        return _json(200, self._update(res, ns, name, merged))

    def _delete(self, res: str, ns: str, name: str, opts: Obj) -> Obj:
        obj = self._get(res, ns, name)
        pre = opts.get("preconditions") or {}
        for k in ("uid", "resourceVersion"):
            if pre.get(k) and pre[k] != obj["metadata"][k]:
                raise _conflict(
                    res,
                    name,
                    f"Precondition failed: {k} in precondition: {pre[k]}, "
                    f"{k} in object meta: {obj['metadata'][k]}",
                )
        grace = opts.get("gracePeriodSeconds")
        if res == "pods":
            return copy.deepcopy(self._delete_pod(obj, None if grace is None else int(grace)))
        if res == "persistentvolumeclaims" and self._claim_in_use(ns, name):
            # the pvc-protection finalizer: Terminating until no pod mounts it (_release_claims)
            if "deletionTimestamp" not in obj["metadata"]:
                obj["metadata"]["deletionTimestamp"] = self._iso()
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                obj["metadata"]["resourceVersion"] = self._next_rv()
            return copy.deepcopy(obj)
        del self._store[(res, ns, name)]
        policy = opts.get("propagationPolicy") or "Background"
        self._collect_dependents(ns, obj["metadata"]["uid"], orphan=policy == "Orphan")
        if res in _RETURNS_OBJECT or policy in ("Orphan", "Foreground"):
            out = copy.deepcopy(obj)
            out["metadata"]["deletionTimestamp"] = self._iso()
            if policy in ("Orphan", "Foreground"):
                out["metadata"]["finalizers"] = [
                    "orphan" if policy == "Orphan" else "foregroundDeletion"
                ]
            return out
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {**_details(res, name), "uid": obj["metadata"]["uid"]},
        }

    def _collect_dependents(self, ns: str, owner_uid: str, orphan: bool) -> None:
        for (res, n, name), obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if n != ns or not any(r.get("uid") == owner_uid for r in refs):
                continue
            kept = [r for r in refs if r.get("uid") != owner_uid]
            if orphan or kept:
                obj["metadata"]["ownerReferences"] = kept
                if not kept:
                    del obj["metadata"]["ownerReferences"]
                obj["metadata"]["resourceVersion"] = self._next_rv()
            elif (res, n, name) in self._store:
                self._delete(res, ns, name, {})

    def _delete_collection(self, res: str, ns: str, query: dict[str, str], content: bytes) -> Obj:
        opts = self._body(content) if content else {}
        deleted = []
        for obj in self._select(res, ns, query):
            out = self._delete(res, ns, obj["metadata"]["name"], opts)
            deleted.append(obj if out.get("kind") == "Status" else out)
        return self._list(res, ns, query, deleted)

    def _delete_pod(self, pod: Obj, grace: int | None) -> Obj:
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        linger = min(float(grace), self.pod_termination_seconds)
        if not pod["spec"].get("nodeName"):
            linger = 0.0  # never reached a kubelet: gone at once
        now = self.clock()
        pod_meta = self._pods[meta["uid"]]
        if "deletionTimestamp" not in meta or linger <= 0:
            meta["deletionTimestamp"] = self._iso(now + grace)
            meta["deletionGracePeriodSeconds"] = grace
            meta["resourceVersion"] = self._next_rv()
            pod_meta.delete_at = now + linger
        if pod_meta.delete_at is not None and pod_meta.delete_at <= now:
            self._remove_pod(pod)
        return pod

    def _remove_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        self._store.pop(("pods", meta["namespace"], meta["name"]), None)
        self._pods.pop(meta["uid"], None)
        for key in [k for k in self._logs if k[:2] == (meta["namespace"], meta["name"])]:
            del self._logs[key]
        self._collect_dependents(meta["namespace"], meta["uid"], orphan=False)
