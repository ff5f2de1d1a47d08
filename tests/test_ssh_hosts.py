"""The sshd fixture itself, checked with the real OpenSSH client: each alias reaches its own
host, a wrong host key is refused, and a stopped host takes its sessions down with it."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ssh_hosts import SshHosts, pid_gone, sshd_available

pytestmark = [
    pytest.mark.skipif(not sshd_available(), reason="needs /usr/sbin/sshd"),
    pytest.mark.timeout(60),
]


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[SshHosts]:
    with SshHosts(tmp_path, count=2) as started:
        yield started


def _ssh_args(hosts: SshHosts, alias: str, command: str, *options: str) -> list[str]:
    return [
        "ssh",
        "-F",
        str(hosts.ssh_config),
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        *options,
        alias,
        command,
    ]


def _ssh(
    hosts: SshHosts, alias: str, command: str, *options: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _ssh_args(hosts, alias, command, *options), capture_output=True, text=True, timeout=20
    )


def test_each_alias_reaches_its_own_host(hosts: SshHosts) -> None:
    for host in hosts.hosts:
        result = _ssh(hosts, host.name, "echo hi $SSH_CONNECTION; id -u")
        assert result.returncode == 0, result.stderr
        hi, _, _, address, port = result.stdout.splitlines()[0].split()
        assert (hi, address, int(port)) == ("hi", host.address, host.port)
        assert result.stdout.splitlines()[1] == "0"


def test_wrong_host_key_is_refused(hosts: SshHosts) -> None:
    wrong = hosts.wrong_host_key_known_hosts()
    result = _ssh(hosts, "host0", "echo hi", "-o", f"UserKnownHostsFile={wrong}")
    assert result.returncode == 255
    assert (
        "REMOTE HOST IDENTIFICATION HAS CHANGED" in result.stderr
        or "Host key verification failed" in result.stderr
    ), result.stderr
    assert "hi" not in result.stdout
    assert _ssh(hosts, "host1", "echo hi", "-o", f"UserKnownHostsFile={wrong}").stdout == "hi\n"


def test_stop_kills_sessions_and_start_brings_host_back(hosts: SshHosts) -> None:
    host = hosts.hosts[1]
    client = subprocess.Popen(
        _ssh_args(hosts, host.name, "echo $$; exec sleep 30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert client.stdout is not None
    with client.stdout:
        remote_pid = int(client.stdout.readline())
        began = time.monotonic()
        host.stop()
        client.wait(timeout=5)
    assert time.monotonic() - began < 5
    assert client.returncode == 255
    assert pid_gone(remote_pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host.address, host.port), timeout=2).close()
    assert _ssh(hosts, "host0", "echo hi").stdout == "hi\n"

    host.start()
    assert _ssh(hosts, host.name, "echo hi").stdout == "hi\n"
