"""The launch Secret of a served deployment on Kubernetes (``NAME-launch``): the launch that
replicas started later mount and load at boot, and its generation.

Every ``.to()`` of the service takes the next generation here, in the same write that keeps
its launch: the Secret is read, then written back with its ``resourceVersion`` as the
precondition, so of two ``.to()`` at once (two processes, two handles) one write fails with a
conflict and is done again with the next generation. The generation is kept in the
``ktlite.dev/launch-generation`` annotation (and inside the launch, where a replica reads it);
the replicas refuse a launch older than the one they hold.
"""

from __future__ import annotations

import base64
import gzip
import logging
from dataclasses import replace
from typing import Any

from ktlite.backends import kube_serving as kss
from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.errors import ConfigError, DeployError
from ktlite_wire.launch import Launch

GENERATION_ANNOTATION = "ktlite.dev/launch-generation"
# writes lost to another writer's before giving up (each loss means another .to() went ahead)
MAX_CONFLICTS = 20
logger = logging.getLogger(__name__)


def generation_of(secret: dict[str, Any] | None) -> int:
    """The generation the launch Secret holds (0: none yet)."""
    notes = ((secret or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return max(0, int(notes.get(GENERATION_ANNOTATION) or 0))
    except ValueError:
        return 0


def write(api: KubeApi, name: str, launch: Launch) -> Launch:
    """Keep ``launch`` in ``name``'s launch Secret as its next generation; returns it with
    that generation. Gzipped: the local modules that travel by value are source text."""
    secret_name = kss.launch_secret_name(name)
    for _ in range(MAX_CONFLICTS):
        secret = api.get("Secret", secret_name)
        stamped = replace(launch, generation=generation_of(secret) + 1)
        data = {kss.LAUNCH_KEY: base64.b64encode(_packed(name, stamped)).decode()}
        notes = {GENERATION_ANNOTATION: str(stamped.generation)}
        try:
            if secret is None:
                body = kss.launch_secret(name, api.namespace)
                body["metadata"]["annotations"] = notes
                api.create({**body, "data": data})
            else:
                version = secret["metadata"]["resourceVersion"]
                api.patch(
                    "Secret",
                    secret_name,
                    {"metadata": {"resourceVersion": version, "annotations": notes}, "data": data},
                )
        except KubeApiError as e:
            if e.status != 409:  # 409: another writer went first (Conflict, AlreadyExists)
                raise
            logger.debug("%s: launch Secret written by another .to() first: %s", name, e)
            continue
        return stamped
    raise DeployError(
        f"the launch Secret {secret_name} of {name!r} was changed by another writer "
        f"{MAX_CONFLICTS} times while this .to() wrote its launch: other .to() calls of the same "
        "service keep going first; let them finish and call .to() again"
    )


def _packed(name: str, launch: Launch) -> bytes:
    raw = launch.encode()
    packed = gzip.compress(raw, compresslevel=6)
    if len(packed) > kss.MAX_LAUNCH_BYTES:
        raise ConfigError(
            f"the code of served deployment {name!r} pickles to {len(raw) / 1e6:.2f} MB "
            f"({len(packed) / 1e6:.2f} MB compressed), and a replica started later reads it from "
            f"a Kubernetes Secret, which holds at most about {kss.MAX_LAUNCH_BYTES / 1e6:g} MB; "
            "bake big dependencies (data, weights, modules) into the image or a volume and load "
            "them from there"
        )
    return packed
