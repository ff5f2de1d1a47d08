"""How ktlite names, labels and annotates a deployment's Kubernetes objects.

Everything of deployment NAME carries ``ktlite.dev/name=NAME`` (so list and teardown find it);
its token Secret is ``NAME-token``, each Secret of the user's values ``NAME-secret-KEY``
(labelled ``ktlite.dev/secret=KEY`` too). A pod template carries the hash of itself, so a
changed template replaces the pods.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ktlite.specs.podspec import PodSpec

NAME_LABEL = "ktlite.dev/name"
# the first ordinal of the pod's StatefulSet, where there are several
PART_LABEL = "ktlite.dev/part"
MANAGED_LABELS = {"app.kubernetes.io/managed-by": "ktlite"}
HASH_ANNOTATION = "ktlite.dev/pod-hash"
SECRET_LABEL = "ktlite.dev/secret"  # on the Secrets that hold the user's values: their KEY
SECRETS_ANNOTATION = "ktlite.dev/secrets-digest"  # changes (and so rolls the pods) with a value


def labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: name, **MANAGED_LABELS}


def selector(name: str) -> str:
    return f"{NAME_LABEL}={name}"


def token_secret_name(name: str) -> str:
    return f"{name}-token"


def user_secret_name(name: str, key: str) -> str:
    return f"{name}-secret-{key}"


GPU_MEMORY_ANNOTATION = "ktlite.dev/gpu-memory"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def queue_label(pod: PodSpec) -> dict[str, str]:
    """Kueue's queue label (``Compute(queue_name=...)``), on the StatefulSet and its pods."""
    queue = pod.kubernetes.queue_name
    return {QUEUE_LABEL: queue} if queue else {}


def template_hash(template: dict[str, Any]) -> str:
    """The pod hash: of the template without its own hash annotation."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
