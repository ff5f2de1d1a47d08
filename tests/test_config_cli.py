"""``ktlite config`` and the settings file, backend selection, and the ``ktlite`` command line
(help, logs, list, teardown --all) against real local deployments.

Tests that touch settings point KTLITE_HOME at their own tmp_path (monkeypatch), so nothing
leaks into the xdist worker's home or into other tests.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ktlite as kt
from ktlite import config
from ktlite.backends.base import Plan
from ktlite.backends.kubernetes import KubernetesBackend
from ktlite.backends.local import LocalBackend
from ktlite.backends.registry import get_backend
from ktlite.commands import cli

KEYS = sorted(config.KEYS)
ENV_VARS = [env for env, _, _ in config.KEYS.values()]


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private KTLITE_HOME and no KTLITE_* settings in the environment."""
    monkeypatch.setenv("KTLITE_HOME", str(tmp_path))
    for env in ENV_VARS:
        monkeypatch.delenv(env, raising=False)
    return tmp_path


def ktlite(
    home: Path, *args: str, env: dict[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """The real command line, as a subprocess."""
    environ = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    environ.update(KTLITE_HOME=str(home), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        env=environ,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command line in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse errors and --help
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


class Terminal(io.StringIO):
    """Standard input that is a terminal, holding what the user types."""

    def isatty(self) -> bool:
        return True


def _list_rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line.strip()}


# ---- ktlite config ---------------------------------------------------------------------------


def test_config_set_get_list_unset(home: Path) -> None:
    done = ktlite(home, "config", "set", "backend", "kubernetes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "backend = kubernetes"
    assert json.loads((home / "config.json").read_text()) == {"backend": "kubernetes"}

    got = ktlite(home, "config", "get", "backend")
    assert (got.returncode, got.stdout) == (0, "kubernetes\n")

    listed = ktlite(home, "config", "list")
    assert listed.returncode == 0, listed.stderr
    rows = _list_rows(listed.stdout)
    assert sorted(rows) == KEYS  # every key
    assert rows["backend"].split()[1] == "kubernetes"
    for key in KEYS:
        if key != "backend":
            assert rows[key].split()[1] == "-", rows[key]
    assert "from KTLITE_BACKEND" not in listed.stdout

    assert ktlite(home, "config", "unset", "backend").returncode == 0
    assert json.loads((home / "config.json").read_text()) == {}
    gone = ktlite(home, "config", "get", "backend")  # back to the built-in default
    assert (gone.returncode, gone.stdout) == (0, "local\n")


def test_config_get_says_where_the_value_comes_from(home: Path) -> None:
    default = ktlite(home, "config", "get", "backend")
    assert (default.returncode, default.stdout) == (0, "local\n"), default.stderr
    assert default.stderr.startswith("backend: the default"), default.stderr
    assert "KTLITE_BACKEND" in default.stderr and "ktlite config set backend" in default.stderr

    assert ktlite(home, "config", "set", "backend", "kubernetes").returncode == 0
    saved = ktlite(home, "config", "get", "backend")
    assert (saved.returncode, saved.stdout) == (0, "kubernetes\n"), saved.stderr
    assert saved.stderr == f"backend: from the config file {home / 'config.json'}\n"

    env = ktlite(home, "config", "get", "backend", env={"KTLITE_BACKEND": "ssh"})
    assert (env.returncode, env.stdout, env.stderr) == (
        0,
        "ssh\n",
        "backend: from KTLITE_BACKEND\n",
    )

    unset = ktlite(home, "config", "get", "namespace")  # no fixed default: it is the cluster's
    assert (unset.returncode, unset.stdout) == (1, ""), unset.stderr
    assert unset.stderr.startswith("namespace is not set: Kubernetes namespace"), unset.stderr
    listed = _list_rows(ktlite(home, "config", "list").stdout)
    assert listed["backend"].split()[1:4] == ["kubernetes", "from", "the"], listed["backend"]


def test_environment_beats_the_file_and_list_says_so(home: Path) -> None:
    assert ktlite(home, "config", "set", "backend", "kubernetes").returncode == 0
    env = {"KTLITE_BACKEND": "local"}
    got = ktlite(home, "config", "get", "backend", env=env)
    assert (got.returncode, got.stdout) == (0, "local\n")
    rows = _list_rows(ktlite(home, "config", "list", env=env).stdout)
    assert rows["backend"].split()[1] == "local"
    assert "from KTLITE_BACKEND" in rows["backend"]
    assert "from KTLITE" not in rows["namespace"]
    # the file itself is untouched
    assert json.loads((home / "config.json").read_text()) == {"backend": "kubernetes"}


def test_config_keeps_other_keys(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(capsys, "config", "set", "namespace", "team-a")[0] == 0
    assert main(capsys, "config", "set", "image_pull_policy", "IfNotPresent")[0] == 0
    assert main(capsys, "config", "set", "namespace", "team-b")[0] == 0
    assert json.loads((home / "config.json").read_text()) == {
        "namespace": "team-b",
        "image_pull_policy": "IfNotPresent",
    }
    assert config.get("namespace") == "team-b"
    assert main(capsys, "config", "unset", "namespace")[0] == 0
    assert json.loads((home / "config.json").read_text()) == {"image_pull_policy": "IfNotPresent"}
    assert main(capsys, "config", "get", "namespace")[:2] == (1, "")


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (("backend", "nope"), ["backend='nope'", "local", "kubernetes"]),
        (
            ("image_pull_policy", "sometimes"),
            ["image_pull_policy='sometimes'", "Always", "IfNotPresent", "Never"],
        ),
    ],
    ids=["backend", "image_pull_policy"],
)
def test_disallowed_value_fails_with_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, str], wanted: list[str]
) -> None:
    code, out, err = main(capsys, "config", "set", *args)
    assert code != 0 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ktlite: error:") and "allowed" in lines[0]
    for text in wanted:
        assert text in lines[0], (text, lines[0])
    assert not (home / "config.json").exists()


def test_disallowed_value_in_a_real_process_has_no_traceback(home: Path) -> None:
    done = ktlite(home, "config", "set", "backend", "nope")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "ktlite: error: backend='nope' is not allowed; allowed: local, kubernetes, ssh"
    ]
    assert done.stdout == ""


def test_unknown_key_names_the_allowed_keys(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main(capsys, "config", "set", "colour", "blue")
    assert code != 0 and out == ""
    assert "Traceback" not in err
    error = [ln for ln in err.splitlines() if "error" in ln]
    assert len(error) == 1, err
    assert "'colour'" in error[0]
    for key in KEYS:
        assert key in error[0], (key, error[0])
    assert not (home / "config.json").exists()


def test_set_without_a_value_fails_clearly(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main(capsys, "config", "set", "backend")
    assert code != 0 and out == ""
    assert err.splitlines() == [
        "ktlite: error: ktlite config set needs a key and a value, e.g. "
        "`ktlite config set backend kubernetes`"
    ]
    assert not (home / "config.json").exists()

    code, _, err = main(capsys, "config", "get")
    assert code != 0
    assert "needs a key" in err and "backend" in err and "Traceback" not in err


def test_broken_config_file_is_reported_not_a_traceback(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (home / "config.json").write_text("{not json")
    code, _, err = main(capsys, "config", "list")
    assert code == 1
    assert err.startswith("ktlite: error:") and "config.json" in err and "fix or delete it" in err
    assert "Traceback" not in err


# ---- backend selection -----------------------------------------------------------------------


def plan_me(x: int) -> int:
    return x * 2


def test_get_backend_follows_the_config_file(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(home / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(KubernetesBackend, "_clients", {})
    assert isinstance(get_backend(None), LocalBackend)  # nothing configured

    assert main(capsys, "config", "set", "backend", "kubernetes")[0] == 0
    backend = get_backend(None)
    assert isinstance(backend, KubernetesBackend)
    assert isinstance(get_backend(None, "team-a"), KubernetesBackend)
    assert KubernetesBackend._clients == {}  # no cluster touched

    # an explicit Compute(backend=...) wins over the file
    assert isinstance(get_backend(kt.Compute(backend="local").backend), LocalBackend)
    local_plan = kt.fn(plan_me).to(kt.Compute(backend="local"), dryrun=True)
    assert isinstance(local_plan, Plan) and local_plan.backend == "local"
    kube_plan = kt.fn(plan_me).to(kt.Compute(), dryrun=True)
    assert isinstance(kube_plan, Plan) and kube_plan.backend == "kubernetes"
    assert KubernetesBackend._clients == {}

    # the environment wins over the file
    monkeypatch.setenv("KTLITE_BACKEND", "local")
    assert isinstance(get_backend(None), LocalBackend)


# ---- help ------------------------------------------------------------------------------------


def test_help_lists_the_commands(home: Path) -> None:
    done = ktlite(home, "--help")
    assert done.returncode == 0, done.stderr
    for command in ("list", "teardown", "logs", "config"):
        assert command in done.stdout, command


@pytest.mark.parametrize("command", ["list", "teardown", "logs", "config"])
def test_every_command_help_has_an_example(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, out, _ = main(capsys, command, "--help")
    assert code == 0
    assert "Example" in out
    assert f"ktlite {command}" in " ".join(out.split())  # the example is a real command line


# ---- logs against a real local deployment ----------------------------------------------------

LOG_NAME = "cfgcli-logs"
MARKER = "cfgcli-marker-7d1e"


def shout(tag: str) -> str:
    print(f"{MARKER} {tag}", flush=True)
    return tag


def _wait_for(text: str, read, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if text in got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture(scope="module")
def logged() -> Iterator[kt.RemoteFunction]:
    remote = kt.fn(shout, name=LOG_NAME).to(kt.Compute(stream_logs=False))
    try:
        assert remote("one") == "one"
        assert remote("two") == "two"
        _wait_for(f"{MARKER} two", remote.logs)
        yield remote
    finally:
        remote.teardown()


def test_cli_logs_prints_rank_lines_prefixed_with_the_pod(
    logged: kt.RemoteFunction, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(capsys, "logs", LOG_NAME)
    assert code == 0, err
    lines = out.splitlines()
    assert f"[{LOG_NAME}-0] [rank 0] {MARKER} one" in lines
    assert f"[{LOG_NAME}-0] [rank 0] {MARKER} two" in lines
    assert all(line.startswith(f"[{LOG_NAME}-0] ") for line in lines)

    code, by_pod, _ = main(capsys, "logs", LOG_NAME, "--pod", "0")
    assert code == 0 and by_pod == out

    code, tail, _ = main(capsys, "logs", LOG_NAME, "--tail", "1")
    assert code == 0 and tail.splitlines() == lines[-1:]
    assert tail.splitlines() == [f"[{LOG_NAME}-0] [rank 0] {MARKER} two"]

    # the library call returns the same text
    assert logged.logs() == out.rstrip("\n")
    assert logged.logs(rank=0) == out.rstrip("\n")
    assert logged.logs(tail=1) == tail.rstrip("\n")


def test_remote_logs_rejects_a_rank_beyond_the_world(logged: kt.RemoteFunction) -> None:
    with pytest.raises(kt.ConfigError, match="rank=5"):
        logged.logs(rank=5)
    with pytest.raises(kt.ConfigError):
        logged.logs(rank=-1)


def test_cli_logs_of_a_pod_that_does_not_exist_fails(
    logged: kt.RemoteFunction, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(capsys, "logs", LOG_NAME, "--pod", "5")
    assert code != 0 and out == ""
    assert "5" in err and LOG_NAME in err


def test_cli_logs_of_a_missing_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = main(capsys, "logs", "cfgcli-never-deployed")
    assert code == 1 and out == ""
    assert err.startswith("ktlite: error:") and "cfgcli-never-deployed" in err


# ---- list / teardown --all -------------------------------------------------------------------


def test_list_and_teardown_all_asks_first(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "cfgcli-td"
    backend = LocalBackend.shared()
    assert main(capsys, "list")[1].strip() == "no deployments"
    remote = kt.fn(shout, name=name).to(kt.Compute(stream_logs=False))
    try:
        code, out, _ = main(capsys, "list")
        assert code == 0
        header, *rows = out.splitlines()
        assert header.split() == [
            *("NAME", "BACKEND", "NAMESPACE", "READY", "MODE", "DETACHED", "IDLE", "DEADLINE")
        ]
        # no inactivity_ttl: no idle time or deadline to show
        assert [r.split() for r in rows] == [[name, "local", "-", "1/1", "pods", "False", "-", "-"]]

        monkeypatch.setattr("sys.stdin", Terminal("n\n"))  # a user at a terminal answers n
        code, out, _ = main(capsys, "teardown", "--all")
        assert code == 1
        assert name in out and out.endswith("[y/N] nothing torn down\n"), out  # the prompt, then
        assert backend.lookup(name) is not None  # still running
        assert remote("still") == "still"

        def refuse(prompt: str = "") -> str:
            raise AssertionError("-y must not ask")

        monkeypatch.setattr("builtins.input", refuse)
        code, out, _ = main(capsys, "teardown", "--all", "-y")
        assert code == 0
        assert out.splitlines() == [f"{name}: torn down"]
        assert backend.lookup(name) is None
        assert main(capsys, "list")[1].strip() == "no deployments"

        code, _, err = main(capsys, "teardown")
        assert code == 1 and err == "nothing to tear down: nothing is deployed on backend 'local'\n"
        code, out, err = main(capsys, "teardown", name)
        assert (code, out) == (1, "")
        assert (
            err
            == f"ktlite: error: no deployment named {name!r}: nothing is deployed on backend 'local'\n"
        )
    finally:
        backend.teardown(name, timeout=5)
