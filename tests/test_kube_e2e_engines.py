"""Part 'ray-monarch' of the stand-in cluster run of ``tests/kubernetes``: a real Ray cluster
and a real Monarch mesh across pods (the run and its parts: ``tests/kube_e2e.py``). Long
real-engine tests: marked `ray` and `monarch`, so the default run leaves them to
``pytest -m "ray or monarch or ssh"`` (``.ci/test``'s second half)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kube_e2e import PART_S, needs_root, run_part, stand_in_fixture

_stand_in = stand_in_fixture()  # the module fixture `stand_in`: this part's stand-in cluster

pytestmark = [pytest.mark.ray, pytest.mark.monarch]


@needs_root
@pytest.mark.timeout(PART_S + 60)
def test_ray_monarch_against_the_stand_in_cluster(
    stand_in: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    run_part("ray-monarch", stand_in, tmp_path)
