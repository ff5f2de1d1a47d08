"""``ktlite run``: run ``kt.app`` commands on N replicas, in each of the forms users type.

- ``ktlite run train_app.py``, or ``ktlite run python train_app.py ARGS...`` (seed 004's
  ``kt run`` form): the apps the script declares with their commands
  (``kt.app(cli_command="torchrun ...", replicas=2)``); the script is imported, not run,
  and sees ``ARGS`` in ``sys.argv``.
- ``ktlite run python train.py ARGS...`` where ``train.py`` calls ``kt.app(name=...)`` with
  no command (Kubetorch's form): the script runs here until that call, which deploys the
  command itself on the replicas.
- ``ktlite run --replicas 2 -- torchrun ... train.py`` (or without ``--`` when no script in
  it declares an app): that command on the replicas.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ktlite.api.apps import App, app_form
from ktlite.commands.scripts import load_script
from ktlite.errors import ConfigError, KtliteError

_POD_FLAGS = ("replicas", "cpus", "gpus", "memory", "image", "backend", "namespace")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The options among ``names`` given on the command line (not at their defaults)."""
    return [
        f"--{k}" for k in names if getattr(args, k) not in (None, 1 if k == "replicas" else None)
    ]


def _script_argv(words: list[str], script: str) -> list[str] | None:
    """The script's own arguments when ``words`` is ``python [-flags] SCRIPT ARGS...``,
    else None (another program runs it: torchrun, ``python -m ...``)."""
    at = words.index(script)
    first = words[0]
    if not (_PYTHON.match(Path(first).name) or first == sys.executable):
        return None
    if any(not w.startswith("-") or w in ("-m", "-c") for w in words[1:at]):
        return None
    return words[at + 1 :]


def run(args: argparse.Namespace) -> int:
    words = list(args.command_args or [])
    script_args: list[str] | None = None
    script = None
    if words and not args.command_line:
        found = next((w for w in words if w.endswith(".py")), None)
        form = app_form(found) if found is not None and Path(found).is_file() else None
        if form == "launcher":
            return _run_script(args, words, found)  # type: ignore[arg-type]
        if words == [found]:
            script, script_args = found, None  # a script declaring kt.app(cli_command=...) objects
        elif form == "declares":
            script, script_args = found, _script_argv(words, found)  # type: ignore[arg-type]
            if script_args is None:
                raise ConfigError(
                    f"{found} declares kt.app(cli_command=...) apps: `{shlex.join(words)}` would run it on "
                    f"the replicas, where it only declares them and runs nothing. Run the apps it declares "
                    f"with `ktlite run {found}` (or `ktlite run python {found}`)"
                )
        else:
            args.command_line = words  # Kubetorch's `kt run CMD...` with no kt.app in it
    if args.command_line:
        command = args.command_line
        extra: dict[str, Any] = {
            k: v
            for k, v in (
                ("cpus", args.cpus),
                ("gpus", args.gpus),
                ("memory", args.memory),
                ("image", args.image),
            )
            if v is not None
        }
        apps = [
            App(
                command,
                replicas=args.replicas,
                name=args.name,
                backend=args.backend,
                namespace=args.namespace,
                **extra,
            )
        ]
    elif script is not None:
        given = _given(args, _POD_FLAGS) + (["--name"] if args.name else [])
        if given:
            raise ConfigError(
                f"{script} declares its apps with kt.app(cli_command=..., ...): set "
                f"{', '.join(given)} there (e.g. kt.app(cli_command=..., name='train', "
                "replicas=2, cpus=2)), not on `ktlite run`"
            )
        module = load_script(script, script_args)
        apps = list({id(v): v for v in vars(module).values() if isinstance(v, App)}.values())
        if not apps:
            raise ConfigError(
                f"{script} declares no kt.app(...); or run a command directly: "
                "`ktlite run --replicas 2 -- torchrun --nproc_per_node=2 train.py`"
            )
    else:
        raise ConfigError("give a script that declares kt.app(...) objects, or a command after --")
    if args.dry_run:
        for app in apps:
            print(app.deploy(dryrun=True))
            print(
                f"# then, on each of the {app.replica_count} replica(s), in "
                f"{app.workdir}: {shlex.join(app.command)}"
            )
        return 0
    failed = 0
    for app in apps:
        try:
            codes = app.run(timeout=args.timeout)
            print(f"{app.name}: exit codes {codes}")
        except KtliteError as e:
            failed += 1
            print(f"{app.name}: failed: {e}", file=sys.stderr)
    return 1 if failed else 0


def _run_script(args: argparse.Namespace, command: list[str], script: str) -> int:
    """``ktlite run python train.py ...`` where train.py calls ``kt.app(...)`` (Kubetorch's
    form): the script runs here until its kt.app() call, which deploys ``command`` and ends
    the script with the replicas' outcome."""
    import os
    import subprocess

    from ktlite.api.apps import RUN_ENV

    given = _given(args, _POD_FLAGS)
    if given or args.dry_run:
        raise ConfigError(
            f"{script} sets its pods with kt.app(...): pass {', '.join(given) or '--dry-run'} "
            "there (e.g. kt.app(name='train', cpus=2, replicas=2)), not to `ktlite run`"
        )
    env = {**os.environ, RUN_ENV: json.dumps(command)}
    if args.name:
        env["KTLITE_RUN_NAME"] = args.name
    if args.timeout:
        env["KTLITE_RUN_TIMEOUT"] = str(args.timeout)
    proc = subprocess.run([sys.executable, script, *command[command.index(script) + 1 :]], env=env)
    return proc.returncode


def add_command(command: Any, where: Any) -> None:
    """``ktlite run``'s parser, through the CLI's ``command`` and ``where`` helpers."""
    rn = command(
        "run",
        "run kt.app commands: those a script declares, or one given after --",
        "ktlite run train_app.py   |   ktlite run --replicas 2 -- torchrun "
        "--nproc_per_node=2 train.py",
        run,
    )
    rn.add_argument(
        "command_args",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT | COMMAND ...",
        help="a script declaring kt.app(cli_command=...) objects (also as `python SCRIPT "
        "ARGS...`); or a command such as `python train.py --epochs 3` whose script calls "
        "kt.app(...) (Kubetorch's form), or any command to run on the replicas",
    )
    rn.add_argument("--replicas", type=int, default=1)
    rn.add_argument("--name", default=None)
    rn.add_argument("--cpus", default=None)
    rn.add_argument("--gpus", type=int, default=None)
    rn.add_argument("--memory", default=None)
    rn.add_argument("--image", default=None)
    rn.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped")
    rn.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    where(rn)
