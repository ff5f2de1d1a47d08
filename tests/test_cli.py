"""The ``ktlite`` command driven as a user would (subprocesses, real local pods): help,
status, logs --rank, call (functions and methods), errors with and without --debug, and
teardown --all. One detached deployment made by ``ktlite deploy`` serves the module.

(``test_config_cli.py`` covers config, list, logs --pod/--tail and the help of list,
teardown, logs and config; ``test_deploy_cli.py`` covers deploy itself.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = """
import os
import time
from pathlib import Path

import ktlite as kt


@kt.compute(cpus=1, name="cli-add")
@kt.distribute("pytorch", workers=2)
def add(x, y=0, wait_for=None):
    while wait_for and not Path(wait_for).exists():
        time.sleep(0.05)
    print(f"add on rank {os.environ['RANK']}: {x} + {y}", flush=True)
    return x + y


@kt.compute(cpus=1, name="cli-counter")
class Counter:
    def __init__(self):
        self.total = 0

    def add(self, k):
        self.total += k
        return self.total
"""

COMMANDS = [
    "deploy",
    "list",
    "status",
    "logs",
    "call",
    "teardown",
    "dashboard",
    "run",
    "port-forward",
    "config",
    "put",
    "get",
    "ls",
    "rm",
    "store",
    # Kubetorch's names for status
    "check",
    "describe",
]
# Kubetorch's commands that ktlite lacks: one line of the help, and each says what to use instead
REFUSED = ["debug", "apply", "ssh", "volumes", "notebook", "secrets"]


@dataclass
class Deployed:
    where: Path
    home: Path


def ktlite(
    where: Path,
    home: Path,
    *args: str,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env["KTLITE_HOME"] = str(home)
    # stdin is no terminal, as in CI or a pipe (never the terminal pytest may run in)
    return subprocess.run(
        [sys.executable, "-m", "ktlite.commands.cli", *args],
        cwd=where,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    where = tmp_path_factory.mktemp("cli")
    (where / "cli_script.py").write_text(textwrap.dedent(SCRIPT))
    d = Deployed(where, where / "home")
    try:
        done = ktlite(where, d.home, "deploy", "cli_script.py", timeout=120)
        assert done.returncode == 0, done.stderr
        assert "cli-add: deployed on local: 2 pod(s), 2/2 ranks ready" in done.stdout
        assert "cli-counter: deployed on local: 1 pod(s), 1/1 ranks ready" in done.stdout
        yield d
    finally:
        ktlite(where, d.home, "teardown", "--all", "-y")  # the last test may have done it


def one_error_line(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktlite: error: "), done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---- help ------------------------------------------------------------------------------------


def test_help_lists_every_command_and_each_shows_an_example(tmp_path: Path) -> None:
    done = ktlite(tmp_path, tmp_path / "home", "--help")
    assert done.returncode == 0, done.stderr
    listed = re.search(r"\{([a-z,-]+)\}", done.stdout)
    assert listed and set(listed.group(1).split(",")) == set(COMMANDS), done.stdout
    # the commands ktlite lacks are one line, not one entry each
    lines = [
        line for line in done.stdout.splitlines() if "Kubetorch commands not in ktlite" in line
    ]
    assert lines == [
        f"Kubetorch commands not in ktlite: {', '.join(REFUSED)} (`ktlite COMMAND` "
        "says what to use instead)."
    ], done.stdout
    assert not any(
        line.split()[:1] == [name] for line in done.stdout.splitlines() for name in REFUSED
    )
    assert "KTLITE_LOG_LEVEL=INFO (or DEBUG) shows ktlite's diagnostics" in done.stdout
    for name in REFUSED:  # each still says what to use instead
        refused = ktlite(tmp_path, tmp_path / "home", name, "x")
        assert refused.returncode == 2 and "Kubetorch's command" in refused.stderr, refused.stderr
        helped = ktlite(tmp_path, tmp_path / "home", name, "--help")  # Kubetorch's table asks this
        assert helped.returncode == 0 and "Kubetorch's command" in helped.stdout, helped.stderr
    for command in ("deploy", "status", "call", "run"):  # the others: test_config_cli.py
        done = ktlite(tmp_path, tmp_path / "home", command, "--help")
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        assert "Example" in text and f"ktlite {command} " in text, (command, done.stdout)


# ---- status ----------------------------------------------------------------------------------


def _status_pods(out: str) -> dict[str, dict]:
    """The table of ``ktlite status`` as {pod: {"launch", "active", "ranks": [row, ...]}}."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(r"\S+: \d+ pod\(s\)", line))
    m = re.match(
        r"\S+: (\d+) pod\(s\), (\d+) rank\(s\), launch (\S+), (\d+) active call\(s\)$", lines[head]
    )
    assert m, out
    top = next(i for i in range(head + 1, len(lines)) if lines[i].startswith("RANK"))
    columns = re.split(r"\s{2,}", lines[top].strip())
    assert columns == [
        "RANK",
        "POD",
        "PID",
        "STATE",
        "CPU%",
        "RSS",
        "GPU MEM",
        "GPU%",
        "CALL",
        "RUNNING",
        "RESTARTS",
    ], out
    pods: dict[str, dict] = {}
    for line in lines[top + 1 : top + 1 + int(m.group(2))]:
        row = dict(zip(columns, re.split(r"\s{2,}", line.strip()), strict=True))
        pod = pods.setdefault(
            row["POD"], {"launch": m.group(3), "active": int(m.group(4)), "ranks": []}
        )
        pod["ranks"].append(
            {
                "rank": int(row["RANK"]),
                "state": row["STATE"].lower(),
                "restarts": int(row["RESTARTS"]),
                "stuck": row["STATE"] == "STUCK",
                "pid": int(row["PID"]),
                "cpu": row["CPU%"],
                "rss": row["RSS"],
                "gpu": row["GPU MEM"],
                "call": row["CALL"],
                "running": row["RUNNING"],
            }
        )
    assert len(pods) <= int(m.group(1)), out
    return pods


@pytest.mark.timeout(60)
def test_status_shows_pods_ranks_restarts_and_launch_id(deployed: Deployed) -> None:
    done = ktlite(deployed.where, deployed.home, "status", "cli-add")
    assert done.returncode == 0, done.stderr
    pods = _status_pods(done.stdout)
    assert sorted(pods) == ["cli-add-0", "cli-add-1"], done.stdout
    assert [r["rank"] for p in sorted(pods) for r in pods[p]["ranks"]] == [0, 1]
    launches = {pod["launch"] for pod in pods.values()}
    assert len(launches) == 1 and re.fullmatch(r"[0-9a-f]{6,}", launches.pop()), done.stdout
    for pod in pods.values():
        rank = pod["ranks"][0]
        assert rank["restarts"] == 0 and not rank["stuck"] and rank["state"] == "idle"
        assert float(rank["cpu"]) >= 0 and re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", rank["rss"]), (
            done.stdout
        )
        assert rank["gpu"] == "-" and rank["call"] == "-" and rank["running"] == "-"  # no GPUs here


@pytest.mark.timeout(60)
def test_status_json_is_the_pods_raw_status(deployed: Deployed) -> None:
    done = ktlite(deployed.where, deployed.home, "status", "cli-add", "--json")
    assert done.returncode == 0, done.stderr
    pods = json.loads(done.stdout)
    assert [p["pod"] for p in pods] == ["cli-add-0", "cli-add-1"]
    ranks = [r for p in pods for r in p["ranks"]]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["pid"] > 0 and r["rss_bytes"] > 0 and r["cpu_percent"] >= 0 and r["calls"] == []
        assert r["gpus"] is None and r["gpu_memory_used_bytes"] is None  # no nvidia-smi here


@pytest.mark.timeout(60)
def test_status_shows_the_other_pods_when_one_does_not_answer(deployed: Deployed) -> None:
    pods = json.loads(ktlite(deployed.where, deployed.home, "status", "cli-add", "--json").stdout)
    frozen = pods[1]["server_pid"]
    os.kill(frozen, signal.SIGSTOP)  # pod 1's server hangs (its status request times out in 5 s)
    try:
        done = ktlite(deployed.where, deployed.home, "status", "cli-add")
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^  cli-add-1: not answering: .*/status", done.stdout, re.M), done.stdout
    assert sorted(_status_pods(done.stdout)) == ["cli-add-0"]  # pod 0's rank still shows


@pytest.mark.timeout(60)
def test_status_watch_refreshes_until_ctrl_c(deployed: Deployed) -> None:
    one_error_line(
        ktlite(deployed.where, deployed.home, "status", "cli-add", "--watch", "0"), "--watch", "> 0"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env["KTLITE_HOME"] = str(deployed.home)
    watch = subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", "status", "cli-add", "--watch", "0.3"],
        cwd=deployed.where,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert watch.stdout is not None
        frames: list[str] = []
        deadline = time.monotonic() + 30
        while len(frames) < 3:
            assert time.monotonic() < deadline and watch.poll() is None, frames
            line = watch.stdout.readline().rstrip("\n")
            if re.fullmatch(r"\d\d:\d\d:\d\d  every 0.3s, Ctrl-C to stop", line):
                frames.append("")
            elif frames:
                frames[-1] += line + "\n"
        for frame in frames[:2]:  # every refresh is the whole table
            assert sorted(_status_pods(frame)) == ["cli-add-0", "cli-add-1"], frame
    finally:
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=10)
    assert watch.returncode == 0 and "Traceback" not in err, err


@pytest.mark.timeout(90)
def test_status_exits_2_while_a_call_is_stuck(deployed: Deployed) -> None:
    go = deployed.where / "go-stuck"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env["KTLITE_HOME"] = str(deployed.home)
    call = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ktlite.commands.cli",
            "call",
            "cli-add",
            "--args",
            "[1]",
            "--kwargs",
            json.dumps({"wait_for": str(go)}),
        ],
        cwd=deployed.where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            done = ktlite(
                deployed.where, deployed.home, "status", "cli-add", "--stuck-after", "0.5"
            )
            if done.returncode == 2 or time.monotonic() > deadline:
                break
            assert done.returncode == 0, done.stderr
            time.sleep(0.2)
        assert done.returncode == 2, done.stdout
        pods = _status_pods(done.stdout)
        assert all(r["stuck"] and r["call"] != "-" for p in pods.values() for r in p["ranks"])
        assert all(p["active"] == 1 for p in pods.values())
    finally:
        go.touch()
        out, err = call.communicate(timeout=30)
    assert call.returncode == 0, err
    assert out.splitlines()[-1] == "[1, 1]"
    done = ktlite(deployed.where, deployed.home, "status", "cli-add", "--stuck-after", "0.5")
    assert done.returncode == 0 and "STUCK" not in done.stdout, done.stdout


# ---- call and logs ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_call_prints_the_json_result_and_logs_by_rank(deployed: Deployed) -> None:
    done = ktlite(
        deployed.where, deployed.home, "call", "cli-add", "--args", "[3]", "--kwargs", '{"y": 2}'
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert json.loads(lines[-1]) == [5, 5]  # one value per rank, as JSON
    assert "[rank 1 @ cli-add-1] add on rank 1: 3 + 2" in lines  # the ranks' output streamed

    for rank in (0, 1):
        logs = ktlite(deployed.where, deployed.home, "logs", "cli-add", "--rank", str(rank))
        assert logs.returncode == 0, logs.stderr
        mine = f"[cli-add-{rank}] [rank {rank}] add on rank {rank}: 3 + 2"
        other = f"[rank {1 - rank}] add on rank"
        assert mine in logs.stdout.splitlines(), logs.stdout
        assert other not in logs.stdout, logs.stdout


@pytest.mark.timeout(60)
def test_call_a_method_of_a_deployed_class_keeps_its_state(deployed: Deployed) -> None:
    first = ktlite(
        deployed.where, deployed.home, "call", "cli-counter", "--method", "add", "--args", "[5]"
    )
    assert first.returncode == 0, first.stderr
    second = ktlite(
        deployed.where,
        deployed.home,
        "call",
        "cli-counter",
        "--method",
        "add",
        "--kwargs",
        '{"k": 4}',
    )
    assert second.returncode == 0, second.stderr
    before = json.loads(first.stdout.splitlines()[-1])
    assert json.loads(second.stdout.splitlines()[-1]) == before + 4


@pytest.mark.timeout(60)
def test_logs_follow_prints_new_lines_of_one_rank_until_ctrl_c(deployed: Deployed) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLITE_")}
    env["KTLITE_HOME"] = str(deployed.home)
    # a line already in the log before following starts: once the follower printed it, it
    # follows (a line seen after that came from following, not from the log's tail)
    before = ktlite(
        deployed.where,
        deployed.home,
        "call",
        "cli-add",
        "--args",
        "[31337]",
        "--kwargs",
        '{"y": 2}',
    )
    assert before.returncode == 0, before.stderr
    # Ctrl-C as in a terminal, even where this test runs with SIGINT ignored (a shell's
    # background job, and every process it starts, inherits SIG_IGN)
    follow = subprocess.Popen(
        [sys.executable, "-m", "ktlite.commands.cli", "logs", "cli-add", "-f", "--rank", "1"],
        cwd=deployed.where,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen: list[str] = []

    def read_until(wanted: str) -> None:
        assert follow.stdout is not None
        deadline = time.monotonic() + 30
        while wanted not in seen:
            assert time.monotonic() < deadline and follow.poll() is None, (wanted, seen)
            seen.append(follow.stdout.readline().rstrip("\n"))

    try:
        read_until("[cli-add-1] [rank 1] add on rank 1: 31337 + 2")  # following now
        done = ktlite(
            deployed.where,
            deployed.home,
            "call",
            "cli-add",
            "--args",
            "[40]",
            "--kwargs",
            '{"y": 2}',
        )
        assert done.returncode == 0, done.stderr
        read_until("[cli-add-1] [rank 1] add on rank 1: 40 + 2")
        assert not [line for line in seen if "[rank 0]" in line], seen
    finally:
        follow.send_signal(signal.SIGINT)
        out, err = follow.communicate(timeout=10)
    assert follow.returncode == 0 and "Traceback" not in err, err


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_errors_are_one_line_and_debug_shows_the_traceback(deployed: Deployed) -> None:
    w, h = deployed.where, deployed.home
    one_error_line(ktlite(w, h, "call", "no-such-thing"), "no-such-thing", "ktlite list")
    one_error_line(ktlite(w, h, "status", "no-such-thing"), "no-such-thing")
    one_error_line(ktlite(w, h, "logs", "no-such-thing", "--rank", "0"), "no-such-thing")
    one_error_line(ktlite(w, h, "call", "cli-add", "--args", "[3"), "JSON")
    one_error_line(ktlite(w, h, "call", "cli-add", "--kwargs", "{y: 2}"), "JSON")
    one_error_line(ktlite(w, h, "call", "cli-add", "--args", '{"x": 1}'), "JSON list")
    one_error_line(ktlite(w, h, "call", "cli-add", "--kwargs", "[1]"), "JSON object")
    # an exception raised by the deployed function: its message, on one line
    one_error_line(
        ktlite(w, h, "call", "cli-add", "--args", '["a"]', "--kwargs", '{"y": 2}'),
        "can only concatenate str",
    )

    debug = ktlite(w, h, "--debug", "call", "no-such-thing")
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug.stderr
    assert "NotDeployedError" in debug.stderr and "no-such-thing" in debug.stderr

    usage = ktlite(w, h, "call")  # argparse's own errors: usage and one line, exit 2
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert "the following arguments are required: name" in usage.stderr

    # the deployment is untouched by all this
    done = ktlite(w, h, "call", "cli-add", "--args", "[1]")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[1, 1]", done.stderr


@pytest.mark.timeout(60)
def test_call_with_a_bad_timeout_is_refused_before_the_call(deployed: Deployed) -> None:
    line = one_error_line(
        ktlite(deployed.where, deployed.home, "call", "cli-add", "--args", "[1]", "--timeout", "0"),
        "timeout",
    )
    assert "HTTP 400" not in line and "header" not in line, line


@pytest.mark.timeout(60)
def test_call_a_class_without_method_says_to_pass_method(deployed: Deployed) -> None:
    one_error_line(ktlite(deployed.where, deployed.home, "call", "cli-counter"), "--method")


@pytest.mark.timeout(60)
def test_call_a_function_with_method_says_it_has_none(deployed: Deployed) -> None:
    line = one_error_line(
        ktlite(deployed.where, deployed.home, "call", "cli-add", "--method", "add"),
        "'cli-add' is a deployed function",
        "no methods",
        "without --method",
    )
    assert "AttributeError" not in line, line


# ---- teardown (--all last: it ends the module's deployment) ----------------------------------


@pytest.mark.timeout(60)
def test_teardown_a_misspelt_name_fails_and_says_what_exists(deployed: Deployed) -> None:
    w, h = deployed.where, deployed.home
    line = one_error_line(
        ktlite(w, h, "teardown", "cli-ad"),
        "no deployment named 'cli-ad'",
        "did you mean 'cli-add'?",
        "cli-counter",
    )
    assert "not found" not in line, line
    bare = ktlite(w, h, "teardown")
    assert bare.returncode == 1, bare.stderr
    assert bare.stderr.startswith(
        "nothing to tear down: name a deployment or pass --all; deployed: "
    )
    assert "cli-add" in bare.stderr and "cli-counter" in bare.stderr, bare.stderr
    prefix = ktlite(w, h, "teardown", "--prefix", "zz", "-y")
    assert prefix.returncode == 1, prefix.stderr
    assert prefix.stderr.startswith("nothing to tear down: no deployment name starts with 'zz'"), (
        prefix.stderr
    )
    assert ktlite(w, h, "call", "cli-add", "--args", "[2]").stdout.splitlines()[-1] == "[2, 2]"


@pytest.mark.timeout(60)
def test_teardown_all_without_a_terminal_needs_yes(deployed: Deployed) -> None:
    w, h = deployed.where, deployed.home
    done = ktlite(w, h, "teardown", "--all")  # stdin is /dev/null: nobody to answer [y/N]
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "EOFError" not in done.stderr, done.stderr
    assert "no terminal" in done.stderr and "--yes (-y)" in done.stderr, done.stderr
    assert "cli-add" in done.stderr and "cli-counter" in done.stderr, done.stderr
    assert ktlite(w, h, "call", "cli-add", "--args", "[3]").stdout.splitlines()[-1] == "[3, 3]"


@pytest.mark.timeout(60)
def test_teardown_all_yes(deployed: Deployed) -> None:
    w, h = deployed.where, deployed.home
    done = ktlite(w, h, "teardown", "--all", "-y")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["cli-add: torn down", "cli-counter: torn down"]
    listed = ktlite(w, h, "list")
    assert listed.stdout.strip() == "no deployments"
    gone = ktlite(w, h, "call", "cli-add", "--args", "[1]")
    one_error_line(gone, "cli-add")
    again = ktlite(w, h, "teardown", "--all", "-y")
    assert again.returncode == 1, again.stderr
    assert again.stderr == "nothing to tear down: nothing is deployed on backend 'local'\n"
    named = ktlite(w, h, "teardown", "cli-add")
    one_error_line(named, "no deployment named 'cli-add': nothing is deployed on backend 'local'")
    bare = ktlite(w, h, "teardown")
    assert bare.returncode == 1 and "nothing is deployed" in bare.stderr, bare.stderr
