"""Pure: what every pod ktlite makes on Kubernetes gets for its safety, in one place.

- **A non-root user** (``Compute(run_as_user=...)``, default 1000): ``runAsNonRoot``, that user
  and group, ``fsGroup`` (so the kubelet makes mounted volumes and Secret files readable by
  it), no privilege escalation, every capability dropped, the runtime's default seccomp
  profile. ``run_as_user=0`` runs the pods as root with the runtime's default capabilities,
  for images that need it; the seccomp profile stays.
- **No service-account token** mounted, unless the Compute names a ServiceAccount (its code
  means to use it).
- **A writable home** at :data:`POD_HOME` (an emptyDir, ``HOME``), whatever users the image
  has: pip's user site, torch's and Hugging Face's caches go there, and file secrets, as
  links into their Secret volumes (:data:`LINK_SECRET_FILES`).
- **The deployment token as a file** (:data:`TOKEN_FILE`, a Secret volume, ``defaultMode``
  0400), never an environment variable, which ``/proc/1/environ`` would show to user code.
  With ``fsGroup`` the kubelet adds group read (the file is ``0440``, owned by root and the
  pods' group): a Secret file's owner is root, so without it a non-root server could not
  read it.
"""

from __future__ import annotations

from typing import Any

from ktlite.specs.kube_options import KubernetesOptions

POD_HOME = "/home/ktlite"  # HOME of every pod (an emptyDir); where file secrets go
TOKEN_DIR = "/var/run/ktlite/token"
TOKEN_FILE = f"{TOKEN_DIR}/token"
TOKEN_VOLUME = "ktlite-token"
HOME_VOLUME = "ktlite-home"
SECRETS_DIR = "/var/run/ktlite/secrets"  # a secret's files: its volume mounted here, by name
LINKS_ENV = "KTLITE_SECRET_LINKS"  # lines "LINK=TARGET": each file secret's place in the home
# Run first by the container (as the pods' user): each file secret appears at its place in
# the home as a link into its Secret volume. The directories on the way are the user's own, so
# ~/.ssh (known_hosts), ~/.kube (kubectl's cache) and ~/.config/gcloud stay writable; a Secret
# file mounted there directly would make the runtime create them, root's and read-only.
LINK_SECRET_FILES = r"""if [ -n "$KTLITE_SECRET_LINKS" ]; then
  printf '%s\n' "$KTLITE_SECRET_LINKS" | while IFS='=' read -r link target; do
    [ -n "$link" ] || continue
    mkdir -p "${link%/*}" && ln -sfn "$target" "$link"
  done
fi
"""


def pod_security(kube: KubernetesOptions) -> dict[str, Any]:
    """The pod-level fields: ``securityContext`` and ``automountServiceAccountToken``."""
    uid = kube.run_as_user
    context: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if uid:
        context.update(
            runAsNonRoot=True,
            runAsUser=uid,
            runAsGroup=uid,
            fsGroup=uid,
            # a volume whose root already has the group is not walked again at each mount
            fsGroupChangePolicy="OnRootMismatch",
        )
    else:
        context.update(runAsUser=0, runAsGroup=0)
    out: dict[str, Any] = {"securityContext": context}
    if not kube.service_account:
        out["automountServiceAccountToken"] = False
    return out


def container_security(kube: KubernetesOptions) -> dict[str, Any]:
    """The container's ``securityContext``: nothing to escalate to, no capabilities."""
    if not kube.run_as_user:  # root asked for: the runtime's defaults (apt-get needs them)
        return {}
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def token_volume(secret: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod volume, container mount) that give the server its token at :data:`TOKEN_FILE`."""
    volume = {
        "name": TOKEN_VOLUME,
        "secret": {
            "secretName": secret,
            "defaultMode": 0o400,
            "items": [{"key": "token", "path": "token"}],
        },
    }
    return volume, {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}


def home_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod volume, container mount) of the pods' writable home, :data:`POD_HOME`."""
    return {"name": HOME_VOLUME, "emptyDir": {}}, {"name": HOME_VOLUME, "mountPath": POD_HOME}


def env() -> list[dict[str, Any]]:
    """The container's env entries these settings need (paths, never the token)."""
    return [
        {"name": "KTLITE_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "HOME", "value": POD_HOME},
    ]


def harden(pod: dict[str, Any], kube: KubernetesOptions, token_secret: str) -> None:
    """Give ``pod`` (a pod spec dict with one container) the volumes and security settings
    above, in place (its env: :func:`env`)."""
    container = pod["containers"][0]
    volumes, mounts = pod.setdefault("volumes", []), container.setdefault("volumeMounts", [])
    for volume, mount in (home_volume(), token_volume(token_secret)):
        volumes.append(volume)
        mounts.append(mount)
    security = container_security(kube)
    if security:
        container["securityContext"] = security
    pod.update(pod_security(kube))
