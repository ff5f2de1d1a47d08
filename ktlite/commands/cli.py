"""The ``ktlite`` command line: list, tear down and read the logs of deployments; settings.

A running deployment's status (and the attach that ``call`` uses):
:mod:`~ktlite.commands.status_cli`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import json
import sys

from ktlite import __version__, config, logconfig
from ktlite.api.decorators import Decorated
from ktlite.commands import dashboard_cli, expiry_cli, portforward_cli, run_cli
from ktlite.commands.confirmation import confirm
from ktlite.commands.scripts import load_script
from ktlite.commands.status_cli import attach, named_backend, status_command
from ktlite.errors import ConfigError, KtliteError, NotDeployedError


def _marked(target: str) -> list[Decorated]:
    path, _, only = target.partition(":")
    module = load_script(path)
    found: dict[int, Decorated] = {}
    for value in vars(module).values():
        if isinstance(value, Decorated):
            found.setdefault(id(value), value)
    marked = list(found.values())
    if not marked:
        raise ConfigError(
            f"{path} has no function or class decorated with @kt.compute or @kt.distribute"
        )
    if only:
        chosen = [m for m in marked if only in (m.obj.__name__, m.name)]
        if not chosen:
            names = ", ".join(m.obj.__name__ for m in marked)
            raise ConfigError(f"{path} has no decorated {only!r}; it has: {names}")
        marked = chosen
    return marked


def _deploy(args: argparse.Namespace) -> int:
    marked = _marked(args.target)
    if args.dry_run:
        for m in marked:
            print(m.deploy(dryrun=True))
        return 0
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(marked))) as pool:
        futures = {m: pool.submit(m.deploy, detached=True) for m in marked}
        for m, future in futures.items():
            try:
                remote = future.result()
            except KtliteError as e:
                failed += 1
                print(f"{m.name}: failed: {e}", file=sys.stderr)
                continue
            dep = remote.deployment
            d = dep.spec.distributed
            where = dep.backend.where()
            print(
                f"{m.name}: deployed on {where}: {len(dep.endpoints)} pod(s), "
                f"{d.world_size}/{d.world_size} ranks ready"
            )
    return 1 if failed else 0


def _call(args: argparse.Namespace) -> int:
    try:
        call_args = json.loads(args.args)
        call_kwargs = json.loads(args.kwargs)
    except ValueError as e:
        raise ConfigError(
            f"--args and --kwargs take JSON, e.g. --args '[1, 2]' --kwargs '{{\"x\": 3}}': {e}"
        ) from e
    if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
        raise ConfigError("--args must be a JSON list and --kwargs a JSON object")
    from ktlite.api.remote import _options
    from ktlite.net import packaging

    options = _options({"timeout": args.timeout})  # bad values fail here, before the call
    dep, status = attach(args)
    if args.method is None and status and status[0].get("kind") == "cls":
        raise ConfigError(
            f"{args.name!r} is a deployed class: name the method to call with "
            "--method, e.g. --method predict"
        )
    if args.method is not None and status and status[0].get("kind") == "fn":
        raise ConfigError(
            f"{args.name!r} is a deployed function: it has no methods, so there is no "
            f"--method {args.method}; call it without --method"
        )
    parts = packaging.encode_call(args.method, tuple(call_args), call_kwargs)
    values = dep.call(args.method, parts, options)
    result = values if len(values) > 1 else values[0]
    try:
        print(json.dumps(result))
    except TypeError:
        print(repr(result))
    return 0


def _list(args: argparse.Namespace) -> int:
    backend = named_backend(args)
    rows = backend.list()
    # what has outlived its inactivity_ttl goes now (where its pods could not delete it)
    say = lambda text: print(f"ktlite: {text}", file=sys.stderr)  # noqa: E731
    swept = expiry_cli.sweep(backend, rows, say=say)
    rows = [r for r in rows if r["name"] not in swept]
    if not rows:
        print("no deployments")
        return 0
    head = f"{'NAME':30} {'BACKEND':12} {'NAMESPACE':16} {'READY':8} {'MODE':11} {'DETACHED':9}"
    print(f"{head} {'IDLE':8} DEADLINE")
    for r in rows:
        ready = f"{r['ready']}/{r['pods']}"
        mode = "autoscaled" if r.get("autoscaled") else "pods"
        idle, deadline = expiry_cli.columns(r)
        print(
            f"{r['name']:30} {r['backend']:12} {r.get('namespace') or '-':16} {ready:8} {mode:11} "
            f"{r['detached']!s:9} {idle:8} {deadline}"
        )
    return 0


def _teardown(args: argparse.Namespace) -> int:
    backend = named_backend(args)
    rows = backend.list()
    deployed = [r["name"] for r in rows]
    where = f"backend {backend.name!r}"
    if args.expired:  # those idle for longer than their inactivity_ttl
        if not expiry_cli.sweep(backend, rows, dry_run=args.dry_run, timeout=args.timeout):
            print(f"nothing has expired on {where}")
        return 0
    if args.prefix:  # Kubetorch's --prefix: every deployment whose name starts with it
        names = [n for n in deployed if n.startswith(args.prefix)]
    else:
        names = deployed if args.all else args.names
    if not names:
        if not deployed:
            why = f"nothing is deployed on {where}"
        elif args.prefix:
            why = f"no deployment name starts with {args.prefix!r}; deployed: {', '.join(deployed)}"
        else:
            why = f"name a deployment or pass --all; deployed: {', '.join(deployed)}"
        print(f"nothing to tear down: {why}", file=sys.stderr)
        return 1
    if (args.all or args.prefix) and not args.dry_run:
        which = "--all" if args.all else f"--prefix {args.prefix}"
        refused = confirm(
            yes=args.yes,
            command=f"teardown {which} asks before it tears down {len(names)} deployment(s) "
            f"({', '.join(names)})",
            question=f"tear down {len(names)} deployment(s): {', '.join(names)}?",
        )
        if refused is not None:
            return refused
    missing = []
    for name in names:
        if args.dry_run and name in deployed:
            print(f"{name}: would be torn down")
        elif not args.dry_run and backend.teardown(
            name, timeout=args.timeout, volumes=args.volumes
        ):
            print(f"{name}: torn down")
        else:
            missing.append(name)
    if missing:
        raise NotDeployedError("; ".join(_no_such(name, deployed, where) for name in missing))
    return 0


def _no_such(name: str, deployed: list[str], where: str) -> str:
    """Says that ``name`` is not deployed, with the closest names that are."""
    if not deployed:
        return f"no deployment named {name!r}: nothing is deployed on {where}"
    close = difflib.get_close_matches(name, deployed, n=3, cutoff=0.6)
    guess = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"no deployment named {name!r}{guess} (deployed on {where}: {', '.join(deployed)})"


def _logs(args: argparse.Namespace) -> int:
    pod = args.pod
    if args.rank is not None:
        _, status = attach(args)
        procs = max(1, len(status[0]["ranks"])) if status else 1
        pod = args.rank // procs
    try:
        for line in named_backend(args).logs(args.name, pod, follow=args.follow, tail=args.tail):
            print(line, flush=True)
    except KeyboardInterrupt:
        pass
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.action == "set":
        if args.value is None:
            raise KtliteError(
                "ktlite config set needs a key and a value, e.g. "
                "`ktlite config set backend kubernetes`"
            )
        config.set_value(args.key, args.value)
        print(f"{args.key} = {args.value}")
    elif args.action == "unset":
        config.unset(args.key)
    elif args.action == "get":  # the value on stdout (for scripts), where it came from on stderr
        value, origin = config.origin(args.key)
        print(
            f"{args.key}: {origin}" if value is not None else f"{args.key} is not set: {origin}",
            file=sys.stderr,
        )
        if value is None:
            return 1
        print(value)
    else:
        for key in sorted(config.KEYS):
            value, origin = config.origin(key)
            print(f"{key:18} {value if value is not None else '-':30} {origin}")
    return 0


# Kubetorch's commands that ktlite does not have, and what to use instead
_REFUSED_COMMANDS = {
    "debug": "ktlite has no remote debugger; `ktlite logs NAME --rank R` shows a rank's output and "
    "`ktlite status NAME` what every rank is doing",
    "apply": "ktlite builds its own manifests from kt.Compute (`ktlite deploy --dry-run` prints them); "
    "run a raw manifest with `kubectl apply`",
    "ssh": "use `kubectl exec -it NAME-0 -- bash` (Kubernetes) or ssh to the host (backend ssh)",
    "volumes": "volumes are created with a deployment (kt.Compute(volumes=[kt.Volume(...)])) and "
    "deleted with `ktlite teardown NAME --volumes`; list them with `kubectl get pvc`",
    "notebook": "run Jupyter where you like and deploy from it: kt.fn(f).to(compute) works in a notebook",
    "secrets": "secrets are given per Compute (kt.Compute(secrets=['aws', kt.secret(...)])) and "
    "created with the deployment; list them with `kubectl get secrets`",
}


def _refused(command: str, asked_help: bool) -> int:
    """Kubetorch's ``kt COMMAND`` that ktlite lacks: what to use instead (exit 2; 0 for --help)."""
    print(
        f"ktlite: `{command}` is Kubetorch's command and not ktlite's: "
        f"{_REFUSED_COMMANDS[command]}",
        file=sys.stdout if asked_help else sys.stderr,
    )
    return 0 if asked_help else 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ktlite",
        description="Run Python functions on N pods.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog stays one line
        epilog=f"Kubetorch commands not in ktlite: {', '.join(_REFUSED_COMMANDS)} "
        "(`ktlite COMMAND` says what to use instead).\n"
        "KTLITE_LOG_LEVEL=INFO (or DEBUG) shows ktlite's diagnostics on stderr, and in the pods' logs.",
    )
    p.add_argument("--version", action="version", version=f"ktlite {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, example: str, func: object) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=f"{help}. Example: {example}")
        c.set_defaults(func=func)
        return c

    def where(c: argparse.ArgumentParser) -> None:
        c.add_argument(
            "--backend", default=None, help="local, kubernetes or ssh (default: ktlite config)"
        )
        c.add_argument("--namespace", "-n", default=None, help="Kubernetes namespace")

    dp = command(
        "deploy",
        "deploy the decorated functions and classes of a script",
        "ktlite deploy train.py   |   ktlite deploy train.py:step --dry-run",
        _deploy,
    )
    dp.add_argument("target", help="SCRIPT.py, or SCRIPT.py:NAME for one of its objects")
    dp.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be created (Kubernetes manifests as YAML) and change nothing",
    )
    ls = command("list", "list deployments", "ktlite list --backend kubernetes", _list)
    where(ls)
    td = command(
        "teardown",
        "stop deployments and delete what they created",
        "ktlite teardown train   |   ktlite teardown --all -y",
        _teardown,
    )
    td.add_argument("names", nargs="*")
    td.add_argument("--all", action="store_true", help="every deployment of the backend")
    td.add_argument("--prefix", default=None, help="every deployment whose name starts with PREFIX")
    td.add_argument(
        "-y",
        "--yes",
        "-f",
        "--force",
        action="store_true",
        help="do not ask before --all / --prefix",
    )
    td.add_argument(
        "--volumes",
        action="store_true",
        help="also delete the deployment's PVCs (local: the volume directories it made)",
    )
    td.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for pods to go")
    td.add_argument(
        "--expired",
        action="store_true",
        help="every deployment idle for longer than its inactivity_ttl",
    )
    td.add_argument(
        "--dry-run", action="store_true", help="print what would be torn down; change nothing"
    )
    where(td)
    lg = command("logs", "print a deployment's pod logs", "ktlite logs train -f --pod 1", _logs)
    lg.add_argument("name")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.add_argument("-p", "--pod", type=int, default=None, help="only this pod (its ordinal)")
    lg.add_argument("--rank", type=int, default=None, help="only the pod holding this rank")
    lg.add_argument(
        "-t", "--tail", type=int, default=None, help="only the last N lines of each pod"
    )
    where(lg)
    st = command(
        "status",
        "show a deployment's ranks: state, CPU, memory, GPUs, running calls "
        "(exit 2 if a rank is stuck)",
        "ktlite status train   |   ktlite status train --watch 1   |   ktlite status train --json",
        status_command,
    )
    st.add_argument("name")
    st.add_argument(
        "--watch",
        "-w",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    st.add_argument(
        "--json",
        action="store_true",
        help="print the pods' status as JSON (with --watch: one JSON line per refresh)",
    )
    st.add_argument(
        "--stuck-after",
        type=float,
        default=None,
        help="a rank busy longer than this many seconds is STUCK (default 600)",
    )
    where(st)
    cl = command(
        "call",
        "call a deployed function (or a method of a deployed class)",
        "ktlite call square --args '[7]'   |   ktlite call model --method predict "
        "--kwargs '{\"x\": 1}'",
        _call,
    )
    cl.add_argument("name")
    cl.add_argument("--args", default="[]", help="positional arguments as a JSON list")
    cl.add_argument("--kwargs", default="{}", help="keyword arguments as a JSON object")
    cl.add_argument("--method", default=None, help="for a deployed class: the method to call")
    cl.add_argument(
        "--timeout", type=float, default=None, help="seconds before the call is stopped"
    )
    where(cl)
    run_cli.add_command(command, where)
    dashboard_cli.add_command(command)
    portforward_cli.add_command(command, where)
    for alias in ("check", "describe"):  # Kubetorch's names for a deployment's health and status
        ck = command(
            alias,
            f"Kubetorch's `kt {alias}`: the same as `ktlite status`",
            f"ktlite {alias} train",
            status_command,
        )
        ck.add_argument("name")
        ck.add_argument(
            "--watch", "-w", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS"
        )
        ck.add_argument("--json", action="store_true")
        ck.add_argument("--stuck-after", type=float, default=None)
        where(ck)
    from ktlite.commands import store_cli

    store_cli.add_commands(command, where)
    cf = command(
        "config", "read and change settings", "ktlite config set backend kubernetes", _config
    )
    cf.add_argument("action", choices=["get", "set", "unset", "list"])
    cf.add_argument("key", nargs="?", default=None, choices=sorted(config.KEYS))
    cf.add_argument("value", nargs="?", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    logconfig.configure()  # ktlite's warnings on stderr, at KTLITE_LOG_LEVEL's level
    raw = list(sys.argv[1:] if argv is None else argv)
    word = next((a for a in raw if not a.startswith("-")), None)
    if word in _REFUSED_COMMANDS:
        return _refused(word, asked_help=bool({"-h", "--help"} & set(raw)))
    p = _parser()
    command_line: list[str] = []
    if "--" in raw and "run" in raw[: raw.index("--")]:  # `ktlite run [opts] -- CMD ...`
        command_line = raw[raw.index("--") + 1 :]
        raw = raw[: raw.index("--")]
    args = p.parse_args(raw)
    args.command_line = command_line
    if args.command == "config" and args.action != "list" and args.key is None:
        p.error(f"ktlite config {args.action} needs a key: one of {', '.join(sorted(config.KEYS))}")
    try:
        return int(args.func(args))
    except KtliteError as e:
        if args.debug:
            raise
        print(f"ktlite: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
