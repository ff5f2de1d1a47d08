"""Part 'store-groups' of the stand-in cluster run of ``tests/kubernetes``: the data store and
worker groups (the run and its parts: ``tests/kube_e2e.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kube_e2e import PART_S, needs_root, run_part, stand_in_fixture

_stand_in = stand_in_fixture()  # the module fixture `stand_in`: this part's stand-in cluster


@needs_root
@pytest.mark.timeout(PART_S + 60)
def test_store_groups_against_the_stand_in_cluster(
    stand_in: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    run_part("store-groups", stand_in, tmp_path)
