"""The ``ktlite`` command line: list and tear down deployments."""

from __future__ import annotations

import argparse
import sys

from ktlite import __version__
from ktlite.backends.base import get_backend
from ktlite.errors import KtliteError


def _list(args: argparse.Namespace) -> int:
    rows = get_backend(args.backend).list()
    if not rows:
        print("no deployments")
        return 0
    print(f"{'NAME':30} {'BACKEND':12} {'READY':8} DETACHED")
    for r in rows:
        print(f"{r['name']:30} {r['backend']:12} {str(r['ready']) + '/' + str(r['pods']):8} {r['detached']}")
    return 0


def _teardown(args: argparse.Namespace) -> int:
    backend = get_backend(args.backend)
    names = [r["name"] for r in backend.list()] if args.all else args.names
    if not names:
        print("nothing to tear down; name a deployment or pass --all", file=sys.stderr)
        return 1
    for name in names:
        found = backend.teardown(name)
        print(f"{name}: {'torn down' if found else 'not found'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ktlite", description="Run Python functions on N pods.")
    p.add_argument("--version", action="version", version=f"ktlite {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list deployments", description="Example: ktlite list")
    ls.add_argument("--backend", default=None)
    ls.set_defaults(func=_list)
    td = sub.add_parser("teardown", help="stop deployments",
                        description="Example: ktlite teardown train   |   ktlite teardown --all")
    td.add_argument("names", nargs="*")
    td.add_argument("--all", action="store_true")
    td.add_argument("--backend", default=None)
    td.set_defaults(func=_teardown)
    args = p.parse_args(argv)
    try:
        return int(args.func(args))
    except KtliteError as e:
        if args.debug:
            raise
        print(f"ktlite: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
