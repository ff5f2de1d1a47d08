"""The pod server's own packages (fastapi, uvicorn, httpx, cloudpickle and what they need),
shipped by the client to pods whose image lacks them, as the SSH backend ships them to hosts:
no pod asks a package index for them.

They are this client's installed files (:func:`ktlite.backends.shipped_source.deps_bundle`,
about 4 MB gzipped), so they fit only a pod whose Python has the client's ABI and machine
(``cp311 x86_64``): the default image, ``python:<client's X.Y>-slim``, does. Only a Linux
client ships them (a laptop on macOS has other binaries; its pods need an image with the
packages, and say so at start).

A Secret holds at most 1 MiB, so the bundle is cut into parts, one Secret each,
``ktlite-deps-<key>-<i>`` (the key: the packages' versions and the ABI), shared by every
deployment in the namespace that runs this client's packages (labelled
``ktlite.dev/deps=<key>``): made once, when a ``.to()`` finds their marker
``ktlite-deps-<key>`` (a small Secret holding the copy's digest, made last) missing, and left
as a cache (``kubectl delete secret -l ktlite.dev/deps`` removes them; a later ``.to()`` makes
them again). Each pod mounts the marker and up to :data:`MAX_PARTS` parts, ``optional``, in one projected volume at :data:`DEPS_DIR`; its
bootstrap joins the parts and unpacks them into ``/ktlite/deps/<digest>`` (checked against the
digest) only when the image's Python lacks a package and has the ABI and machine they were
built for.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import platform
import sys
from functools import cache
from typing import Any

from ktlite.backends.kube_api import KubeApi, KubeApiError
from ktlite.backends.kube_labels import MANAGED_LABELS
from ktlite.backends.server_source import server_packages
from ktlite.backends.shipped_source import deps_bundle, deps_closure, deps_digest

DEPS_DIR = "/var/run/ktlite/deps"
DEPS_VOLUME = "ktlite-deps"
DEPS_LABEL = "ktlite.dev/deps"
PART_BYTES = 900 << 10  # under a Secret's 1 MiB, with room for the request around it
MAX_PARTS = 8  # what a pod mounts (optional: those that exist); a bigger bundle is not shipped
KEY_ENV = "KTLITE_DEPS_KEY"
TAG_ENV = "KTLITE_DEPS_TAG"  # the ABI and machine the parts were built for
logger = logging.getLogger(__name__)

# Run by the container's shell after the source is unpacked ($PY, $BOOT as there): the
# shipped packages go on PYTHONPATH after ktlite's source, before the image's own, only when
# the image lacks one (found without importing it: importing fastapi takes 0.4 s) and its
# Python fits them. The marker Secret holds the copy's digest.
UNPACK_DEPS = r"""if [ -n "$KTLITE_DEPS_KEY" ] && ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(p.strip()) is None for p in sys.argv[1].split(',')))" "$KTLITE_SERVER_PACKAGES"; then
  TAG=$("$PY" -c 'import platform, sys; print(sys.implementation.cache_tag, platform.machine())')
  PARTS=${KTLITE_DEPS_DIR:-/var/run/ktlite/deps}
  if [ "$TAG" != "$KTLITE_DEPS_TAG" ]; then
    echo "ktlite: the client ships the server's packages built for $KTLITE_DEPS_TAG; this image's Python is $TAG"
  elif [ ! -r "$PARTS/digest" ]; then
    echo "ktlite: the Secrets ktlite-deps-$KTLITE_DEPS_KEY-* are not mounted (deleted?); a later .to() makes them again"
  else
    WANT=$(cat "$PARTS/digest")
    DEPS=${KTLITE_STATE_DIR:-/ktlite}/deps/$WANT
    if ! cat "$PARTS"/part-* | "$PY" "$BOOT/unpack.py" "$DEPS" "$DEPS.tmp-$$" "$WANT"; then
      echo "ktlite: could not unpack the server's packages shipped in the Secrets ktlite-deps-$KTLITE_DEPS_KEY-*" >&2
      exit 78
    fi
    export PYTHONPATH="$PYTHONPATH:$DEPS"
  fi
fi
"""


def tag() -> str:
    """The ABI and machine of this client's compiled packages, as a pod's Python says them."""
    return f"{sys.implementation.cache_tag} {platform.machine()}"


def shipped() -> bool:
    """Whether this client ships its packages: only a Linux client's fit a Linux pod."""
    return sys.platform.startswith("linux")


@cache
def key() -> str:
    """The name of this client's packages: their distributions' versions and :func:`tag`
    (read from metadata; the files are read only to make the Secrets)."""
    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in deps_closure())
    return hashlib.sha256("\n".join([tag(), *names]).encode()).hexdigest()[:16]


@cache
def _parts() -> tuple[bytes, ...]:
    bundle = deps_bundle()
    return tuple(bundle[i : i + PART_BYTES] for i in range(0, len(bundle), PART_BYTES))


def secret_name(i: int) -> str:
    return f"ktlite-deps-{key()}-{i}"


def marker_name() -> str:
    """The small Secret made after every part, holding the copy's digest: its presence says
    the parts are all there, and asking for it costs no part's megabyte."""
    return f"ktlite-deps-{key()}"


def ensure(api: KubeApi) -> None:
    """Make the Secrets of the parts and the marker where the marker is missing in ``api``'s
    namespace (nothing on a client that does not ship them); another client making them at
    once is fine (409s are skipped)."""
    if not shipped() or api.get("Secret", marker_name()) is not None:
        return
    parts = _parts()
    if len(parts) > MAX_PARTS:
        logger.warning(
            "the pod server's packages are %d MiB gzipped, more than the %d Secrets a pod mounts "
            "hold: not shipped (pods need an image with them)",
            sum(len(p) for p in parts) >> 20,
            MAX_PARTS,
        )
        return
    logger.info(
        "shipping the pod server's packages (%d KiB) to namespace %s as %d Secrets",
        sum(len(p) for p in parts) >> 10,
        api.namespace,
        len(parts),
    )
    named = [(secret_name(i), {"part": part}) for i, part in enumerate(parts)]
    for name, data in [*named, (marker_name(), {"digest": deps_digest().encode()})]:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": name,
                "namespace": api.namespace,
                "labels": {**MANAGED_LABELS, DEPS_LABEL: key()},
                "annotations": {"ktlite.dev/deps-tag": tag()},
            },
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        try:
            api.create(body)
        except KubeApiError as e:
            if e.status != 409:  # 409: there already (another client, an earlier try)
                raise


def wire(pod: dict[str, Any]) -> None:
    """Give ``pod`` (a pod spec dict with one container) the parts' volume and the env the
    bootstrap reads, in place (only the package list on a client that does not ship them)."""
    container = pod["containers"][0]
    container.setdefault("env", []).append(
        {"name": "KTLITE_SERVER_PACKAGES", "value": ", ".join(server_packages())}
    )
    if not shipped():
        return
    sources = [
        {
            "secret": {
                "name": marker_name(),
                "items": [{"key": "digest", "path": "digest"}],
                "optional": True,
            }
        },
        *(
            {
                "secret": {
                    "name": secret_name(i),
                    "items": [{"key": "part", "path": f"part-{i:03d}"}],
                    "optional": True,
                }
            }
            for i in range(MAX_PARTS)
        ),
    ]
    pod.setdefault("volumes", []).append(
        {"name": DEPS_VOLUME, "projected": {"sources": sources, "defaultMode": 0o444}}
    )
    container.setdefault("volumeMounts", []).append(
        {"name": DEPS_VOLUME, "mountPath": DEPS_DIR, "readOnly": True}
    )
    container["env"] += [{"name": KEY_ENV, "value": key()}, {"name": TAG_ENV, "value": tag()}]
