"""Pure: how a pod starts ktlite's server from an image that has no ktlite, without asking any
package index for it.

The client ships its own source (:mod:`ktlite.backends.shipped_source`: the ``ktlite``,
``ktlite_server`` and ``ktlite_wire`` packages, about 400 KB gzipped) in the deployment's token
Secret, with the program that unpacks it and the image's setup steps (``kt.Image.pip_install`` /
``run_bash``, which may carry an index URL with credentials: a Secret, never the pod spec).
They are mounted read-only at :data:`BOOT_DIR`; the container's bootstrap unpacks the source
into the pod's emptyDir (``/ktlite/src/<digest>``, checked against its digest) and puts it first
on ``PYTHONPATH``, so the pods run exactly the client's code whatever the image holds.

The pod spec names only the source's digest (so a new client version replaces the pods) and a
digest of the setup steps keyed by the deployment token (so changed steps replace them too, and
the digest says nothing about a password in them).

What the image must have: a Python (3.10 or newer) and the pod server's packages (fastapi,
uvicorn, httpx, cloudpickle: ``images/Dockerfile``); one without them fails at start with an
error that names what is missing and how to add it (``kt.Image(...).pip_install([...])``, which
then asks the user's index, because the user asked).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

from ktlite.backends import kube_deps
from ktlite.backends.shipped_source import UNPACK, source_bundle

BOOT_DIR = "/var/run/ktlite/boot"
BOOT_VOLUME = "ktlite-boot"
SOURCE_KEY = "source.tar.gz"
UNPACK_KEY = "unpack.py"
SETUP_KEY = "setup.json"
SOURCE_DIGEST_ENV = "KTLITE_SOURCE_DIGEST"
SETUP_FILE_ENV = "KTLITE_SETUP_FILE"
SETUP_DIGEST_ENV = "KTLITE_SETUP_DIGEST"
PLACEHOLDER = "<digest of the setup steps, keyed by the token: made at deploy time>"

# Run by the container's shell before ktlite_server.boot, with $PY the image's Python: unpacks
# the shipped source (unless freeze=True or KTLITE_INSTALL asks for an install instead). The
# directories may be moved by env (tests run it outside a pod).
UNPACK_SOURCE = rf"""BOOT=${{KTLITE_BOOT_DIR:-{BOOT_DIR}}}
SRC=${{KTLITE_STATE_DIR:-/ktlite}}/src/${SOURCE_DIGEST_ENV}
if ! "$PY" "$BOOT/{UNPACK_KEY}" "$SRC" "$SRC.tmp-$$" "${SOURCE_DIGEST_ENV}" < "$BOOT/{SOURCE_KEY}"; then
  echo "ktlite: could not unpack ktlite's source (shipped in the deployment's token Secret) into $SRC with $PY" >&2
  exit 78
fi
export PYTHONPATH="$SRC${{PYTHONPATH:+:$PYTHONPATH}}"
"""


def source_digest() -> str:
    return source_bundle()[0]


def secret_data(steps: list[list[Any]], token: str | None) -> dict[str, str]:
    """The token Secret's boot entries as ``data`` (base64), or for a plan (no token) as
    ``stringData`` placeholders that say what each holds."""
    digest, bundle = source_bundle()
    if token is None:
        shown = {
            SOURCE_KEY: f"<ktlite's source: {len(bundle) >> 10} KiB gzipped, digest {digest}>",
            UNPACK_KEY: f"<the program that unpacks it: {len(UNPACK)} bytes>",
        }
        if steps:
            shown[SETUP_KEY] = f"<{len(steps)} setup step(s) of the image>"
        return shown
    raw = {SOURCE_KEY: bundle, UNPACK_KEY: UNPACK.encode()}
    if steps:
        raw[SETUP_KEY] = json.dumps(steps).encode()
    return {k: base64.b64encode(v).decode() for k, v in raw.items()}


def setup_digest(steps: list[list[Any]], token: str | None) -> str:
    if token is None:
        return PLACEHOLDER
    text = json.dumps(steps, sort_keys=True).encode()
    return hmac.new(token.encode(), text, hashlib.sha256).hexdigest()[:16]


def wire(pod: dict[str, Any], secret: str, steps: list[list[Any]], token: str | None) -> None:
    """Give ``pod`` (a pod spec dict with one container) the boot files of Secret ``secret``
    and the env that names them, in place."""
    items = [{"key": SOURCE_KEY, "path": SOURCE_KEY}, {"key": UNPACK_KEY, "path": UNPACK_KEY}]
    env = [{"name": SOURCE_DIGEST_ENV, "value": source_digest()}]
    if steps:
        items.append({"key": SETUP_KEY, "path": SETUP_KEY})
        env += [
            {"name": SETUP_FILE_ENV, "value": f"{BOOT_DIR}/{SETUP_KEY}"},
            {"name": SETUP_DIGEST_ENV, "value": setup_digest(steps, token)},
        ]
    pod.setdefault("volumes", []).append(
        {
            "name": BOOT_VOLUME,
            "secret": {"secretName": secret, "defaultMode": 0o400, "items": items},
        }
    )
    container = pod["containers"][0]
    container.setdefault("volumeMounts", []).append(
        {"name": BOOT_VOLUME, "mountPath": BOOT_DIR, "readOnly": True}
    )
    container.setdefault("env", []).extend(env)
    kube_deps.wire(pod)
