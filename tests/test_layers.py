"""The layers of ARCHITECTURE.md, checked over the import graph (so they stay true).

Every module of ``ktlite``, ``ktlite_server`` and ``ktlite_wire`` is read with ``ast`` (nothing is
imported). A module may import only modules of its own layer or a lower one; the server and the
wire import nothing of the client; no two modules import each other, however indirectly; and no
module is over 500 lines. ``if TYPE_CHECKING:`` imports count for the layers (a type is a
dependency too) but not for circles (they never run).
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = {
    "ktlite": ROOT / "ktlite",
    "ktlite_server": ROOT / "server/ktlite_server",
    "ktlite_wire": ROOT / "wire/ktlite_wire",
}
MAX_LINES = 500

# (layer, module prefixes), lowest first. A module belongs to the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("wire", ("ktlite_wire",)),
    ("server", ("ktlite_server",)),
    (
        "foundation",
        (
            "ktlite.errors",
            "ktlite.config",
            "ktlite.distributed",
            "ktlite.logconfig",
            "ktlite.version",
        ),
    ),
    ("specs", ("ktlite.specs",)),
    ("net", ("ktlite.net",)),
    ("backends", ("ktlite.backends",)),
    ("datastore", ("ktlite.datastore",)),
    ("modes", ("ktlite.modes",)),
    ("api", ("ktlite.api",)),
    ("face", ("ktlite", "ktlite.compute")),
    ("workers", ("ktlite.groups", "ktlite.workers")),
    ("dashboard", ("ktlite.dashboard",)),
    ("commands", ("ktlite.commands",)),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# Which top packages each package may import at all (besides itself): the server and the
# rank processes it starts load no client code, and the wire loads nothing of either side.
# Known upward imports, each with why it stays for now; a new one fails the test.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
MAY_IMPORT = {"ktlite_wire": set(), "ktlite_server": {"ktlite_wire"}, "ktlite": {"ktlite_wire"}}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for top, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _where(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py::LAYERS: add it")
    return best


def _resolve(name: str) -> str | None:
    """The longest known module that ``name`` (a module or a module's attribute) starts with."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, only under TYPE_CHECKING) for every import of a known module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, typing_only: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk_stmt(stmt, True)
                for stmt in child.orelse:
                    yield from walk_stmt(stmt, typing_only)
                continue
            yield from walk_stmt(child, typing_only)

    def walk_stmt(node: ast.AST, typing_only: bool) -> Iterator[tuple[str, int, bool]]:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
        for target in targets:
            found = _resolve(target)
            if found is not None and found != module:
                yield found, node.lineno, typing_only
        if not isinstance(node, ast.Import | ast.ImportFrom):
            yield from walk(node, typing_only)

    yield from walk(tree, False)


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_back_up_a_layer() -> None:
    bad: list[str] = []
    for module in sorted(MODULES):
        top = module.split(".")[0]
        for target, line, _ in imports(module):
            target_top = target.split(".")[0]
            if target_top != top and target_top not in MAY_IMPORT[top]:
                bad.append(
                    f"{_where(MODULES[module])}:{line}: {module} imports {target} "
                    f"({top} may import only {sorted(MAY_IMPORT[top]) or 'itself'})"
                )
            elif (
                RANK[layer_of(target)] > RANK[layer_of(module)]
                and (module, target) not in ALLOWED_UPWARD
            ):
                bad.append(
                    f"{_where(MODULES[module])}:{line}: {module} "
                    f"({layer_of(module)}) imports {target} ({layer_of(target)}), "
                    "a higher layer"
                )
    assert not bad, "imports that run back up:\n" + "\n".join(dict.fromkeys(bad))


def _circles() -> list[list[str]]:
    graph = {m: sorted({t for t, _, typing_only in imports(m) if not typing_only}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def test_no_import_circle() -> None:
    circles = _circles()
    assert not circles, (
        "modules that import each other (directly or through others):\n"
        + "\n".join(" <-> ".join(c) for c in circles)
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_500_lines(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{_where(MODULES[module])} has {lines} lines; split it "
        f"along the nouns it owns (the limit is {MAX_LINES})"
    )


def test_the_checker_sees_an_upward_import_and_a_circle(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above can fail: a made-up package with both faults is caught."""
    pkg = tmp_path / "ktlite"
    (pkg / "specs").mkdir(parents=True)
    (pkg / "modes").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "specs/__init__.py").write_text("")
    (pkg / "modes/__init__.py").write_text("")
    (pkg / "specs/a.py").write_text("from ktlite.modes import b\n")
    (pkg / "modes/b.py").write_text("import ktlite.specs.a\n")
    monkeypatch.setitem(SOURCES, "ktlite", pkg)
    fake = {}
    for path in pkg.rglob("*.py"):
        parts = ["ktlite", *path.relative_to(pkg).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        fake[".".join(parts)] = path
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    with pytest.raises(
        AssertionError, match=r"ktlite\.specs\.a \(specs\) imports ktlite\.modes\.b"
    ):
        test_no_import_runs_back_up_a_layer()
    with pytest.raises(AssertionError, match=r"ktlite\.modes\.b <-> ktlite\.specs\.a"):
        test_no_import_circle()


def test_import_ktlite_compute_is_the_module_and_the_decorator() -> None:
    """``import ktlite.compute`` gives a module (it used to give the decorator that hid it)."""
    import types

    import ktlite as kt
    import ktlite.compute

    module = sys.modules["ktlite.compute"]
    assert isinstance(module, types.ModuleType)
    assert module.Compute is kt.Compute and ktlite.compute is module and kt.compute is module
    decorated = kt.compute(cpus=1, name="layers-probe")(lambda x: x)
    assert decorated.compute_kwargs == {"cpus": 1}
