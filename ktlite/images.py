"""``kt.Image``: a base image plus setup steps that run at pod start (no image rebuilds).

Presets name public base images: ``kt.images.python("3.11")``, ``kt.images.pytorch("24.08-py3")``,
``kt.images.ray("2.60.0-py311")``, ``kt.images.debian()``.

On the local backend a pod is a process of this machine's Python: the base image is not
used, ``set_env_vars`` applies, and ``pip_install`` / ``run_bash`` steps are recorded in
the plan (they run on Kubernetes pods, where the image matters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ktlite.errors import ConfigError

DEFAULT_IMAGE = "python:3.11-slim"


@dataclass(frozen=True)
class Image:
    """A container image and the steps that prepare it at pod start.

    Args:
        image_id: the base image ("python:3.11-slim"); ``base=`` is accepted too.
        freeze: skip every install at pod start (the image already has everything).

    Example:
        >>> kt.Image("python:3.11-slim").pip_install(["numpy"]).set_env_vars({"A": "1"})
    """

    image_id: str = DEFAULT_IMAGE
    steps: tuple[tuple[str, Any], ...] = ()
    freeze: bool = False

    def __init__(self, image_id: str | None = None, *, base: str | None = None,
                 steps: tuple[tuple[str, Any], ...] = (), freeze: bool = False) -> None:
        chosen = image_id or base or DEFAULT_IMAGE
        if not isinstance(chosen, str) or not chosen.strip() or any(c.isspace() for c in chosen):
            raise ConfigError(f"Image(image_id={chosen!r}) must be an image reference like 'python:3.11-slim'")
        object.__setattr__(self, "image_id", chosen)
        object.__setattr__(self, "steps", tuple(steps))
        object.__setattr__(self, "freeze", bool(freeze))

    def pip_install(self, packages: str | list[str]) -> Image:
        pkgs = [packages] if isinstance(packages, str) else list(packages)
        if not pkgs or not all(isinstance(p, str) and p.strip() for p in pkgs):
            raise ConfigError(f"pip_install({packages!r}) needs package names such as 'numpy' or ['numpy']")
        return replace(self, steps=(*self.steps, ("pip_install", tuple(pkgs))))

    def run_bash(self, command: str) -> Image:
        if not isinstance(command, str) or not command.strip():
            raise ConfigError(f"run_bash({command!r}) needs a shell command")
        return replace(self, steps=(*self.steps, ("run_bash", command)))

    def set_env_vars(self, env: dict[str, str]) -> Image:
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError(f"set_env_vars({env!r}) needs a dict of str to str")
        return replace(self, steps=(*self.steps, ("env", tuple(sorted(env.items())))))

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, arg in self.steps:
            if kind == "env":
                out.update(dict(arg))
        return out


def python(version: str = "3.11") -> Image:
    return Image(f"python:{version}-slim")


def pytorch(tag: str = "24.08-py3") -> Image:
    return Image(f"nvcr.io/nvidia/pytorch:{tag}")


def ray(tag: str = "2.60.0-py311") -> Image:
    return Image(f"rayproject/ray:{tag}")


def debian(tag: str = "bookworm-slim") -> Image:
    return Image(f"debian:{tag}")


# Kubetorch spells the Ray preset with a capital R
Ray = ray
