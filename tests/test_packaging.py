"""What a new user meets first: the built wheel and sdist, and README's two commands.

The wheel and the sdist are built from a copy of the source with setuptools' own PEP 517
hooks (no network, no build isolation: the dev extra brings a setuptools that supports
PEP 639). README's test command runs against a stand-in ``.venv/bin/python`` that records
its arguments and exits as told, so the test checks the command's control flow, not pytest.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL = '.venv/bin/pip install -e ".[dev]" && '


def _source_copy(tmp_path: Path) -> Path:
    """The files a build reads, without this checkout's build leftovers."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("ktlite", "server", "wire"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    return src


def _build(tmp_path: Path, hook: str) -> tuple[Path, str]:
    """Run setuptools' ``build_wheel`` or ``build_sdist`` hook; the artifact and stderr."""
    src, out = _source_copy(tmp_path), tmp_path / "dist"
    out.mkdir()
    code = f"import sys; from setuptools import build_meta; print(build_meta.{hook}(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{hook} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out / proc.stdout.strip().splitlines()[-1], proc.stderr


def _check_metadata(text: str, stderr: str) -> None:
    meta = email.parser.Parser().parsestr(text)
    assert meta["License-Expression"] == "Apache-2.0", dict(meta)
    assert meta.get_all("License-File") == ["LICENSE"], dict(meta)
    # the table form (project.license = {text = ...}) is deprecated by setuptools
    assert "project.license" not in stderr and "License classifiers" not in stderr, stderr


def test_wheel_ships_license_and_type_hints(tmp_path: Path) -> None:
    wheel, stderr = _build(tmp_path, "build_wheel")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        typed = {"ktlite/py.typed", "ktlite_server/py.typed", "ktlite_wire/py.typed"}
        assert typed | {"ktlite_wire/launch.py", f"{info}/licenses/LICENSE"} <= names
        # the dashboard's page ships in the package (it works offline)
        page = {
            f"ktlite/dashboard/static/{n}" for n in ("index.html", "dashboard.js", "dashboard.css")
        }
        assert page <= names, sorted(page - names)
        assert "Apache License" in zf.read(f"{info}/licenses/LICENSE").decode()
        _check_metadata(zf.read(f"{info}/METADATA").decode(), stderr)


def test_sdist_ships_license_and_type_hints(tmp_path: Path) -> None:
    sdist, stderr = _build(tmp_path, "build_sdist")
    with tarfile.open(sdist) as tf:
        top = tf.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{top}/") for n in tf.getnames()}
        typed = {"ktlite/py.typed", "server/ktlite_server/py.typed", "wire/ktlite_wire/py.typed"}
        assert {"LICENSE", *typed} <= names
        pkg_info = tf.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        _check_metadata(pkg_info.read().decode(), stderr)


def _set_up_commands(page: Path) -> list[str]:
    return re.findall(r"^\s*(python3 -m venv \.venv && .*)$", page.read_text(), re.M)


def _readme_commands() -> list[str]:
    commands = _set_up_commands(README)
    assert len(commands) == 2, f"README should show exactly two set-up commands: {commands}"
    return commands


def test_install_page_shows_readmes_commands() -> None:
    assert _set_up_commands(ROOT / "docs" / "install.md") == _readme_commands()


def test_readme_is_a_short_front_page_with_working_links() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 8192, f"README is {len(text.encode())} bytes: move detail to docs/"
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert links, "README links into the docs"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_first_command_runs_an_example_with_a_light_extra() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    first, _ = _readme_commands()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    extra = re.search(r'pip install -e "\.\[(\w+)\]"', first)
    assert extra and extra.group(1) in extras, first
    assert extra.group(1) != "dev", "the first command must not need the whole dev extra"
    assert not any(d.startswith(("ray", "torchmonarch")) for d in extras[extra.group(1)])
    example = re.search(r"\.venv/bin/python (examples/\S+\.py)$", first)
    assert example and (ROOT / example.group(1)).is_file(), first


def test_ci_runs_readmes_test_command() -> None:
    _, second = _readme_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line.startswith(second) for line in ci_lines), (
        f".ci/run must run README's second command as written:\n{second}"
    )


def _stand_in_repo(tmp_path: Path, exit_codes: str) -> tuple[Path, Path, dict[str, str]]:
    """A copy of .ci/ beside a .venv whose python only records its arguments and exits as told."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        '#!/usr/bin/env bash\necho "$*" >> "$STAND_IN_LOG"\n'
        'codes=($STAND_IN_CODES); n=$(wc -l < "$STAND_IN_LOG")\n'
        'exit "${codes[$((n - 1))]}"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = {**os.environ, "STAND_IN_LOG": str(log), "STAND_IN_CODES": exit_codes}
    return repo, log, env


# the exit codes of the calls in turn: the collection that writes the rewritten test modules
# once (its failure is the suite's to report), the suite, the real-engine tests
@pytest.mark.parametrize(
    ("codes", "ok"), [("0 1 0", False), ("0 0 1", False), ("0 0 0", True), ("1 0 0", True)]
)
def test_readme_test_command_runs_both_halves_and_fails_if_either_fails(
    tmp_path: Path, codes: str, ok: bool
) -> None:
    _, second = _readme_commands()
    assert INSTALL in second, second
    test_command = second.split(INSTALL, 1)[1]
    repo, log, env = _stand_in_repo(tmp_path, codes)
    proc = subprocess.run(
        ["bash", "-c", test_command], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    calls = log.read_text().splitlines()
    assert calls == [
        "-m pytest --collect-only -q -p no:cacheprovider",
        "-m pytest -n 4",
        "-m pytest -m ray or monarch or ssh",
    ], (calls, proc.stderr)
    assert (proc.returncode == 0) == ok, (codes, proc.returncode, proc.stderr)
