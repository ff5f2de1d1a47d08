"""The fake API server's StatefulSet controller, its pods' kubelet (scripted) and its
claims: what ``_tick`` brings up to the clock before every request.

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import copy
import re

from kube_fake_api import (
    _NODES,
    Obj,
    _hash,
    _healthy,
    _labels,
    label_selector_matches,
)
from kube_fake_pods import (
    PodCtx,
    pending,
    unschedulable,
)


class StatefulSetController:
    def _tick(self) -> None:
        """Bring pods, kubelet and controllers up to the clock, until nothing changes."""
        self.watches.run_due()
        self._bind_claims()
        for _ in range(500):
            changed = False
            for sts in [o for (r, _, _), o in self._store.items() if r == "statefulsets"]:
                changed |= self._reconcile(sts)
            for dep in [o for (r, _, _), o in self._store.items() if r == "deployments"]:
                changed |= self._reconcile_replicas(
                    dep,
                    dep["spec"]["template"],
                    int(dep["spec"].get("replicas", 1)),
                    f"{dep['metadata']['name']}-{_hash(dep['spec']['template'])}",
                )
            for ksvc in [o for (r, _, _), o in self._store.items() if r == "ksvc"]:
                changed |= self._reconcile_ksvc(ksvc)
            changed |= self._refresh_pods()
            if not changed:
                break
        for sts in [o for (r, _, _), o in self._store.items() if r == "statefulsets"]:
            self._sts_status(sts)
        for dep in [o for (r, _, _), o in self._store.items() if r in ("deployments", "ksvc")]:
            self._replicas_status(dep)
        for hpa in [o for (r, _, _), o in self._store.items() if r == "horizontalpodautoscalers"]:
            self._hpa_status(hpa)
        self._release_claims()
        self.watches.record()

    def _claim_in_use(self, ns: str, name: str) -> bool:
        """A pod that still exists (Terminating too) mounts claim ``name``."""
        return any(
            r == "pods"
            and n == ns
            and any(
                (v.get("persistentVolumeClaim") or {}).get("claimName") == name
                for v in o["spec"].get("volumes") or []
            )
            for (r, n, _), o in self._store.items()
        )

    def _release_claims(self) -> None:
        """The pvc-protection controller: a claim deleted while in use goes once no pod mounts it."""
        for (r, ns, name), obj in list(self._store.items()):
            if (
                r == "persistentvolumeclaims"
                and obj["metadata"].get("deletionTimestamp")
                and not self._claim_in_use(ns, name)
            ):
                del self._store[(r, ns, name)]

    def _bind_claims(self) -> None:
        """The volume binder: claims whose time has come get a volume (or fail to)."""
        now = self.clock()
        for (ns, name), at in list(self._pvc_bind_at.items()):
            claim = self._store.get(("persistentvolumeclaims", ns, name))
            if claim is None:
                del self._pvc_bind_at[(ns, name)]
                continue
            spec, uid = claim["spec"], claim["metadata"]["uid"]
            if "does-not-exist" in spec["storageClassName"]:
                self._event(
                    ns,
                    "PersistentVolumeClaim",
                    name,
                    uid,
                    "Warning",
                    "ProvisioningFailed",
                    f'storageclass.storage.k8s.io "{spec["storageClassName"]}" not found',
                    "persistentvolume-controller",
                )
                del self._pvc_bind_at[(ns, name)]
                continue
            if now < at:
                continue
            del self._pvc_bind_at[(ns, name)]
            claim["status"] = {
                "phase": "Bound",
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "capacity": {
                    "storage": spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
                },
            }
            claim["metadata"]["resourceVersion"] = self._next_rv()
            self._event(
                ns,
                "PersistentVolumeClaim",
                name,
                uid,
                "Normal",
                "ProvisioningSucceeded",
                f"Successfully provisioned volume {spec['volumeName']}",
                "persistentvolume-controller",
            )

    def _unbound_claims(self, pod: Obj) -> str | None:
        """The scheduler's message for a pod whose claims are missing or not bound yet."""
        ns = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            name = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not name:
                continue
            claim = self._store.get(("persistentvolumeclaims", ns, name))
            if claim is None:
                return (
                    f'0/{len(_NODES)} nodes are available: persistentvolumeclaim "{name}" not '
                    f"found. preemption: 0/{len(_NODES)} nodes are available: {len(_NODES)} "
                    "Preemption is not helpful for scheduling."
                )
            if (claim.get("status") or {}).get("phase") != "Bound":
                return (
                    f"0/{len(_NODES)} nodes are available: pod has unbound immediate "
                    f"PersistentVolumeClaims. preemption: 0/{len(_NODES)} nodes are available: "
                    f"{len(_NODES)} Preemption is not helpful for scheduling."
                )
        return None

    def _refresh_pods(self) -> bool:
        now, changed = self.clock(), False
        for pod in [o for (r, _, _), o in self._store.items() if r == "pods"]:
            md, meta = pod["metadata"], self._pods.get(pod["metadata"]["uid"])
            if meta is None:
                continue  # garbage-collected earlier in this loop
            if meta.delete_at is not None and now >= meta.delete_at:
                self._remove_pod(pod)
                changed = True
                continue
            blocked = None if pod["spec"].get("nodeName") else self._unbound_claims(pod)
            if blocked is not None:  # not schedulable yet: its script starts once it is
                meta.start = now
                index, state, since = -2, unschedulable(blocked), meta.created
            else:
                index = max(
                    (i for i, (t, _) in enumerate(meta.steps) if meta.start + t <= now), default=-1
                )
                state = meta.steps[index][1] if index >= 0 else pending()
                since = meta.start + (meta.steps[index][0] if index >= 0 else 0.0)
            ctx = PodCtx(
                pod,
                state.ip or meta.ip,
                meta.node[0],
                meta.node[1],
                self._iso(meta.created),
                self._iso(since),
            )
            status = state.status(ctx)
            scheduled = any(
                c["type"] == "PodScheduled" and c["status"] == "True"
                for c in status.get("conditions", [])
            )
            if scheduled and not pod["spec"].get("nodeName"):
                pod["spec"]["nodeName"] = meta.node[0]
                self._event(
                    md["namespace"],
                    "Pod",
                    md["name"],
                    md["uid"],
                    "Normal",
                    "Scheduled",
                    f"Successfully assigned {md['namespace']}/{md['name']} to {meta.node[0]}",
                    "default-scheduler",
                )
            if index != meta.step:
                meta.step = index
                for type_, reason, message in state.events(ctx):
                    component = "default-scheduler" if "Scheduling" in reason else "kubelet"
                    self._event(
                        md["namespace"],
                        "Pod",
                        md["name"],
                        md["uid"],
                        type_,
                        reason,
                        message,
                        component,
                    )
                for text, previous in ((state.logs, False), (state.previous_logs, True)):
                    if text is not None:
                        self._logs[(md["namespace"], md["name"], None, previous)] = text
                for cs in status.get("containerStatuses", []) if state.previous_log_lost else []:
                    gone = (cs.get("lastState") or {}).get("terminated", {}).get("containerID", "")
                    self._logs[(md["namespace"], md["name"], cs["name"], True)] = (
                        f"unable to retrieve container logs for {gone}"
                    )
            if status != pod.get("status"):
                pod["status"] = status
                md["resourceVersion"] = self._next_rv()
                changed = True
        return changed

    @staticmethod
    def _revision(sts: Obj) -> str:
        return f"{sts['metadata']['name']}-{_hash(sts['spec']['template'])}"

    def _reconcile(self, sts: Obj) -> bool:
        """The StatefulSet controller's sync, as in pkg/controller/statefulset (simplified)."""
        md, spec = sts["metadata"], sts["spec"]
        ns, name, want = md["namespace"], md["name"], int(spec.get("replicas", 1))
        start = int(
            (spec.get("ordinals") or {}).get("start", 0)
        )  # spec.ordinals.start (GA in 1.31)
        ordered = spec.get("podManagementPolicy") != "Parallel"
        revision, changed = self._revision(sts), False
        pods: dict[int, Obj] = {}
        for (r, n, pod_name), pod in list(self._store.items()):
            m = re.fullmatch(re.escape(name) + r"-(\d+)", pod_name)
            if r != "pods" or n != ns or m is None:
                continue
            refs = pod["metadata"].get("ownerReferences") or []
            owner = next((ref for ref in refs if ref.get("controller")), None)
            if owner is None and label_selector_matches(
                ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items()),
                _labels(pod),
            ):
                pod["metadata"]["ownerReferences"] = refs + [self._owner_ref(sts)]  # adopt
                pod["metadata"]["resourceVersion"] = self._next_rv()
                owner = self._owner_ref(sts)
            if owner is None or owner.get("uid") != md["uid"]:
                return changed  # someone else's pod holds the name: stuck, as for real
            pods[int(m[1])] = pod
        for i in range(start, start + want):
            if i not in pods:
                pods[i] = self._create_sts_pod(sts, i, revision)
                changed = True
                if ordered:
                    return changed
            elif ordered and not _healthy(pods[i]):
                return changed
        for i in sorted((i for i in pods if not start <= i < start + want), reverse=True):
            if not pods[i]["metadata"].get("deletionTimestamp"):
                self._controller_delete(sts, pods[i])
                changed = True
            if ordered:
                return changed
        strategy = spec.get("updateStrategy", {})
        if strategy.get("type", "RollingUpdate") != "RollingUpdate":
            return changed
        partition = int((strategy.get("rollingUpdate") or {}).get("partition", 0))
        for i in range(start + want - 1, start + partition - 1, -1):
            pod = pods.get(i)
            if pod is None:
                return changed
            if _labels(pod).get("controller-revision-hash") != revision and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                self._controller_delete(sts, pod)
                return True
            if not _healthy(pod):
                return changed
        return changed

    def _owner_ref(self, sts: Obj) -> Obj:
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": sts["metadata"]["name"],
            "uid": sts["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def _controller_delete(self, sts: Obj, pod: Obj) -> None:
        pod_name, md = pod["metadata"]["name"], sts["metadata"]
        self._delete_pod(pod, None)
        self._event(
            md["namespace"],
            "StatefulSet",
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulDelete",
            f"delete Pod {pod_name} in StatefulSet {md['name']} successful",
            "statefulset-controller",
        )

    def _create_sts_pod(self, sts: Obj, ordinal: int, revision: str) -> Obj:
        md, spec = sts["metadata"], sts["spec"]
        ns, name = md["namespace"], f"{md['name']}-{ordinal}"
        template = copy.deepcopy(spec["template"])
        tmeta = template.get("metadata") or {}
        pod_spec = template["spec"]
        pod_spec["hostname"] = name
        if spec.get("serviceName"):
            pod_spec["subdomain"] = spec["serviceName"]
        for claim in spec.get("volumeClaimTemplates") or []:
            claim_name = f"{claim['metadata']['name']}-{name}"
            if ("persistentvolumeclaims", ns, claim_name) not in self._store:
                self._create(
                    "persistentvolumeclaims",
                    ns,
                    {
                        "metadata": {
                            "name": claim_name,
                            "labels": dict(spec["selector"]["matchLabels"]),
                        },
                        "spec": copy.deepcopy(claim.get("spec", {})),
                    },
                )
            volumes = pod_spec.setdefault("volumes", [])
            if all(v.get("name") != claim["metadata"]["name"] for v in volumes):
                volumes.append(
                    {
                        "name": claim["metadata"]["name"],
                        "persistentVolumeClaim": {"claimName": claim_name},
                    }
                )
        pod_meta: Obj = {
            "name": name,
            "labels": {
                **(tmeta.get("labels") or {}),
                "controller-revision-hash": revision,
                "statefulset.kubernetes.io/pod-name": name,
                "apps.kubernetes.io/pod-index": str(ordinal),
            },
            "ownerReferences": [self._owner_ref(sts)],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        pod = self._create("pods", ns, {"metadata": pod_meta, "spec": pod_spec})
        self._event(
            ns,
            "StatefulSet",
            md["name"],
            md["uid"],
            "Normal",
            "SuccessfulCreate",
            f"create Pod {name} in StatefulSet {md['name']} successful",
            "statefulset-controller",
        )
        return pod

    def _sts_status(self, sts: Obj) -> None:
        md, spec = sts["metadata"], sts["spec"]
        update = self._revision(sts)
        pods = [
            o
            for (r, n, _), o in self._store.items()
            if r == "pods"
            and n == md["namespace"]
            and not o["metadata"].get("deletionTimestamp")
            and any(ref["uid"] == md["uid"] for ref in o["metadata"].get("ownerReferences", []))
        ]
        revs = [_labels(p).get("controller-revision-hash") for p in pods]
        ready_count = sum(_healthy(p) for p in pods)
        if revs.count(update) == len(pods) == ready_count == spec.get("replicas", 1):
            self._current_rev[md["uid"]] = update
        current = self._current_rev.get(md["uid"], update)
        status = {
            "replicas": len(pods),
            "readyReplicas": ready_count,
            "currentReplicas": revs.count(current),
            "updatedReplicas": revs.count(update),
            "availableReplicas": ready_count,
            "observedGeneration": md.get("generation", 1),
            "currentRevision": current,
            "updateRevision": update,
            "collisionCount": 0,
        }
        status = {
            k: v
            for k, v in status.items()
            if v or k in ("replicas", "availableReplicas", "collisionCount")
        }
        if status != sts.get("status"):
            sts["status"] = status
            md["resourceVersion"] = self._next_rv()
