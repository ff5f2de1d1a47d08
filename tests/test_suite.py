"""The suite itself: tests that need an optional extra skip alone, not with their neighbours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_pure_tests_run_without_torch(tmp_path: Path) -> None:
    # a `torch` that cannot be imported, first on the path: as on a machine without the extra
    hidden = tmp_path / "torch"
    hidden.mkdir()
    (hidden / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\' (hidden by this test)", name="torch")\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KTLITE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            str(HERE / "test_pure.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parent,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    # only the tests that use torch skip, each for that reason; the rest ran and passed
    assert skips and all("could not import 'torch'" in line for line in skips), (
        "\n".join(skips) or out[-4000:]
    )
    assert " passed" in summary and int(summary.split(" passed")[0].split()[-1]) >= 80, summary


def test_collecting_the_suite_imports_no_heavy_module(
    heavy_modules_imported_by_collection: list[str],
) -> None:
    # each xdist worker collects every module: a module-level `import torch` (a test module's,
    # or a helper's it imports) costs every worker a torch import its tests may never need
    assert heavy_modules_imported_by_collection == [], (
        f"collecting the tests imported {heavy_modules_imported_by_collection}: import them in "
        "the tests (or fixtures) that use them, e.g. conftest's `torch` fixture"
    )
