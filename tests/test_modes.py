"""Modes as strategies over one call path: the mode is chosen once, from the spec, and held by
the one Deployment class; the call-path modules are small and free of import circles."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import ktlite as kt
from ktlite.modes.deploy import Deployment, mode_for
from ktlite.modes.fanout import Fanout, HeadOnly
from ktlite.modes.routing import Routing
from ktlite.specs.deployment_spec import DeploymentSpec

PACKAGE = Path(kt.__file__).parent
# the modules of the call path and its modes (client side)
CALL_PATH = tuple(
    [
        "deploy",
        "callpath",
        "mode",
        "fanout",
        "replacement",
        "routing",
        "replicas",
        "serving",
        "outcomes",
        "remote",
        "handles",
        "adverbs",
        "reattach",
        "naming",
        "decorators",
        "supervisor",
        "autoscalers",
    ]
)


def _spec(compute: kt.Compute) -> DeploymentSpec:
    return DeploymentSpec(name="m", pod=compute.pod_spec())


def test_the_mode_is_chosen_once_from_the_spec() -> None:
    assert mode_for(_spec(kt.Compute())) is Fanout
    assert mode_for(_spec(kt.Compute().distribute("pytorch", workers=2))) is Fanout
    assert mode_for(_spec(kt.Compute().distribute("ray", workers=2))) is HeadOnly
    assert mode_for(_spec(kt.Compute().distribute("monarch", workers=2))) is HeadOnly
    assert mode_for(_spec(kt.Compute().autoscale(min_scale=1, max_scale=2))) is Routing


def test_one_deployment_class_holds_its_mode_by_composition() -> None:
    for info in pkgutil.walk_packages([str(PACKAGE)], "ktlite."):
        if info.name.split(".")[1] in CALL_PATH:
            importlib.import_module(info.name)
    assert Deployment.__subclasses__() == []  # no mode overrides the call path


def test_a_call_returns_one_value_exactly_where_the_mode_says() -> None:
    dep = Deployment.__new__(Deployment)
    cases = [
        (kt.Compute(), True),
        (kt.Compute().distribute("pytorch", workers=2), False),
        (kt.Compute().distribute("ray", workers=2), True),
    ]
    for compute, single in cases:
        dep.spec = _spec(compute)
        assert mode_for(dep.spec)(dep).single is single, compute


def _imports(path: Path) -> set[str]:
    """Every ktlite module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ktlite"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ktlite"))
    return found


def _path(module: str) -> Path:
    """The file of a call-path module, in whichever layer sub-package holds it (the import
    circles and module sizes of the whole package are tests/test_layers.py's)."""
    (found,) = [p for p in PACKAGE.rglob(f"{module}.py") if p.parent != PACKAGE]
    return found


def _name(node: ast.expr) -> str:
    """``spec`` for ``spec`` and ``self.spec``, ``distributed`` for ``spec.distributed``."""
    return (
        node.id
        if isinstance(node, ast.Name)
        else node.attr
        if isinstance(node, ast.Attribute)
        else ""
    )


def test_only_the_choice_reads_which_mode_a_spec_asks_for() -> None:
    """``spec.autoscale`` and ``distributed.engine`` are read in ``mode_for`` and in the
    strategies themselves, nowhere else on the call path (what a backend reports of a running
    deployment, ``applied.autoscale``, is the pods' own state, not the spec's)."""
    strategies = {"fanout", "routing", "serving", "mode"}
    readers = []
    for m in CALL_PATH:
        tree = ast.parse(_path(m).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.ClassDef)) or m in strategies:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and (node.attr, _name(node.value)) in (
                    ("autoscale", "spec"),
                    ("engine", "distributed"),
                ):
                    readers.append(f"{m}.{fn.name}")
    assert sorted(set(readers)) == ["deploy.mode_for"]
