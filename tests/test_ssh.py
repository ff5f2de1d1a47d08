"""The ssh backend against real OpenSSH servers (``ssh_hosts.py``): each "host" is an sshd
on its own loopback address and port, reached through an ssh_config alias with strict host
key checking; the pod servers run on this machine as that host's processes.

Marked ``ssh``: not in the default run; ``.ci/run`` runs them with the other real-engine
tests. The hosts run this client's own Python (``python=``): its packages (torch) are the
"host's"."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from ssh_hosts import SshHosts, ssh_marks

import ktlite as kt
from ktlite.backends.processes import pid_alive

pytestmark = ssh_marks(timeout=180)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    with SshHosts(tmp_path_factory.mktemp("ssh"), count=2) as h:
        yield h


def options(hosts: SshHosts, **kw) -> kt.Hosts:
    names = kw.pop("names", [h.name for h in hosts.hosts])
    kw.setdefault("known_hosts", str(hosts.known_hosts))
    return kt.Hosts(names, ssh_config=str(hosts.ssh_config), python=sys.executable, **kw)


def ddp_step(steps: int = 2) -> dict:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        torch.manual_seed(int(os.environ["RANK"]))  # each rank its own data
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }


def layout() -> dict:
    import os

    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
    return {k: os.environ[k] for k in keys} | {"pod": os.environ["KTLITE_POD_NAME"]}


def nap(seconds: float) -> int:
    import time

    time.sleep(seconds)
    return 1


def test_ddp_across_two_hosts_keeps_every_rank_identical(hosts: SshHosts) -> None:
    assert all(h.port != 22 for h in hosts.hosts)  # reached through the config's aliases
    remote = kt.fn(ddp_step, name="ssh-ddp").to(
        kt.Compute(hosts=options(hosts)).distribute("pytorch", num_proc=2)
    )
    try:
        out = remote()
        assert [o["rank"] for o in out] == [0, 1, 2, 3] and {o["world"] for o in out} == {4}
        assert all(o["weights"] == out[0]["weights"] for o in out)
        assert [ep.ip for ep in remote.deployment.endpoints] == [h.address for h in hosts.hosts]
    finally:
        remote.teardown()


def test_uneven_hosts_get_their_own_ranks(hosts: SshHosts) -> None:
    h = options(hosts, names=[kt.Host("host0", num_proc=1), kt.Host("host1", num_proc=3)])
    remote = kt.fn(layout, name="ssh-uneven").to(kt.Compute(hosts=h))
    try:
        out = remote()
        assert [o["RANK"] for o in out] == ["0", "1", "2", "3"]
        assert [o["LOCAL_WORLD_SIZE"] for o in out] == ["1", "3", "3", "3"]
        assert [o["pod"] for o in out] == ["ssh-uneven-0"] + ["ssh-uneven-1"] * 3
        assert {o["MASTER_ADDR"] for o in out} == {hosts.hosts[0].address}
    finally:
        remote.teardown()


def test_a_changed_host_key_is_refused_before_anything_starts(hosts: SshHosts) -> None:
    h = options(hosts, known_hosts=str(hosts.wrong_host_key_known_hosts()))
    with pytest.raises(
        kt.DeployError, match="host 0 \\(host0\\): its host key is not trusted"
    ) as info:
        kt.fn(layout, name="ssh-badkey").to(kt.Compute(hosts=h))
    assert "accept_new_host_keys" in str(info.value)
    assert not _servers("ssh-badkey")  # host1 connected fine, and still nothing was started
    h = options(
        hosts, known_hosts=str(hosts.wrong_host_key_known_hosts()), accept_new_host_keys=True
    )
    with pytest.raises(kt.DeployError, match="host 0 \\(host0\\): its host key CHANGED"):
        kt.fn(layout, name="ssh-badkey").to(kt.Compute(hosts=h))  # a changed key is never new
    assert not _servers("ssh-badkey")


def test_an_unknown_host_needs_accept_new_host_keys(
    hosts: SshHosts, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    with pytest.raises(kt.DeployError, match="not trusted"):
        kt.fn(layout, name="ssh-newkey").to(
            kt.Compute(hosts=options(hosts, known_hosts=str(known)))
        )
    caplog.set_level(logging.WARNING, logger="ktlite")
    remote = kt.fn(layout, name="ssh-newkey").to(
        kt.Compute(hosts=options(hosts, known_hosts=str(known), accept_new_host_keys=True))
    )
    try:
        assert len(remote()) == 2
        text = known.read_text()
        assert all(h.host_key_pub in text for h in hosts.hosts)
        # each key added is said once, as a warning of the ssh backend (a log record)
        added = sorted(
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("ktlite.backends.ssh") and r.levelno == logging.WARNING
        )
        assert added == [
            f"added host {i} ({h.name})'s host key to {known} (accept_new_host_keys)"
            for i, h in enumerate(hosts.hosts)
        ], added
    finally:
        remote.teardown()


def test_the_log_level_reaches_the_hosts_pod_servers(
    hosts: SshHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ktlite.backends.ssh import SshBackend

    monkeypatch.setenv("KTLITE_LOG_LEVEL", "DEBUG")
    remote = kt.fn(layout, name="ssh-debug").to(kt.Compute(hosts=options(hosts), stream_logs=False))
    try:
        assert len(remote()) == 2
        token = remote.deployment.applied.token
        lines = list(SshBackend.shared().logs("ssh-debug"))
        for pod in ("ssh-debug-0", "ssh-debug-1"):
            mine = [line for line in lines if line.startswith(f"[{pod}]")]
            assert any(
                "DEBUG ktlite_server.requests" in line and "POST /deploy from " in line
                for line in mine
            ), mine
        assert not any(token in line for line in lines)
    finally:
        remote.teardown()


def test_an_unreachable_host_is_named_within_seconds(hosts: SshHosts, tmp_path: Path) -> None:
    start = time.monotonic()
    h = kt.Hosts(
        ["host0", "root@127.0.1.250:1"],
        ssh_config=str(hosts.ssh_config),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
    )
    with pytest.raises(
        kt.DeployError, match="host 1 \\(root@127.0.1.250:1\\): cannot connect over SSH"
    ):
        kt.fn(layout, name="ssh-unreachable").to(kt.Compute(hosts=h))
    assert time.monotonic() - start < 20


def test_a_host_that_dies_mid_call_fails_the_call_and_teardown_leaves_nothing(
    hosts: SshHosts,
) -> None:
    remote = kt.fn(nap, name="ssh-dies").to(kt.Compute(hosts=options(hosts)))
    pids = {p["pid"] for p in _state("ssh-dies")["pods"]}
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(_outcome(remote, 60)))
    thread.start()
    deadline = time.monotonic() + 30
    while not all(pod["active_calls"] for pod in remote.status()):  # the call runs on both hosts
        assert time.monotonic() < deadline and thread.is_alive(), (
            f"the call was not running after 30 s: {out}"
        )
        time.sleep(0.05)
    hosts.hosts[1].stop()  # the machine goes: its sshd and every session on it
    try:
        thread.join(30)
        assert not thread.is_alive(), "the call still waits for a dead host"
        assert isinstance(out.get("error"), kt.KtliteError), out
        assert "ssh-dies-1" in str(out["error"])
    finally:
        hosts.hosts[1].start()
        remote.teardown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _servers("ssh-dies"):
        time.sleep(0.2)
    assert not _servers("ssh-dies") and not [p for p in pids if pid_alive(p)]
    assert not any(Path(os.path.expanduser("~/.cache/ktlite/run")).glob("ssh-dies-*"))


def test_a_detached_server_stops_on_its_own_after_inactivity_ttl(hosts: SshHosts) -> None:
    remote = kt.fn(layout, name="ssh-ttl").to(
        kt.Compute(hosts=options(hosts), inactivity_ttl=3), detached=True
    )
    assert len(remote()) == 2
    pids = [p["pid"] for p in _state("ssh-ttl")["pods"]]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids), "the servers outlived inactivity_ttl"
    remote.teardown()


def _outcome(remote, arg: float) -> dict:
    try:
        return {"value": remote(arg)}
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return {"error": e}


def _state(name: str) -> dict:
    from ktlite.backends.ssh import SshBackend

    state = SshBackend.shared()._read(name)
    assert state is not None
    return state


def _servers(name: str) -> list[int]:
    """Pod servers of deployment ``name`` running on this machine (every test host is it)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                b"ktlite_server" in cmd
                and any(a.startswith(f"{name}-".encode()) for a in cmd)
                and pid_alive(int(p.name))
            ):
                found.append(int(p.name))
    return found


def shout(text: str) -> int:
    print(f"hello from {text}", flush=True)
    return 1


def test_list_and_logs_of_an_ssh_deployment(hosts: SshHosts) -> None:
    from ktlite.backends.ssh import SshBackend

    backend = SshBackend.shared()
    remote = kt.fn(shout, name="ssh-logs").to(kt.Compute(hosts=options(hosts), stream_logs=False))
    try:
        assert remote("ssh") == [1, 1]
        (row,) = [r for r in backend.list() if r["name"] == "ssh-logs"]
        assert (row["pods"], row["ready"], row["hosts"]) == (2, 2, ["host0", "host1"])
        lines = list(backend.logs("ssh-logs"))
        for pod in ("ssh-logs-0", "ssh-logs-1"):
            assert any(
                line.startswith(f"[{pod}]") and "hello from ssh" in line for line in lines
            ), lines
        followed = backend.logs("ssh-logs", ordinal=1, follow=True, tail=50)
        assert "hello from ssh" in next(line for line in followed if "hello" in line)
        followed.close()  # stops the remote tail -F
    finally:
        remote.teardown()
    assert not [r for r in backend.list() if r["name"] == "ssh-logs"]


def test_calls_through_ssh_port_forwards(hosts: SshHosts) -> None:
    remote = kt.fn(layout, name="ssh-forward").to(kt.Compute(hosts=options(hosts, forward=True)))
    try:
        urls = [ep.url for ep in remote.deployment.endpoints]
        # this side of the tunnels, TLS end to end through them (pinned, as any ssh pod)
        assert all(u.startswith("https://127.0.0.1:") for u in urls), urls
        assert [o["RANK"] for o in remote()] == ["0", "1"]
    finally:
        remote.teardown()


OWNER = """
import sys
import ktlite as kt

def pid():
    import os
    return os.getpid()

hosts = kt.Hosts(["host0", "host1"], ssh_config=sys.argv[1], known_hosts=sys.argv[2], python=sys.executable)
remote = kt.fn(pid, name="ssh-owner").to(kt.Compute(hosts=hosts))
print(remote(), flush=True)
"""


def test_servers_of_a_process_that_exits_go_with_its_connections(
    hosts: SshHosts, tmp_path: Path
) -> None:
    import subprocess

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {**os.environ, "KTLITE_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, str(script), str(hosts.ssh_config), str(hosts.known_hosts)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _servers("ssh-owner"):
        time.sleep(0.2)
    assert not _servers("ssh-owner"), "the pod servers outlived the process that started them"


def test_kt_app_runs_a_script_of_this_directory_on_each_host(
    hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    (work / "job.py").write_text(
        "import os, socket\nprint('replica', os.environ['RANK'], 'of', "
        "os.environ['WORLD_SIZE'], 'says', open('data.txt').read().strip())\n"
    )
    (work / "data.txt").write_text("hello from the caller's directory\n")
    monkeypatch.chdir(work)
    app = kt.app(
        cli_command=[sys.executable, "job.py"], replicas=2, name="ssh-app", hosts=options(hosts)
    )
    try:
        assert app.run() == [0, 0]
    finally:
        app.teardown()


def test_a_served_app_on_a_host_is_reached_through_the_ssh_port_forward(
    hosts: SshHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kt.app(port=...) on a host reached only through an SSH tunnel: the local URL goes
    # through the tunnel (TLS to the pod server) and its /ports/ route to the app
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.chdir(Path(__file__).parent / "apps_served")
    app = kt.app(
        cli_command=[sys.executable, "echo_app.py", str(port)],
        name="ssh-served",
        port=port,
        health_check="/health",
        hosts=options(hosts, names=[hosts.hosts[0].name], forward=True),
    )
    try:
        (started,) = app.start()
        assert started["port"] == port
        answer = httpx.get(app.url + "/hello", timeout=30)
        assert answer.status_code == 200 and answer.text.startswith("hello from pod"), answer.text
        body = os.urandom(1 << 20)
        assert httpx.post(app.url + "/echo", content=body, timeout=60).content == body
    finally:
        app.teardown()


def test_refused_authentication_names_the_host(hosts: SshHosts, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"  # a key no host authorized
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = tmp_path / "ssh_config"
    h = hosts.hosts[0]
    config.write_text(
        f"Host stranger\n  HostName {h.address}\n  Port {h.port}\n  User root\n"
        f"  IdentityFile {stranger}\n  IdentitiesOnly yes\n"
    )
    opts = kt.Hosts(
        ["stranger"],
        ssh_config=str(config),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
    )
    with pytest.raises(kt.DeployError, match="host 0 \\(stranger\\): authentication refused"):
        kt.fn(layout, name="ssh-stranger").to(kt.Compute(hosts=opts))


def test_a_code_only_redeploy_keeps_the_servers(hosts: SshHosts) -> None:
    compute = kt.Compute(hosts=options(hosts))
    first = kt.fn(layout, name="ssh-redeploy").to(compute)
    try:
        before = [(p["pid"], p["port"]) for p in _state("ssh-redeploy")["pods"]]
        port = first.deployment.applied.master_port
        again = kt.fn(shout, name="ssh-redeploy").to(compute)  # new code, same pods
        assert again("again") == [1, 1]
        assert [(p["pid"], p["port"]) for p in _state("ssh-redeploy")["pods"]] == before
        assert again.deployment.applied.master_port == port
    finally:
        first.teardown()


def test_a_host_python_without_the_servers_packages_gets_them_from_this_client(
    hosts: SshHosts,
) -> None:
    """No package index needed: the server's dependencies (fastapi, uvicorn, httpx,
    cloudpickle at this client's version...) go over SFTP from this client's own install
    when the host's Python lacks them and has this client's minor version and machine."""
    import glob
    import shutil

    base = getattr(sys, "_base_executable", sys.executable)
    probe = subprocess_run(
        [base, "-c", "import importlib.util as u; print(u.find_spec('fastapi') is None)"]
    )
    if probe.strip() != "True":
        pytest.skip(f"{base} has fastapi: nothing to ship")
    cache = os.path.expanduser("~/.cache/ktlite")
    for path in glob.glob(f"{cache}/venv-*") + glob.glob(f"{cache}/deps-*"):
        shutil.rmtree(path, ignore_errors=True)
    opts = kt.Hosts(
        ["host0", "host1"],
        ssh_config=str(hosts.ssh_config),
        known_hosts=str(hosts.known_hosts),
        python=base,
    )
    remote = kt.fn(layout, name="ssh-deps").to(kt.Compute(hosts=opts))
    try:
        assert [o["RANK"] for o in remote()] == ["0", "1"]
        assert glob.glob(f"{cache}/deps-*/fastapi/__init__.py")
        assert not glob.glob(f"{cache}/venv-*"), "pip was needed after all"
    finally:
        remote.teardown()


def subprocess_run(argv: list[str]) -> str:
    import subprocess

    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
