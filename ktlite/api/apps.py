"""``kt.app``: run a whole command (``torchrun ...``, ``python train.py``) on N replicas.

    app = kt.app(cli_command="torchrun --nproc_per_node=2 train.py --epochs 3", replicas=2, cpus=2)
    codes = app.run()       # [0, 0]: each replica's exit code

Each replica is one pod running the command in the working directory's files, with the rank
env of a deployment plus torchrun's own ``PET_*`` variables, so an unmodified torchrun
script joins across replicas with no rank arguments: ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, and ``PET_RDZV_ENDPOINT`` / ``PET_RDZV_ID`` /
``PET_RDZV_CONF`` for ``--rdzv-backend=c10d``. The rendezvous times out after
``rendezvous_timeout`` seconds instead of waiting forever. Output streams live as
``[replica r] line``. A replica that exits non-zero stops the others and the call raises
:class:`ReplicaFailed` with its exit code and last lines.
"""

from __future__ import annotations

import io
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ktlite.api.compute import Compute
from ktlite.api.served_apps import check_port, start_command, start_replica, stop_command
from ktlite.backends.registry import traits
from ktlite.errors import ConfigError, ReplicaFailed
from ktlite.net.archive import check_members, extract
from ktlite.specs.spec import check_name, default_name

MAX_FILES_BYTES = 200 * 2**20
_ALWAYS_SKIP = {
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "node_modules",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
}


def _files(root: Path) -> list[Path]:
    """The working directory's files, as git sees them (respecting .gitignore), else every
    file but virtualenvs, caches and VCS folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout
        return [root / p for p in out.decode().split("\0") if p and (root / p).is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _ALWAYS_SKIP]
        found += [Path(dirpath) / f for f in filenames]
    return found


def pack(root: Path) -> bytes:
    """A gzipped tar of ``root``'s files (see :func:`_files`); refuses more than 200 MB."""
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in _files(root):
            total += path.stat().st_size
            if total > MAX_FILES_BYTES:
                raise ConfigError(
                    f"the working directory {root} holds more than {MAX_FILES_BYTES >> 20} MB "
                    "of files to ship; add the large ones to .gitignore, or pass "
                    "kt.app(..., workdir=<a smaller folder>)"
                )
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
        # what every replica would refuse (a link out of the folder), refused here, before
        # anything is deployed
        check_members(tar.getmembers())
    return buf.getvalue()


def torchrun_env(rendezvous_timeout: float) -> dict[str, str]:
    """torchrun's ``PET_*`` settings from this replica's rank env."""
    env = os.environ
    endpoint = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    timeout = str(math.ceil(rendezvous_timeout))
    return {
        "PET_NNODES": env["GROUP_WORLD_SIZE"],
        "PET_NODE_RANK": env["NODE_RANK"],
        "PET_MASTER_ADDR": env["MASTER_ADDR"],
        "PET_MASTER_PORT": env["MASTER_PORT"],
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_ID": env.get("KTLITE_LAUNCH_ID") or "ktlite",
        # static rendezvous reads "timeout", c10d "join_timeout"/"read_timeout"
        "PET_RDZV_CONF": f"timeout={timeout},join_timeout={timeout},read_timeout={timeout}",
        "PET_MAX_RESTARTS": "0",  # a failure is the caller's to see, not to retry silently
    }


def run_replica(
    command: list[str],
    files: bytes | None,
    cwd: str | None,
    rendezvous_timeout: float,
    extra_env: dict[str, str],
) -> int:
    """On a pod: run ``command`` in the shipped files (or ``cwd`` when the caller's folder is
    right here), streaming its output; returns 0 or raises ReplicaFailed."""
    import collections
    import tempfile

    if files is not None:
        workdir = tempfile.mkdtemp(prefix=f"ktlite-app-{os.environ.get('KTLITE_LAUNCH_ID', 'x')}-")
        try:  # not tarfile's own extractall(filter="data"): older Pythons ktlite supports lack it
            extract(files, workdir)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    else:
        workdir = cwd or os.getcwd()
    tail: collections.deque[str] = collections.deque(maxlen=30)
    proc = start_command(command, workdir, {**torchrun_env(rendezvous_timeout), **extra_env})
    assert proc.stdout is not None
    try:
        with proc.stdout:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                tail.append(line)
                print(line, flush=True)
        code = proc.wait()
    except BaseException:
        stop_command(proc)  # the call was stopped (a replica failed, a cancel): so is the command
        raise
    finally:
        if files is not None:  # the unpacked copy is this run's only
            shutil.rmtree(workdir, ignore_errors=True)
    if code != 0:
        how = f"exit code {code}" if code > 0 else f"signal {-code}"
        node = os.environ.get("NODE_RANK", "?")
        raise ReplicaFailed(
            f"replica {node} ({os.environ.get('KTLITE_POD_NAME', '?')}): "
            f"`{shlex.join(command)}` ended with {how}; last lines:\n"
            + "\n".join("    " + ln for ln in tail),
            exit_code=code if code > 0 else 128 - code,
        )
    sys.stdout.flush()
    return 0


def replica(action: str, *args: Any) -> Any:
    """On a pod: what :class:`App` asks of a replica: ``"run"`` its command to completion
    (:func:`run_replica`), or ``"start"`` a served app's in the background
    (:func:`~ktlite.api.served_apps.start_replica`)."""
    if action == "start":
        return start_replica(*args)
    return run_replica(*args)


class App:
    """A command run on ``replicas`` pods; see the module docstring.

    Args:
        cli_command: the command line, e.g. ``"torchrun --nproc_per_node=2 train.py"``.
        replicas: how many pods run it (torchrun's nodes).
        name: deployment name (default: from the command's script).
        workdir: the folder whose files the replicas get (default: the current directory).
        rendezvous_timeout: seconds torchrun's rendezvous may take before it fails.
        compute: a full :class:`kt.Compute`; else ``cpus``, ``gpus``, ``memory``, ``image``,
            ``env`` and any other Compute field as keywords.
    """

    def __init__(
        self,
        cli_command: str | Sequence[str],
        replicas: int = 1,
        name: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        rendezvous_timeout: float = 300.0,
        compute: Compute | None = None,
        port: int | None = None,
        health_check: str | None = None,
        **compute_kwargs: Any,
    ) -> None:
        self.port, self.health_check = check_port(port, health_check)
        command = shlex.split(cli_command) if isinstance(cli_command, str) else list(cli_command)
        if not command or not all(isinstance(c, str) and c for c in command):
            raise ConfigError(
                f"cli_command={cli_command!r} must be a command line such as "
                "'torchrun --nproc_per_node=2 train.py'"
            )
        if compute is not None and compute_kwargs:
            raise ConfigError("pass compute= or Compute fields as keywords, not both")
        base = compute if compute is not None else Compute(**compute_kwargs)
        if (
            isinstance(rendezvous_timeout, bool)
            or not isinstance(rendezvous_timeout, (int, float))
            or not math.isfinite(rendezvous_timeout)
            or rendezvous_timeout < 1
        ):
            raise ConfigError(
                f"rendezvous_timeout={rendezvous_timeout!r} must be a finite number of seconds >= 1"
            )
        self.command = command
        self.compute = base._distributed(
            "pytorch",
            workers=replicas,
            num_proc=1,
            port=base.distributed.port if base.distributed else None,
        )
        script = next(
            (Path(c).stem for c in command[1:] if c.endswith(".py")), Path(command[0]).name
        )
        self.name = check_name(name) if name is not None else default_name(f"app-{script}")
        self.workdir = Path(workdir or os.getcwd()).resolve()
        if not self.workdir.is_dir():
            raise ConfigError(f"workdir={str(workdir)!r} is not a folder")
        if self.port is not None and replicas > 1:
            from ktlite.config import get as setting

            backend = self.compute.backend or setting("backend") or "local"
            if traits(backend).local_files:
                raise ConfigError(
                    f"kt.app(port={self.port}, replicas={replicas}) on the {backend!r} backend: "
                    f"its replicas are processes of this machine and cannot each listen on "
                    f"port {self.port}; use replicas=1 here"
                )
        self.rendezvous_timeout = float(rendezvous_timeout)
        self._remote: Any = None
        self._forwards: dict[int, Any] = {}  # replica -> its PortForward

    @property
    def replica_count(self) -> int:
        """The replicas (pods) it runs on: its Compute is distributed from __init__ on."""
        d = self.compute.distributed
        assert d is not None, "kt.app's Compute is set by _distributed in __init__"
        return d.workers

    def __repr__(self) -> str:
        return f"<kt.app {shlex.join(self.command)!r} as {self.name!r} on {self.replica_count} replica(s)>"

    def deploy(self, dryrun: bool = False, detached: bool = False) -> Any:
        """The replicas' pods (``detached``: they outlive this process on the local backend,
        as a served app started by ``ktlite run`` does)."""
        from ktlite.api.remote import fn

        remote = fn(replica, name=self.name).to(self.compute, dryrun=dryrun, detached=detached)
        if not dryrun:
            self._remote = remote
        return remote

    def run(self, timeout: float | None = None, env: dict[str, str] | None = None) -> list[int]:
        """Deploy if needed, run the command on every replica; returns their exit codes. A
        served app (``port=``) is started instead (:meth:`start`) and this returns a 0 per
        replica once each answers."""
        if self.port is not None:
            self.start(env=env)
            return [0] * self.replica_count
        return list(self._call("run", (self.rendezvous_timeout, dict(env or {})), timeout))

    def start(
        self, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """A served app's command, started on every replica (again, if it ran): returns once
        each replica's ``port`` answers (``health_check`` with a 2xx, else a connection);
        raises :class:`ReplicaFailed` with the command's last lines when it exits first or
        does not answer within ``timeout`` seconds (default: the Compute's
        ``launch_timeout``)."""
        if self.port is None:
            raise ConfigError(f"{self!r} serves no port: kt.app(..., port=8000) to start it")
        if timeout is None:
            timeout = self.compute.pod_spec().calls.launch_timeout
        started: list[dict[str, Any]] = self._call(
            "start", (dict(env or {}), self.port, self.health_check, timeout), None
        )
        return started

    def _call(self, action: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        from ktlite.api.remote import _options
        from ktlite.net import packaging

        if self._remote is None:
            self.deploy()
        dep = self._remote.deployment
        # the local backend's replicas run in this very folder; elsewhere its files travel
        files = None if traits(dep.backend.name).local_files else pack(self.workdir)
        parts = packaging.encode_call(
            None, (action, self.command, files, str(self.workdir), *args), {}
        )
        return dep.call(None, parts, _options({"timeout": timeout}), log=_replica_log)

    def local_port(self, replica: int = 0, port: int = 0) -> int:
        """A port on this machine's loopback interface that reaches the app on ``replica``
        (through its pod server, with the deployment token); ``port`` 0 picks a free one."""
        forward = self._forwards.get(replica)
        if forward is None:
            forward = self._forwards[replica] = self._forward(replica, port)
            forward.start()
        return int(forward.local_port)

    @property
    def url(self) -> str:
        """Where the app answers from here: ``http://127.0.0.1:LOCAL``, replica 0's."""
        return f"http://127.0.0.1:{self.local_port()}"

    def _forward(self, replica: int, local: int) -> Any:
        import functools

        from ktlite.net import tls
        from ktlite.net.portforward import PortForward

        if self.port is None:
            raise ConfigError(f"{self!r} serves no port: kt.app(..., port=8000)")
        if self._remote is None:
            raise ConfigError(f"{self.name!r} is not started: call .start() (or .run()) first")
        applied = self._remote.deployment.applied
        if not 0 <= replica < len(applied.endpoints):
            raise ConfigError(f"replica={replica}: {self.name!r} has {len(applied.endpoints)}")
        return PortForward(
            applied.endpoints[replica].url,
            self.port,
            applied.token,
            http=applied.http,
            pinned=functools.partial(tls.pinned_context, applied.token),
            local_port=local,
        )

    def teardown(self) -> None:
        for forward in self._forwards.values():
            forward.close()
        self._forwards.clear()
        if self._remote is not None:
            self._remote.teardown()
            self._remote = None


def _replica_log(rank: int, pod: str, stream: str, text: str) -> None:
    import sys

    from ktlite.modes.callpath import _print_lock

    out = sys.stderr if stream == "err" else sys.stdout
    with _print_lock:
        print(f"[replica {rank}] {text}", file=out, flush=True)


RUN_ENV = "KTLITE_RUN_CMD"  # `ktlite run CMD...` hands its command to the script's kt.app()


def app(
    cli_command: str | Sequence[str] | None = None,
    replicas: int = 1,
    *,
    name: str | None = None,
    port: int | None = None,
    health_check: str | None = None,
    **kwargs: Any,
) -> App | None:
    """Run a command on ``replicas`` pods.

    ktlite's form: ``kt.app(cli_command="torchrun --nproc_per_node=2 train.py", replicas=2,
    cpus=2).run()``.

    Kubetorch's form: ``kt.app(name="train", cpus=2)`` with no command, at the top of a script
    launched with ``ktlite run python train.py --epochs 3``. There it deploys that command
    (the script itself, with the working directory's files) on the replicas, streams their
    output and ends this process with their outcome; anywhere else (on the pods, or under
    plain ``python train.py``) it returns None and the script goes on.
    """
    check_port(port, health_check)  # also where the script goes on: told at once, not at `run`
    if cli_command is not None:
        return App(cli_command, replicas, name=name, port=port, health_check=health_check, **kwargs)
    command = os.environ.pop(RUN_ENV, None)  # popped: pods started from here must not see it
    if command is None:
        return None
    import json

    argv = json.loads(command)
    chosen = App(
        argv,
        replicas=replicas,
        name=name or os.environ.pop("KTLITE_RUN_NAME", None),
        port=port,
        health_check=health_check,
        **kwargs,
    )
    timeout = os.environ.pop("KTLITE_RUN_TIMEOUT", None)
    try:
        if chosen.port is not None:  # a server: started, it serves until torn down
            chosen.deploy(detached=True)
            chosen.start()
            print(
                f"ktlite: {chosen.name}: serving port {chosen.port} on "
                f"{chosen.replica_count} replica(s); `ktlite port-forward {chosen.name} "
                f"{chosen.port}` reaches it here, `ktlite teardown {chosen.name}` stops it",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(0)
        codes = chosen.run(timeout=float(timeout) if timeout else None)
    except ReplicaFailed as e:
        print(f"ktlite: {chosen.name}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    print(f"ktlite: {chosen.name}: exit codes {codes}", file=sys.stderr, flush=True)
    raise SystemExit(max(codes or [0]))


def app_form(path: str | os.PathLike[str]) -> str | None:
    """How a script uses ``kt.app``, read, never run: ``"launcher"`` when it calls
    ``kt.app(...)`` with no command (Kubetorch's form, for ``ktlite run python script.py``),
    ``"declares"`` when it declares apps with their commands (``kt.app(cli_command=...)``,
    ``kt.App(...)``), else None."""
    import ast

    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    declares = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            given = bool(node.args) or any(k.arg == "cli_command" for k in node.keywords)
            if name == "app" and not given:
                return "launcher"
            declares = declares or (name in ("app", "App") and given)
    return "declares" if declares else None
