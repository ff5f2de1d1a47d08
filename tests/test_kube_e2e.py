"""The stand-in cluster run of ``tests/kubernetes`` (``tests/kube_e2e.py``): its parts run in
``tests/test_kube_e2e_<part>.py``, one module each, so that pytest-xdist spreads them; here,
that the parts cover the suite once and that each part has its module."""

from __future__ import annotations

import re
from pathlib import Path

from kube_e2e import PART_FILES, PARTS, check_parts_cover_the_suite_once

HERE = Path(__file__).parent


def test_the_parts_cover_the_suite_once(tmp_path: Path) -> None:
    """Every test of ``tests/kubernetes`` is in exactly one part, and every selector of a part
    selects a test (a new test, or a renamed one, fails here until it is put in a part)."""
    check_parts_cover_the_suite_once(tmp_path)


def test_each_part_runs_in_its_own_module() -> None:
    assert sorted(PART_FILES) == sorted(PARTS)
    modules = sorted(p.name for p in HERE.glob("test_kube_e2e_*.py"))
    assert modules == sorted(PART_FILES.values()), modules
    for part, name in PART_FILES.items():
        text = (HERE / name).read_text()
        assert re.findall(r'run_part\("([^"]+)"', text) == [part], (name, part)
