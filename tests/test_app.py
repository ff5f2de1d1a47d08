"""``kt.app``: whole commands (torchrun jobs) on N replicas, with real processes on the local
backend: a gloo all_reduce across 2 replicas x 2 procs, a replica failing mid-job, a
rendezvous that cannot complete, ``ktlite run`` as a user types it, and bad input.

torchrun starts slowly on a small machine (5-15 s a run), so each deployment is reused
where the tests allow it.
"""

from __future__ import annotations

import concurrent.futures
import gc
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import ktlite as kt
from ktlite.api.apps import pack, run_replica

SCRIPTS = Path(__file__).parent / "app_scripts"
VENV_BIN = str(Path(sys.executable).parent)


def _with_venv_path(path: str) -> str:
    """PATH with this interpreter's bin folder first, as an activated virtualenv has it
    (so that `torchrun` and `python` in a command are this environment's)."""
    return os.pathsep.join([VENV_BIN, *(p for p in path.split(os.pathsep) if p != VENV_BIN)])


@pytest.fixture(scope="module", autouse=True)
def _activated_venv() -> Iterator[None]:
    # local pods inherit the caller's environment when they start
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", _with_venv_path(os.environ.get("PATH", "")))
        yield


@pytest.fixture(scope="module")
def torch_app() -> Iterator[kt.App]:
    app = kt.app(
        cli_command="torchrun --nproc_per_node=2 allreduce.py",
        replicas=2,
        name="app-allreduce",
        workdir=SCRIPTS,
        rendezvous_timeout=60,
    )
    try:
        yield app
    finally:
        app.teardown()


@pytest.fixture(scope="module")
def py_app() -> Iterator[kt.App]:
    """A plain (non-torchrun) command on 2 replicas, for output, failure and env tests."""
    app = kt.app(
        [sys.executable, "replica.py"],
        replicas=2,
        name="app-replica",
        workdir=SCRIPTS,
        rendezvous_timeout=42,
        env={"APP_GREETING": "hello"},
    )
    try:
        yield app
    finally:
        app.teardown()


def _allreduce_lines(out: str) -> list[tuple[int, dict]]:
    found = []
    for line in out.splitlines():
        m = re.fullmatch(r"\[replica (\d+)\] ALLREDUCE (\{.*\})", line)
        if m:
            found.append((int(m.group(1)), json.loads(m.group(2))))
    return found


def _check_allreduce(out: str) -> None:
    lines = _allreduce_lines(out)
    assert sorted(seen["rank"] for _, seen in lines) == [0, 1, 2, 3], out
    for replica, seen in lines:
        rank = seen["rank"]
        assert seen["world"] == 4 and seen["WORLD_SIZE"] == "4", seen
        assert seen["sum"] == 1 + 2 + 3 + 4, seen  # every rank took part in the all_reduce
        assert seen["RANK"] == str(rank)
        assert replica == rank // 2, (replica, seen)  # the line came from its own replica
        assert seen["LOCAL_RANK"] == str(rank % 2)
        # torchrun's own node rank (GROUP_RANK) came from the PET_* env ktlite set
        assert seen["GROUP_RANK"] == seen["NODE_RANK"] == seen["PET_NODE_RANK"] == str(replica)
        assert seen["PET_NNODES"] == "2"
        assert seen["argv"] == []  # the script was given no rank arguments


# ---- a real torchrun job ---------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_torchrun_all_reduce_across_two_replicas(
    torch_app: kt.App, capfd: pytest.CaptureFixture[str]
) -> None:
    # the command names no --nnodes, --node_rank or --master_addr: the PET_* env does it
    assert torch_app.command == ["torchrun", "--nproc_per_node=2", "allreduce.py"]
    assert torch_app.run() == [0, 0]
    out, _ = capfd.readouterr()
    _check_allreduce(out)
    # both replicas' torchrun output (its own log lines too) came back with its prefix
    for line in out.splitlines():
        assert re.match(r"\[replica [01]\] ", line), line

    # the same deployment runs the job again: the rendezvous (same address and port) repeats
    assert torch_app.run() == [0, 0]
    _check_allreduce(capfd.readouterr()[0])


@pytest.mark.timeout(120)
def test_torchrun_c10d_rendezvous_uses_the_pet_rdzv_env(capfd: pytest.CaptureFixture[str]) -> None:
    app = kt.app(
        "torchrun --rdzv-backend=c10d --nproc_per_node=2 allreduce.py",
        replicas=2,
        name="app-c10d",
        workdir=SCRIPTS,
        rendezvous_timeout=60,
    )
    try:
        assert app.run() == [0, 0]
    finally:
        app.teardown()
    out, _ = capfd.readouterr()
    lines = _allreduce_lines(out)
    assert sorted(seen["rank"] for _, seen in lines) == [0, 1, 2, 3], out
    for _, seen in lines:
        assert seen["sum"] == 10 and seen["world"] == 4 and seen["argv"] == []
        assert int(seen["GROUP_RANK"]) == seen["rank"] // 2
    # c10d hands out node ranks in arrival order, but a replica's two ranks share one node
    for replica in (0, 1):
        groups = {seen["GROUP_RANK"] for r, seen in lines if r == replica}
        assert len(groups) == 1, (replica, lines)


RDZV_TIMEOUT_S = 5  # short: the test waits it out


@pytest.mark.timeout(120)
def test_rendezvous_that_cannot_complete_fails_within_the_timeout() -> None:
    # explicit arguments beat the PET_* env: torchrun waits for a third node that never comes
    # (the hang of seeds/002, where nodes never meet), until rendezvous_timeout
    app = kt.app(
        "torchrun --nnodes 3 --nproc_per_node=1 allreduce.py",
        replicas=2,
        name="app-rdzv-timeout",
        workdir=SCRIPTS,
        rendezvous_timeout=RDZV_TIMEOUT_S,
    )
    try:
        start = time.monotonic()
        with pytest.raises(kt.ReplicaFailed) as info:
            app.run()
        took = time.monotonic() - start
    finally:
        app.teardown()
    err = info.value
    assert isinstance(err, kt.RemoteError)
    assert err.exit_code != 0
    # torchrun waited the configured timeout (not failing early, nor faked); that it did not
    # hang is the pytest-timeout's to catch (no upper bound: a busy machine is slow, not wrong)
    assert took >= RDZV_TIMEOUT_S, took
    assert "ended with exit code" in str(err)
    assert re.search(r"time(d)? ?out", str(err), re.IGNORECASE), str(err)  # torchrun's last lines


# ---- plain commands: env, live output, failure -----------------------------------------------


@pytest.mark.timeout(60)
def test_every_replica_gets_the_torchrun_env(
    py_app: kt.App, capfd: pytest.CaptureFixture[str]
) -> None:
    assert py_app.run(env={"MODE": "ok"}) == [0, 0]
    out, _ = capfd.readouterr()
    envs = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[replica (\d+)\] ENV (\{.*\})", line)
        if m:
            envs[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(envs) == [0, 1], out
    ids = set()
    for replica, env in envs.items():
        assert env["PET_NNODES"] == env["GROUP_WORLD_SIZE"] == "2"
        assert env["PET_NODE_RANK"] == env["NODE_RANK"] == str(replica)
        assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PET_MASTER_PORT"] == env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["PET_RDZV_ENDPOINT"] == f"127.0.0.1:{env['MASTER_PORT']}"
        assert "timeout=42" in env["PET_RDZV_CONF"].split(","), env["PET_RDZV_CONF"]
        assert env["PET_MAX_RESTARTS"] == "0"
        assert env["APP_GREETING"] == "hello"  # kt.app(..., env=...) reaches the command
        ids.add(env["PET_RDZV_ID"])
    assert len(ids) == 1 and ids != {""}, ids  # one rendezvous id for the whole job


class _Recorder(io.TextIOBase):
    """A stand-in for sys.stdout that notes when each line arrives."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.lines += [(time.monotonic(), ln) for ln in text.splitlines() if ln]
        return len(text)

    def texts(self) -> list[str]:
        with self.lock:
            return [ln for _, ln in self.lines]


@pytest.mark.timeout(60)
def test_output_streams_live_with_the_replica_prefix(
    py_app: kt.App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each replica prints "waiting", then waits for a file that is only created once both
    # "waiting" lines have arrived here: buffered output would never let the job finish
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    go = tmp_path / "go"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(py_app.run, env={"MODE": "wait", "GO": str(go)})
        try:
            deadline = time.monotonic() + 30
            while not {"[replica 0] waiting 0", "[replica 1] waiting 1"} <= set(recorder.texts()):
                assert time.monotonic() < deadline, recorder.texts()
                assert not future.done(), future.result()
                time.sleep(0.05)
        finally:
            go.touch()
        assert future.result(timeout=30) == [0, 0]
    texts = recorder.texts()
    assert "[replica 0] done 0" in texts and "[replica 1] done 1" in texts


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(90)
def test_a_failing_replica_stops_the_others_and_raises_its_exit_code(
    py_app: kt.App, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(kt.ReplicaFailed) as info:
        py_app.run(env={"MODE": "fail", "PIDS": str(tmp_path)})
    err = info.value
    assert isinstance(err, kt.RemoteError)
    assert err.exit_code == 3
    assert "replica 1" in str(err) and "exit code 3" in str(err)
    last_lines = str(err).split("last lines:", 1)[1]
    assert "marker-3f9a" in last_lines
    sleeper = int((tmp_path / "0").read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper):
        assert time.monotonic() < deadline, f"replica 0's command (pid {sleeper}) still runs"
        time.sleep(0.1)
    out, _ = capfd.readouterr()
    assert "[replica 1] replica 1 is about to fail: marker-3f9a" in out
    assert "woke up" not in out  # replica 0 was stopped, not waited for (it sleeps 120 s)

    # the deployment stays usable: the next run works
    assert py_app.run(env={"MODE": "ok"}) == [0, 0]


@pytest.mark.timeout(60)
def test_a_local_command_uses_the_callers_python_environment(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != VENV_BIN)
    monkeypatch.setenv("PATH", bare)  # not activated
    app = kt.app(
        "python -c 'import sys; print(\"PREFIX\", sys.prefix)'",
        name="app-which-python",
        workdir=SCRIPTS,
    )
    try:
        assert app.run() == [0]
    finally:
        app.teardown()
    assert f"[replica 0] PREFIX {sys.prefix}" in capfd.readouterr()[0]


# ---- the files a replica gets ----------------------------------------------------------------


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    for rel, text in {
        "train.py": "print('train')",
        "conf/run.yaml": "epochs: 3",
        ".gitignore": "data/\n*.ckpt\n",
        "data/big.bin": "x" * 100,
        "model.ckpt": "weights",
        "__pycache__/train.cpython-311.pyc": "pyc",
        "venv/bin/python": "not shipped",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _names(blob: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return set(tar.getnames())


def test_pack_ships_what_git_sees(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "add", "train.py"], cwd=root, check=True)  # one tracked, others new
    names = _names(pack(root))
    # tracked and untracked-but-not-ignored files travel; .gitignore'd ones and .git do not
    assert {"train.py", "conf/run.yaml", ".gitignore"} <= names
    assert not {n for n in names if n.startswith(("data/", ".git/")) or n.endswith(".ckpt")}


def test_pack_outside_git_skips_caches_and_virtualenvs(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    names = _names(pack(root))
    assert {"train.py", "conf/run.yaml", "data/big.bin", "model.ckpt"} <= names
    assert not {n for n in names if n.startswith(("__pycache__/", "venv/"))}


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # see the test below
@pytest.mark.timeout(60)
def test_shipped_files_run_in_their_own_folder_on_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # what a cluster pod does with the files (the local backend runs in the folder itself)
    root = _tree(tmp_path)
    (root / "show.py").write_text(
        "import os, pathlib\n"
        "print('CONF', pathlib.Path('conf/run.yaml').read_text())\n"
        "print('CKPT', pathlib.Path('model.ckpt').exists())\n"
        "print('CWD', os.getcwd())\n"
        "print('PET', os.environ['PET_NNODES'], os.environ['PET_NODE_RANK'], os.environ['X'])\n"
    )
    (root / ".gitignore").write_text("*.ckpt\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    for key, value in {
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
        "GROUP_WORLD_SIZE": "3",
        "NODE_RANK": "2",
        "KTLITE_LAUNCH_ID": "abc",
    }.items():
        monkeypatch.setenv(key, value)
    assert run_replica([sys.executable, "show.py"], pack(root), None, 30, {"X": "extra"}) == 0
    out = capfd.readouterr()[0].splitlines()
    assert "CONF epochs: 3" in out and "CKPT False" in out
    assert "PET 3 2 extra" in out
    cwd = Path(next(line.split(" ", 1)[1] for line in out if line.startswith("CWD ")))
    assert cwd != root and not cwd.exists()  # its own copy, removed after the run

    with pytest.raises(kt.ReplicaFailed) as info:
        run_replica(
            [sys.executable, "-c", "import os; print('bye', os.getcwd()); exit(7)"],
            pack(root),
            None,
            30,
            {},
        )
    assert info.value.exit_code == 7 and "bye" in str(info.value)
    assert not Path(str(info.value).split("bye ", 1)[1].split()[0]).exists()


@pytest.mark.timeout(30)
def test_run_replica_closes_the_commands_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "GROUP_WORLD_SIZE": "1",
        "NODE_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_replica([sys.executable, "-c", "print(1)"], None, str(SCRIPTS), 30, {}) == 0
        with pytest.raises(kt.ReplicaFailed):
            run_replica([sys.executable, "-c", "raise SystemExit(2)"], None, str(SCRIPTS), 30, {})
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [
        str(w.message) for w in caught
    ]


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        (("",), {}, "cli_command"),
        (("   ",), {}, "cli_command"),
        (([],), {}, "cli_command"),
        (("torchrun x.py",), {"replicas": 0}, "workers"),
        (("torchrun x.py",), {"replicas": -2}, "workers"),
        (("torchrun x.py",), {"rendezvous_timeout": -1}, "rendezvous_timeout"),
        (("torchrun x.py",), {"rendezvous_timeout": 0}, "rendezvous_timeout"),
        (("torchrun x.py",), {"rendezvous_timeout": "15"}, "rendezvous_timeout"),
        (("torchrun x.py",), {"workdir": "/no/such/folder"}, "workdir"),
        (("torchrun x.py",), {"cpus": "lots"}, "cpus"),
        (("torchrun x.py",), {"name": "__"}, "name='__'"),
    ],
    ids=[
        "empty",
        "blank",
        "empty-list",
        "replicas-0",
        "replicas-negative",
        "timeout-negative",
        "timeout-0",
        "timeout-str",
        "workdir",
        "cpus",
        "name",
    ],
)
def test_bad_input_fails_before_anything_starts(args: tuple, kwargs: dict, words: str) -> None:
    from ktlite.backends.local import LocalBackend

    before = LocalBackend.shared().list()
    with pytest.raises(kt.ConfigError, match=re.escape(words)):
        kt.app(*args, **kwargs)
    assert LocalBackend.shared().list() == before


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_rendezvous_timeout_is_refused(bad: float) -> None:
    with pytest.raises(kt.ConfigError, match="rendezvous_timeout"):
        kt.app("torchrun x.py", rendezvous_timeout=bad)


# ---- ktlite run, as a user types it ----------------------------------------------------------


def _ktlite(
    *args: str, home: Path | None = None, cwd: Path = SCRIPTS, **popen: object
) -> subprocess.Popen[str]:
    env = {**os.environ, "PATH": _with_venv_path(os.environ.get("PATH", ""))}
    if home is not None:
        env["KTLITE_HOME"] = str(home)
    return subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def _done(proc: subprocess.Popen[str], timeout: float = 90) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"ktlite did not finish in {timeout}s:\n{out}\n{err}") from None
    return proc.returncode, out, err


@pytest.mark.timeout(90)
def test_ktlite_run_a_command_streams_replica_lines_live(tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = (
        "import os, pathlib, time\n"
        "print('waiting', os.environ['PET_NODE_RANK'], flush=True)\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
        "print('done', os.environ['PET_NODE_RANK'])\n"
    )
    proc = _ktlite("run", "--replicas", "2", "--name", "cli-run-ok", "--", "python", "-c", code)
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not {"[replica 0] waiting 0", "[replica 1] waiting 1"} <= set(seen):
            assert time.monotonic() < deadline, seen
            line = proc.stdout.readline()
            assert line, (seen, proc.stderr.read() if proc.stderr else "")
            seen.append(line.rstrip("\n"))
    finally:
        go.touch()
    rc, out, err = _done(proc)
    lines = seen + out.splitlines()
    assert rc == 0, err
    assert "[replica 0] done 0" in lines and "[replica 1] done 1" in lines
    assert lines[-1] == "cli-run-ok: exit codes [0, 0]"


# a wait's status line (ktlite.net.progress), which a loaded machine's slow start shows
PROGRESS_LINE = re.compile(r"ktlite: [\w.-]+: .* \(\d+ s\)")


@pytest.mark.timeout(90)
def test_ktlite_run_a_failing_command_prints_one_error_line() -> None:
    code = "import os, sys; print('going down', flush=True); sys.exit(4)"
    rc, out, err = _done(
        _ktlite("run", "--replicas", "2", "--name", "cli-run-fail", "--", "python", "-c", code)
    )
    assert rc == 1
    assert "Traceback" not in err and "Traceback" not in out
    heads = [
        line
        for line in err.splitlines()
        if line and not line[0].isspace() and not PROGRESS_LINE.fullmatch(line)
    ]
    assert len(heads) == 1, err  # one error line; the indented ones are the command's last lines
    assert heads[0].startswith("cli-run-fail: failed: replica ") and "exit code 4" in heads[0]
    assert "going down" in err  # the last lines


@pytest.mark.timeout(90)
def test_ktlite_run_a_script_runs_the_apps_it_declares() -> None:
    rc, out, err = _done(_ktlite("run", "declares_apps.py"))
    assert rc == 0, err
    lines = out.splitlines()
    assert "declared-first: exit codes [0, 0]" in lines
    assert "declared-second: exit codes [0]" in lines
    assert "[replica 0] second app says hi" in lines
    envs = [json.loads(ln.split(" ENV ", 1)[1]) for ln in lines if " ENV " in ln]
    greetings = [env["APP_GREETING"] for env in envs]
    assert greetings == ["first", "first"]
    assert "MAIN BLOCK RAN" not in out  # the script is imported, not run as __main__


@pytest.mark.timeout(120)
def test_ktlite_run_python_script_runs_the_torchrun_job_it_declares() -> None:
    # seed 004's form: `kt run python my_script.py` where my_script declares
    # kt.app(cli_command="torchrun ...", replicas=2); it once ran `python launch_ddp.py` on one
    # replica, where the script only declared the app, and said "exit codes [0]"
    rc, out, err = _done(_ktlite("run", "python", "launch_ddp.py", "--epochs", "3"), timeout=110)
    assert rc == 0, out + err
    lines = out.splitlines()
    assert "launch-ddp: exit codes [0, 0]" in lines, out
    seen = [json.loads(ln.split("ALLREDUCE ", 1)[1]) for ln in lines if "ALLREDUCE " in ln]
    assert sorted(s["rank"] for s in seen) == [0, 1], out
    assert all(s["world"] == 2 and s["sum"] == 3 for s in seen), seen  # across both replicas
    assert all(s["argv"] == ["--epochs", "3"] for s in seen), seen  # the script's own arguments
    assert "MAIN BLOCK RAN" not in out


@pytest.mark.timeout(60)
def test_ktlite_run_dry_run_and_bad_input_change_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (tmp_path / "plain.py").write_text("def f():\n    return 1\n")
    for args in (
        ("run", "--dry-run", "--replicas", "2", "--", "python", "-c", "print(1)"),
        ("run", "--dry-run", "declares_apps.py"),
    ):
        rc, out, err = _done(_ktlite(*args, home=home))
        assert rc == 0, err
        assert out.startswith("# ktlite plan for "), out
        assert not home.exists() or not any(home.rglob("*")), list(home.rglob("*"))
    rc, out, err = _done(_ktlite("run", "--dry-run", "python", "launch_ddp.py", home=home))
    assert rc == 0 and "torchrun --nproc_per_node=1 allreduce.py" in out, out + err
    for args, words in (
        (("run", "--replicas", "0", "--", "python", "-c", "print(1)"), "workers"),
        # a declared app is run as declared, or not at all
        (("run", "torchrun", "launch_ddp.py"), "ktlite run launch_ddp.py"),
        (("run", "python", "-m", "launch_ddp.py"), "only declares them"),
        (("run", "--replicas", "3", "python", "launch_ddp.py"), "set --replicas there"),
        (("run", "--name", "x", "launch_ddp.py"), "set --name there"),
        (("run",), "give a script"),
        (("run", str(tmp_path / "plain.py")), "declares no kt.app"),
        (("run", "missing.py"), "no such file"),
    ):
        rc, out, err = _done(_ktlite(*args, home=home))
        assert rc == 1 and "Traceback" not in err, err
        assert err.splitlines()[0].startswith("ktlite: error:") and words in err, err
        assert len(err.splitlines()) == 1, err
    rc, out, _ = _done(_ktlite("list", home=home))
    assert (rc, out.strip()) == (0, "no deployments")


@pytest.mark.timeout(30)
def test_ktlite_run_dry_run_shows_the_replica_command(tmp_path: Path) -> None:
    rc, out, err = _done(
        _ktlite(
            "run",
            "--dry-run",
            "--replicas",
            "2",
            "--",
            "torchrun",
            "--nproc_per_node=2",
            "train.py",
            home=tmp_path / "home",
        )
    )
    assert rc == 0, err
    assert "torchrun --nproc_per_node=2 train.py" in out
