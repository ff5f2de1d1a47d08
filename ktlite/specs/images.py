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
        name: a label for the image (Kubetorch's ``name``); not an image reference.
        python_path: the image's Python to run ktlite under (default: the first
            ``python3``/``python`` on the image's PATH).
        install_cmd: the command ``pip_install`` steps run, e.g. ``"uv pip install --system"``
            (default: ``python -m pip install`` into a venv on the pod that sees the image's
            packages).

    Example:
        >>> kt.Image("python:3.11-slim").pip_install(["numpy"]).set_env_vars({"A": "1"})
    """

    image_id: str = DEFAULT_IMAGE
    steps: tuple[tuple[str, Any], ...] = ()
    freeze: bool = False
    name: str | None = None
    python_path: str | None = None
    install_cmd: str | None = None

    def __init__(
        self,
        image_id: str | None = None,
        *,
        base: str | None = None,
        steps: tuple[tuple[str, Any], ...] = (),
        freeze: bool = False,
        name: str | None = None,
        python_path: str | None = None,
        install_cmd: str | None = None,
    ) -> None:
        chosen = image_id or base or DEFAULT_IMAGE
        if not isinstance(chosen, str) or not chosen.strip() or any(c.isspace() for c in chosen):
            raise ConfigError(
                f"Image(image_id={chosen!r}) must be an image reference like 'python:3.11-slim'"
            )
        if python_path is not None and (
            not isinstance(python_path, str) or not python_path.startswith("/")
        ):
            raise ConfigError(
                f"Image(python_path={python_path!r}) must be an absolute path in the image, "
                "e.g. '/opt/conda/bin/python'"
            )
        if install_cmd is not None and (
            not isinstance(install_cmd, str) or not install_cmd.strip()
        ):
            raise ConfigError(
                f"Image(install_cmd={install_cmd!r}) must be a command such as "
                "'uv pip install --system'"
            )
        object.__setattr__(self, "image_id", chosen)
        object.__setattr__(self, "steps", tuple(steps))
        object.__setattr__(self, "freeze", bool(freeze))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "python_path", python_path)
        object.__setattr__(self, "install_cmd", install_cmd)

    def from_docker(self, image_id: str) -> Image:
        """The same steps on another base image (Kubetorch's ``from_docker``)."""
        return replace_image(self, image_id)

    @classmethod
    def from_dockerfile(cls, path: str) -> Image:
        """An image from a Dockerfile's ``FROM``, ``RUN`` and ``ENV`` lines: the base image,
        then its commands replayed at pod start (nothing is built). ``COPY``/``ADD``,
        ``CMD``/``ENTRYPOINT`` and the rest are refused, naming the line."""
        import shlex

        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"Image.from_dockerfile({path!r}): cannot read it: {e}") from e
        lines, pending = [], ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append(pending + line)
            pending = ""
        image: Image | None = None
        for line in lines:
            word, _, rest = line.partition(" ")
            word, rest = word.upper(), rest.strip()
            if word == "FROM":
                image = cls(rest.split()[0])
            elif image is None:
                raise ConfigError(f"{path}: {line!r} comes before FROM")
            elif word == "RUN":
                image = image.run_bash(rest)
            elif word == "ENV":
                pairs = (
                    dict(p.split("=", 1) for p in shlex.split(rest) if "=" in p)
                    if "=" in rest.split()[0]
                    else dict([rest.split(None, 1)])
                )
                image = image.set_env_vars(pairs)
            elif word in ("ARG", "LABEL", "WORKDIR", "EXPOSE", "USER", "SHELL"):
                raise ConfigError(
                    f"{path}: {word} is not replayed at pod start ({line!r}); remove it, "
                    "or build the image and pass kt.Image('your/image:tag', freeze=True)"
                )
            else:
                raise NotImplementedError(
                    f"{path}: {word} ({line!r}) is not supported by Image.from_dockerfile: ktlite replays "
                    "FROM, RUN and ENV at pod start. Ship files with the function's own modules (ktlite "
                    "packs what it imports) or kt.put/kt.get, and run a command with kt.app"
                )
        if image is None:
            raise ConfigError(f"{path} has no FROM line")
        return image

    def sync_package(self, package: str, force: bool = False) -> Image:
        raise NotImplementedError(
            f"Image.sync_package({package!r}) is not supported: ktlite ships the local modules and "
            "packages your function imports with every .to() (no rsync); a package from an index: "
            ".pip_install([...])"
        )

    def copy(self, source: str, dest: str | None = None, *args: Any, **kwargs: Any) -> Image:
        raise NotImplementedError(
            f"Image.copy({source!r}) is not supported: ktlite ships the code your function imports with "
            "every .to(); for data files use kt.put(key, path) here and kt.get(key, dest) on the pods"
        )

    def rsync(self, source: str, dest: str | None = None, *args: Any, **kwargs: Any) -> Image:
        raise NotImplementedError(
            f"Image.rsync({source!r}) (Kubetorch's old name of copy) is not supported: ktlite ships the code "
            "your function imports with every .to(); for data files use kt.put(key, path) here and "
            "kt.get(key, dest) on the pods"
        )

    def pip_install(self, packages: str | list[str], force: bool = False) -> Image:
        """Install ``packages`` at pod start (cached across container restarts of a pod);
        ``force=True`` reinstalls them (``pip install --force-reinstall``)."""
        pkgs = [packages] if isinstance(packages, str) else list(packages)
        if not pkgs or not all(isinstance(p, str) and p.strip() for p in pkgs):
            raise ConfigError(
                f"pip_install({packages!r}) needs package names such as 'numpy' or ['numpy']"
            )
        if force:
            pkgs = ["--force-reinstall", *pkgs]
        return replace(self, steps=(*self.steps, ("pip_install", tuple(pkgs))))

    def run_bash(self, command: str, force: bool = False) -> Image:
        """Run ``command`` at pod start. It runs in every new container, so ``force`` (run
        it again even if cached, in Kubetorch) is always the case."""
        if not isinstance(command, str) or not command.strip():
            raise ConfigError(f"run_bash({command!r}) needs a shell command")
        return replace(self, steps=(*self.steps, ("run_bash", command)))

    def set_env_vars(self, env: dict[str, str]) -> Image:
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError(f"set_env_vars({env!r}) needs a dict of str to str")
        return replace(self, steps=(*self.steps, ("env", tuple(sorted(env.items())))))

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, arg in self.steps:
            if kind == "env":
                out.update(dict(arg))
        return out


def replace_image(image: Image, image_id: str) -> Image:
    return replace(image, image_id=image_id)


def python(version: str = "3.11") -> Image:
    return Image(f"python:{version}-slim")


def ubuntu(tag: str = "24.04") -> Image:
    """Ubuntu; ktlite installs Python and itself at pod start (or use an image with them)."""
    return Image(f"ubuntu:{tag}")


def pytorch(tag: str = "24.08-py3") -> Image:
    return Image(f"nvcr.io/nvidia/pytorch:{tag}")


def ray(tag: str = "2.60.0-py311", *, v: str | None = None) -> Image:
    """Ray's image, ``rayproject/ray:<tag>`` (``v=`` is Kubetorch's name for the tag). The
    client's Ray must be the same version (checked at ``.to()``)."""
    tag = v if v is not None else tag
    if not isinstance(tag, str) or not tag.strip() or any(c.isspace() or c in ":/@" for c in tag):
        raise ConfigError(
            f"kt.images.ray(tag={tag!r}) must be a tag of rayproject/ray, a string such as "
            "'2.60.0-py311' (Ray's version, then the Python it runs)"
        )
    return Image(f"rayproject/ray:{tag}")


def debian(tag: str = "bookworm-slim") -> Image:
    return Image(f"debian:{tag}")


# Kubetorch's capitalised presets
def Debian() -> Image:  # noqa: N802
    return debian()


def Ubuntu() -> Image:  # noqa: N802
    return ubuntu()


def Python310() -> Image:  # noqa: N802
    return python("3.10")


def Python311() -> Image:  # noqa: N802
    return python("3.11")


def Python312() -> Image:  # noqa: N802
    return python("3.12")


def Pytorch2312() -> Image:  # noqa: N802
    return pytorch("23.12-py3")


def Ray(tag: str = "2.60.0-py311", *, v: str | None = None) -> Image:  # noqa: N802
    """Kubetorch's spelling of :func:`ray`: ``kt.images.Ray("2.32.0-py311")``."""
    return ray(tag, v=v)
