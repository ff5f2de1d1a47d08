"""What the fake API server checks and defaults on a write: the validations backends most
often trip on (names, labels, containers, a StatefulSet's selector and immutable spec...).

Mixed into ``kube_fake.FakeKube``."""

from __future__ import annotations

import base64
from typing import Any

from kube_fake_api import (
    _DNS1035,
    _DNS1123,
    _LABEL_VALUE,
    _RESOURCES,
    _STS_MUTABLE,
    MAX_SECRET_BYTES,
    Obj,
    _bad,
    _invalid,
    _normalize_image,
    _qos,
)


class Checks:
    def _check_body(self, res: str, ns: str, obj: Obj) -> None:
        api_version, kind = _RESOURCES[res]
        if obj.get("kind", kind) != kind or obj.get("apiVersion", api_version) != api_version:
            raise _bad(
                f"the body is a {obj.get('apiVersion')}/{obj.get('kind')}, "
                f"this endpoint takes {api_version}/{kind}"
            )
        if obj.get("metadata", {}).get("namespace", ns) != ns:
            raise _bad(
                "the namespace of the provided object does not match the namespace sent "
                "on the request"
            )

    def _prepare(self, res: str, obj: Obj, old: Obj | None) -> None:
        meta, name = obj["metadata"], obj["metadata"]["name"]
        pattern, what = (
            (_DNS1035, "a DNS-1035 label")
            if res in ("services", "ksvc")
            else (_DNS1123, "a lowercase RFC 1123 subdomain")
        )
        too_long = len(name) > (63 if res in ("services", "ksvc") else 253)
        if old is None and (too_long or not pattern.fullmatch(name)):
            raise _invalid(
                res,
                name,
                "metadata.name",
                f'Invalid value: "{name}": {what} must '
                f"consist of lower case alphanumeric characters, '-' or '.' "
                f"(regex used for validation is '{pattern.pattern}')",
            )
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
                raise _invalid(
                    res,
                    name,
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid '
                    f"label value must be 63 characters or less, alphanumeric, '-', '_' "
                    f"or '.', starting and ending with an alphanumeric (key {key!r})",
                )
        spec = obj.get("spec")
        if res == "pods":
            self._pod_spec(res, name, spec, "spec")
            if old is None:
                obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}
            elif old["spec"].get("nodeName"):
                spec.setdefault("nodeName", old["spec"]["nodeName"])
        elif res == "statefulsets":
            self._sts_spec(name, spec, old)
            if old is None:
                obj["status"] = {"replicas": 0, "availableReplicas": 0}
        elif res == "deployments":
            self._deployment_spec(name, spec, old)
            if old is None:
                obj["status"] = {}
        elif res == "horizontalpodautoscalers":
            self._hpa_spec(name, spec)
            if old is None:
                obj["status"] = {"currentReplicas": 0, "desiredReplicas": 0}
        elif res == "ksvc":
            self._ksvc_spec(name, spec)
            if old is None:
                obj["status"] = {}
        elif res == "secrets":
            obj.setdefault("type", "Opaque")
            for k, v in (obj.pop("stringData", None) or {}).items():
                obj.setdefault("data", {})[k] = base64.b64encode(v.encode()).decode()
            # the API server's limit on a Secret's data, decoded (MaxSecretSize)
            size = sum(len(base64.b64decode(v)) for v in (obj.get("data") or {}).values())
            if size > MAX_SECRET_BYTES:
                raise _invalid(
                    "secrets",
                    name,
                    "data",
                    f"Too long: may not be more than {MAX_SECRET_BYTES} bytes",
                )
        elif res == "services":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            old_ip = (old or {}).get("spec", {}).get("clusterIP")
            n = next(self._seq) if old_ip is None and "clusterIP" not in spec else 0
            spec.setdefault("clusterIP", old_ip or f"10.96.{n // 250}.{n % 250 + 2}")
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
            for k, v in (
                ("sessionAffinity", "None"),
                ("ipFamilies", ["IPv4"]),
                ("ipFamilyPolicy", "SingleStack"),
                ("internalTrafficPolicy", "Cluster"),
            ):
                spec.setdefault(k, v)
            for port in spec.get("ports", []):
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            obj.setdefault("status", {"loadBalancer": {}})
        elif res == "persistentvolumeclaims":
            spec = obj.setdefault("spec", {})
            spec.setdefault("storageClassName", "standard")
            spec.setdefault("volumeMode", "Filesystem")
            spec.setdefault("volumeName", "pvc-" + meta["uid"])
            size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
            bound = {
                "phase": "Bound",
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "capacity": {"storage": size},
            }
            if old is not None:
                obj["status"] = old.get("status") or bound
            elif self.pvc_bind_seconds > 0 or "does-not-exist" in spec["storageClassName"]:
                obj["status"] = {"phase": "Pending"}
                self._pvc_bind_at[(meta["namespace"], meta["name"])] = (
                    self.clock() + self.pvc_bind_seconds
                )
            else:
                obj["status"] = bound

    def _pod_spec(self, res: str, name: str, spec: Any, path: str) -> None:
        if not isinstance(spec, dict) or not spec.get("containers"):
            raise _invalid(res, name, f"{path}.containers", "Required value", "FieldValueRequired")
        for i, c in enumerate(spec["containers"]):
            for k in ("name", "image"):
                if not c.get(k):
                    raise _invalid(
                        res,
                        name,
                        f"{path}.containers[{i}].{k}",
                        "Required value",
                        "FieldValueRequired",
                    )
            c.setdefault(
                "imagePullPolicy",
                "Always" if _normalize_image(c["image"]).endswith(":latest") else "IfNotPresent",
            )
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
            for port in c.get("ports", []):
                port.setdefault("protocol", "TCP")
        for k, v in (
            ("restartPolicy", "Always"),
            ("terminationGracePeriodSeconds", 30),
            ("dnsPolicy", "ClusterFirst"),
            ("schedulerName", "default-scheduler"),
            ("serviceAccountName", "default"),
            ("securityContext", {}),
            ("enableServiceLinks", True),
            ("priority", 0),
        ):
            spec.setdefault(k, v)
        spec.setdefault("serviceAccount", spec["serviceAccountName"])

    def _sts_spec(self, name: str, spec: Any, old: Obj | None) -> None:
        res = "statefulsets"
        if not isinstance(spec, dict) or not (spec.get("selector") or {}).get("matchLabels"):
            raise _invalid(res, name, "spec.selector", "Required value", "FieldValueRequired")
        template = spec.get("template") or {}
        tlabels = template.get("metadata", {}).get("labels") or {}
        if any(tlabels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            raise _invalid(
                res,
                name,
                "spec.template.metadata.labels",
                f"Invalid value: {tlabels!r}: `selector` does not match template `labels`",
            )
        self._pod_spec(res, name, template.get("spec"), "spec.template.spec")
        if template["spec"]["restartPolicy"] != "Always":
            raise _invalid(
                res,
                name,
                "spec.template.spec.restartPolicy",
                f"Unsupported value: "
                f'"{template["spec"]["restartPolicy"]}": supported values: "Always"',
                "FieldValueNotSupported",
            )
        for k, v in (
            ("replicas", 1),
            ("podManagementPolicy", "OrderedReady"),
            ("revisionHistoryLimit", 10),
            ("updateStrategy", {"type": "RollingUpdate"}),
            (
                "persistentVolumeClaimRetentionPolicy",
                {"whenDeleted": "Retain", "whenScaled": "Retain"},
            ),
        ):
            spec.setdefault(k, v)
        if spec["updateStrategy"].get("type", "RollingUpdate") == "RollingUpdate":
            spec["updateStrategy"].setdefault("type", "RollingUpdate")
            spec["updateStrategy"].setdefault("rollingUpdate", {"partition": 0})
        if old is not None and any(
            spec.get(k) != old["spec"].get(k)
            for k in set(spec) | set(old["spec"])
            if k not in _STS_MUTABLE
        ):
            raise _invalid(
                res,
                name,
                "spec",
                "Forbidden: updates to statefulset spec for fields "
                "other than 'replicas', 'ordinals', 'template', 'updateStrategy', "
                "'revisionHistoryLimit', 'persistentVolumeClaimRetentionPolicy' and "
                "'minReadySeconds' are forbidden",
                "FieldValueForbidden",
            )

    def _selector_matches_template(self, res: str, name: str, spec: Obj) -> None:
        if not isinstance(spec, dict) or not (spec.get("selector") or {}).get("matchLabels"):
            raise _invalid(res, name, "spec.selector", "Required value", "FieldValueRequired")
        tlabels = (spec.get("template") or {}).get("metadata", {}).get("labels") or {}
        if any(tlabels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            raise _invalid(
                res,
                name,
                "spec.template.metadata.labels",
                f"Invalid value: {tlabels!r}: `selector` does not match template `labels`",
            )

    def _deployment_spec(self, name: str, spec: Any, old: Obj | None) -> None:
        res = "deployments"
        self._selector_matches_template(res, name, spec)
        self._pod_spec(res, name, spec["template"].get("spec"), "spec.template.spec")
        if spec["template"]["spec"]["restartPolicy"] != "Always":
            raise _invalid(
                res,
                name,
                "spec.template.spec.restartPolicy",
                'Unsupported value: supported values: "Always"',
                "FieldValueNotSupported",
            )
        for k, v in (
            ("replicas", 1),
            ("revisionHistoryLimit", 10),
            ("progressDeadlineSeconds", 600),
            (
                "strategy",
                {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"},
                },
            ),
        ):
            spec.setdefault(k, v)
        if old is not None and spec["selector"] != old["spec"]["selector"]:
            raise _invalid(
                res,
                name,
                "spec.selector",
                f"Invalid value: {spec['selector']!r}: field is immutable",
                "FieldValueInvalid",
            )

    def _hpa_spec(self, name: str, spec: Any) -> None:
        res = "horizontalpodautoscalers"
        ref = (spec or {}).get("scaleTargetRef") or {}
        if not ref.get("kind") or not ref.get("name"):
            raise _invalid(res, name, "spec.scaleTargetRef", "Required value", "FieldValueRequired")
        low, high = spec.setdefault("minReplicas", 1), spec.get("maxReplicas")
        if not isinstance(high, int) or high < 1:
            raise _invalid(
                res, name, "spec.maxReplicas", f"Invalid value: {high}: must be greater than 0"
            )
        if low < 1 or low > high:
            raise _invalid(
                res,
                name,
                "spec.minReplicas",
                f"Invalid value: {low}: must be between 1 and "
                "maxReplicas (0 needs the HPAScaleToZero feature gate)",
            )

    def _ksvc_spec(self, name: str, spec: Any) -> None:
        """Knative's webhook, in part: one container, at most one port, named for its protocol."""
        res = "ksvc"
        template = (spec or {}).get("template") or {}
        for c in (template.get("spec") or {}).get("containers") or []:
            if isinstance(c, dict):
                c.setdefault("name", "user-container")  # Knative names an unnamed container so
        self._pod_spec(res, name, template.get("spec"), "spec.template.spec")
        containers = template["spec"]["containers"]
        if len(containers) != 1:
            raise _invalid(
                res,
                name,
                "spec.template.spec.containers",
                f"expected exactly one, got {len(containers)}",
            )
        ports = containers[0].get("ports") or []
        if len(ports) > 1 or any(p.get("name") not in (None, "http1", "h2c") for p in ports):
            raise _invalid(
                res,
                name,
                "spec.template.spec.containers[0].ports",
                "more than one container port is set, or its name is not one of http1, h2c",
            )
