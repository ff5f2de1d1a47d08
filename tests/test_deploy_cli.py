"""``ktlite deploy`` driven as a user would (subprocesses, real local pods), and the
decorators it deploys: dry-run YAML, deploy, call by name from another process, teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import yaml

import ktlite as kt
from ktlite.api.decorators import Decorated

SCRIPT = """
import ktlite as kt

@kt.compute(cpus=1, name="{name}")
def square(x):
    print("squaring", x)
    return x * x

@kt.distribute("pytorch", workers=2, num_proc=2)
@kt.compute(cpus="500m", memory="1Gi", backend="kubernetes", namespace="ml", name="{name}-k8s")
def step(x):
    return x

if __name__ == "__main__":
    print("main says", square(7))
"""


def _run(
    args: list[str], cwd: Path, home: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KTLITE_HOME": str(home)}
    env.pop("KTLITE_BACKEND", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def script(tmp_path: Path) -> tuple[Path, str]:
    name = f"dc-{uuid.uuid4().hex[:6]}"
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT.format(name=name)))
    return tmp_path, name


def test_dry_run_prints_the_manifests_as_yaml_and_touches_nothing(script: tuple[Path, str]) -> None:
    where, name = script
    run = _run(
        [sys.executable, "-m", "ktlite.commands.cli", "deploy", "script.py:step", "--dry-run"],
        where,
        where / "home",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"# ktlite plan for '{name}-k8s' on backend 'kubernetes'")
    docs = list(yaml.safe_load_all(run.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Secret", "Service", "NetworkPolicy", "StatefulSet"]
    sts = docs[-1]
    assert sts["metadata"]["namespace"] == "ml" and sts["spec"]["replicas"] == 2
    # the same objects as the Python API's plan
    compute = kt.Compute(
        cpus="500m", memory="1Gi", backend="kubernetes", namespace="ml"
    ).distribute("pytorch", workers=2, num_proc=2)
    plan = kt.fn(lambda x: x).to(compute, name=f"{name}-k8s", dryrun=True)
    assert isinstance(plan, kt.Plan)
    assert docs == plan.manifests
    assert not (where / "home" / "local").exists()


def test_deploy_then_call_by_name_from_another_process_then_teardown(
    script: tuple[Path, str],
) -> None:
    where, name = script
    home = where / "home"
    try:
        run = _run(
            [sys.executable, "-m", "ktlite.commands.cli", "deploy", "script.py:square"], where, home
        )
        assert run.returncode == 0, run.stderr
        assert f"{name}: deployed on local: 1 pod(s), 1/1 ranks ready" in run.stdout
        call = _run(
            [sys.executable, "-c", "import script; print('got', script.square(6))"], where, home
        )
        assert call.returncode == 0, call.stderr
        assert "got 36" in call.stdout and f"[rank 0 @ {name}-0] squaring 6" in call.stdout
        listed = _run([sys.executable, "-m", "ktlite.commands.cli", "list"], where, home)
        assert name in listed.stdout
    finally:
        down = _run([sys.executable, "-m", "ktlite.commands.cli", "teardown", name], where, home)
    assert f"{name}: torn down" in down.stdout
    call = _run([sys.executable, "-c", "import script; script.square(6)"], where, home)
    assert call.returncode != 0
    assert "is not deployed: run `ktlite deploy" in call.stderr


def test_running_the_script_deploys_on_first_call(script: tuple[Path, str]) -> None:
    where, name = script
    run = _run([sys.executable, "script.py"], where, where / "home")
    assert run.returncode == 0, run.stderr
    assert "main says 49" in run.stdout


def test_unknown_target_and_script_without_decorators_fail_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("def f():\n    return 1\n")
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT.format(name="x")))
    for target, words in (
        ("plain.py", "no function or class decorated"),
        ("script.py:nope", "has no decorated 'nope'; it has: square, step"),
        ("missing.py", "no such file"),
    ):
        run = _run(
            [sys.executable, "-m", "ktlite.commands.cli", "deploy", target],
            tmp_path,
            tmp_path / "home",
        )
        assert run.returncode == 1
        assert words in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_decorators_stack_in_either_order_and_validate_early() -> None:
    def f(x: int) -> int:
        return x

    a = kt.compute(cpus=2)(kt.distribute("pytorch", workers=3)(f))
    b = kt.distribute("pytorch", workers=3)(kt.compute(cpus=2)(f))
    assert isinstance(a, Decorated) and isinstance(b, Decorated)
    assert a.compute == b.compute == kt.Compute(cpus=2).distribute("pytorch", workers=3)
    assert a.__name__ == "f" and a.__wrapped__ is f
    with pytest.raises(kt.ConfigError, match="memory"):
        kt.compute(memory="4 gigs")
    with pytest.raises(kt.ConfigError, match="workers"):
        kt.distribute("pytorch", workers=0)
    with pytest.raises(kt.ConfigError, match="two @kt.compute"):
        kt.compute(cpus=1)(kt.compute(cpus=2)(f))
