"""The fake API server's Deployment (ReplicaSets folded in), Knative Service and
HorizontalPodAutoscaler controllers.

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import copy

from kube_fake_api import (
    Obj,
    _hash,
    _healthy,
    _labels,
)


class ReplicaControllers:
    def _hpa_status(self, hpa: Obj) -> None:
        """The HPA controller of a cluster without metrics-server (or a custom metrics adapter):
        it reads the target's scale, finds no metric and says so; it never scales. Once per spec
        (``observedGeneration``): a status set by ``set_status`` stays."""
        md, spec = hpa["metadata"], hpa["spec"]
        status = hpa.get("status") or {}
        if status.get("observedGeneration") == md.get("generation", 1):
            return
        ref = spec["scaleTargetRef"]
        target = (
            self._store.get(("deployments", md["namespace"], ref["name"]))
            if ref["kind"] == "Deployment"
            else None
        )
        at = self._iso()
        if target is None:
            conditions = [
                {
                    "type": "AbleToScale",
                    "status": "False",
                    "lastTransitionTime": at,
                    "reason": "FailedGetScale",
                    "message": f"the HPA controller was unable to get the "
                    f'target\'s current scale: deployments/scale.apps "{ref["name"]}" not found',
                }
            ]
            replicas = 0
        else:
            replicas = int(target["spec"].get("replicas", 1))
            metric = (spec.get("metrics") or [{}])[0]
            if metric.get("type") == "Pods":
                name = metric["pods"]["metric"]["name"]
                reason, why = (
                    "FailedGetPodsMetric",
                    (
                        f"unable to get metric {name}: unable to fetch metrics from "
                        "custom metrics API: the server could not find the "
                        "metric " + name + " for pods"
                    ),
                )
            else:
                resource = (metric.get("resource") or {}).get("name", "cpu")
                reason, why = (
                    "FailedGetResourceMetric",
                    (
                        f"failed to get {resource} utilization: unable to get metrics for resource {resource}: "
                        "unable to fetch metrics from resource metrics API: the server could not find the requested "
                        "resource (get pods.metrics.k8s.io)"
                    ),
                )
            conditions = [
                {
                    "type": "AbleToScale",
                    "status": "True",
                    "lastTransitionTime": at,
                    "reason": "SucceededGetScale",
                    "message": "the HPA controller was able to get the target's current scale",
                },
                {
                    "type": "ScalingActive",
                    "status": "False",
                    "lastTransitionTime": at,
                    "reason": reason,
                    "message": f"the HPA was unable to compute the replica count: {why}",
                },
            ]
        hpa["status"] = {
            "observedGeneration": md.get("generation", 1),
            "currentReplicas": replicas,
            "desiredReplicas": 0,
            "conditions": conditions,
        }
        md["resourceVersion"] = self._next_rv()

    def _owned(self, owner: Obj) -> list[Obj]:
        md = owner["metadata"]
        return [
            o
            for (r, n, _), o in self._store.items()
            if r == "pods"
            and n == md["namespace"]
            and any(ref["uid"] == md["uid"] for ref in o["metadata"].get("ownerReferences", []))
        ]

    def _reconcile_replicas(
        self,
        owner: Obj,
        template: Obj,
        want: int,
        prefix: str,
        extra_labels: dict[str, str] | None = None,
    ) -> bool:
        """A Deployment's (and its ReplicaSets', folded in) sync: ``want`` pods of ``template``
        named ``PREFIX-xxxxx``, the newest (not-ready first) removed on scale-down; pods of an older
        template go once as many of the current one are ready (maxUnavailable 0), or at once
        when none are wanted."""
        digest = _hash(template)
        pods = [p for p in self._owned(owner) if not p["metadata"].get("deletionTimestamp")]
        current = [p for p in pods if _labels(p).get("pod-template-hash") == digest]
        old = [p for p in pods if _labels(p).get("pod-template-hash") != digest]
        changed = False
        for _ in range(want - len(current)):
            self._create_replica(owner, template, digest, prefix, extra_labels or {})
            changed = True
        if len(current) > want:
            order = sorted(
                current, key=lambda p: (_healthy(p), -self._pods[p["metadata"]["uid"]].created)
            )
            for pod in order[: len(current) - want]:
                self._owner_delete(owner, pod)
                changed = True
        if old and (want == 0 or sum(_healthy(p) for p in current) >= want):
            for pod in old:
                self._owner_delete(owner, pod)
                changed = True
        return changed

    def _create_replica(
        self, owner: Obj, template: Obj, digest: str, prefix: str, extra: dict[str, str]
    ) -> Obj:
        md = owner["metadata"]
        template = copy.deepcopy(template)
        tmeta = template.get("metadata") or {}
        pod_meta: Obj = {
            "generateName": f"{prefix}-",
            "labels": {**(tmeta.get("labels") or {}), **extra, "pod-template-hash": digest},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": md["name"],
                    "uid": md["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = template["spec"]
        spec.pop("containerConcurrency", None)  # Knative's, not a pod's
        pod = self._create("pods", md["namespace"], {"metadata": pod_meta, "spec": spec})
        self._event(
            md["namespace"],
            owner["kind"],
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulCreate",
            f"Created pod: {pod['metadata']['name']}",
            "replicaset-controller",
        )
        return pod

    def _owner_delete(self, owner: Obj, pod: Obj) -> None:
        md = owner["metadata"]
        self._delete_pod(pod, None)
        self._event(
            md["namespace"],
            owner["kind"],
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulDelete",
            f"Deleted pod: {pod['metadata']['name']}",
            "replicaset-controller",
        )

    def _reconcile_ksvc(self, ksvc: Obj) -> bool:
        """Knative, in short: each template is a revision NAME-0000N whose pods
        (NAME-0000N-deployment-...) number its initial scale (``autoscaling.knative.dev/
        initial-scale``, default 1), or what ``knative_scale[(ns, name)]`` says its autoscaler wants."""
        md = ksvc["metadata"]
        template = ksvc["spec"]["template"]
        revisions = self._revisions.setdefault(md["uid"], {})
        digest = _hash(template)
        number = revisions.setdefault(digest, len(revisions) + 1)
        revision = f"{md['name']}-{number:05d}"
        notes = (template.get("metadata") or {}).get("annotations") or {}
        want = self.knative_scale.get(
            (md["namespace"], md["name"]),
            int(notes.get("autoscaling.knative.dev/initial-scale", 1)),
        )
        labels = {
            "serving.knative.dev/service": md["name"],
            "serving.knative.dev/revision": revision,
            "serving.knative.dev/configuration": md["name"],
        }
        changed = self._reconcile_replicas(
            ksvc, template, want, f"{revision}-deployment-{digest[:9]}", labels
        )
        healthy = [
            p
            for p in self._owned(ksvc)
            if _healthy(p) and _labels(p).get("pod-template-hash") == digest
        ]
        ready = bool(healthy) or want == 0
        at = self._iso()
        status = {
            "observedGeneration": md.get("generation", 1),
            "latestCreatedRevisionName": revision,
            "url": f"http://{md['name']}.{md['namespace']}.example.com",
            "conditions": [
                {
                    "type": t,
                    "status": "True" if ready else "Unknown",
                    "lastTransitionTime": at,
                    **(
                        {}
                        if ready
                        else {
                            "reason": "RevisionMissing",
                            "message": f'Configuration "{md["name"]}" is waiting '
                            "for a Revision to become ready.",
                        }
                    ),
                }
                for t in ("ConfigurationsReady", "Ready", "RoutesReady")
            ],
        }
        if ready:
            status["latestReadyRevisionName"] = revision
        old = {k: v for k, v in (ksvc.get("status") or {}).items()}
        if {
            **old,
            "conditions": [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in old.get("conditions", [])
            ],
        } != {
            **status,
            "conditions": [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in status["conditions"]
            ],
        }:
            ksvc["status"] = status
            md["resourceVersion"] = self._next_rv()
        return changed

    def _replicas_status(self, owner: Obj) -> None:
        if owner["kind"] != "Deployment":
            return
        md = owner["metadata"]
        digest = _hash(owner["spec"]["template"])
        pods = [p for p in self._owned(owner) if not p["metadata"].get("deletionTimestamp")]
        ready_count = sum(_healthy(p) for p in pods)
        status = {
            "observedGeneration": md.get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": sum(_labels(p).get("pod-template-hash") == digest for p in pods),
            "readyReplicas": ready_count,
            "availableReplicas": ready_count,
            "unavailableReplicas": max(0, len(pods) - ready_count),
        }
        status = {k: v for k, v in status.items() if v or k in ("observedGeneration", "replicas")}
        if status != owner.get("status"):
            owner["status"] = status
            md["resourceVersion"] = self._next_rv()
