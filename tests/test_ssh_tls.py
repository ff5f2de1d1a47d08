"""TLS on the ssh backend, on by default, against real OpenSSH servers (``ssh_hosts.py``): the
pods serve only TLS pinned to the deployment's certificate, caller to pod and pod to pod
(a relay on each hop records what a sniffer would read), and the key reaches the host on the
SSH channel without being left on its disk."""

from __future__ import annotations

import dataclasses
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from ssh_hosts import SshHosts, ssh_marks
from tcp_relay import Relay

import ktlite as kt
import ktlite.net.client

pytestmark = ssh_marks(timeout=240)


def size(x: bytes) -> int:
    return len(x)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    with SshHosts(tmp_path_factory.mktemp("ssh-tls"), count=2, own_home=True) as h:
        yield h


def _compute(hosts: SshHosts, **kw: Any) -> kt.Compute:
    return kt.Compute(
        hosts=kt.Hosts(
            [h.name for h in hosts.hosts],
            ssh_config=str(hosts.ssh_config),
            known_hosts=str(hosts.known_hosts),
            python=sys.executable,
        ),
        **kw,
    )


def _through_relays(remote: Any) -> tuple[bytes, bytes, bytes, list[int]]:
    """A call with the caller->pod 0 and pod 0->pod 1 hops each through a recording relay."""
    dep = remote.deployment
    eps = list(dep.applied.endpoints)
    first, second = urlsplit(eps[0].url), urlsplit(eps[1].peer_url)
    to_pod0 = Relay(first.port or 0, first.hostname or "")
    to_pod1 = Relay(second.port or 0, second.hostname or "")
    try:
        dep.applied.endpoints = [
            dataclasses.replace(eps[0], url=f"{first.scheme}://127.0.0.1:{to_pod0.port}"),
            dataclasses.replace(eps[1], peer_url=f"{second.scheme}://127.0.0.1:{to_pod1.port}"),
        ]
        marker = b"SNIFF-ME-" + secrets.token_hex(8).encode()
        values = remote(marker * 3)
    finally:
        dep.applied.endpoints = eps
        to_pod0.close()
        to_pod1.close()
    assert to_pod0.connections and to_pod1.connections
    return to_pod0.seen(), to_pod1.seen(), marker, values


def test_ssh_pods_serve_tls_by_default_and_a_sniffer_reads_nothing(hosts: SshHosts) -> None:
    remote = kt.fn(size, name="ssh-tls-on").to(_compute(hosts))
    try:
        dep = remote.deployment
        assert [urlsplit(ep.url).scheme for ep in dep.endpoints] == ["https", "https"]
        assert [urlsplit(ep.peer_url).scheme for ep in dep.endpoints] == ["https", "https"]
        caller_hop, peer_hop, marker, values = _through_relays(remote)
        assert values == [len(marker) * 3] * 2
        token = dep.applied.token.encode()
        for hop in (caller_hop, peer_hop):
            assert hop and token not in hop and marker not in hop and b"HTTP/1.1" not in hop
        # the key came over the SSH channel and was not left on the host's disk
        for host in hosts.hosts:
            assert host.home is not None
            files = [p for p in Path(host.home).rglob("*") if p.is_file()]
            assert files  # the host's cache and run directory are there
            assert not [p for p in files if b"PRIVATE KEY" in p.read_bytes()]
    finally:
        remote.teardown()


def test_tls_false_on_ssh_is_plain_and_readable(hosts: SshHosts) -> None:
    """The control: the same relays read the token when the user turns TLS off."""
    remote = kt.fn(size, name="ssh-tls-off").to(_compute(hosts, tls=False))
    try:
        assert remote.deployment.endpoints[0].url.startswith("http://")
        caller_hop, peer_hop, marker, values = _through_relays(remote)
        assert values == [len(marker) * 3] * 2
        token = remote.deployment.applied.token.encode()
        assert token in caller_hop and token in peer_hop and marker in caller_hop
    finally:
        remote.teardown()


def test_the_ssh_plan_ships_the_key_on_stdin_and_never_prints_it(hosts: SshHosts) -> None:
    plan = str(kt.fn(size, name="ssh-tls-plan").to(_compute(hosts), dryrun=True))
    assert "--tls-stdin" in plan and "TLS certificate and key" in plan
    assert "BEGIN" not in plan


def test_submitted_calls_go_over_one_tls_link_that_a_sniffer_cannot_read(hosts: SshHosts) -> None:
    one = kt.Hosts(
        [hosts.hosts[0].name],
        ssh_config=str(hosts.ssh_config),
        known_hosts=str(hosts.known_hosts),
        python=sys.executable,
    )
    remote = kt.fn(size, name="ssh-tls-link").to(kt.Compute(hosts=one, concurrency=4))
    dep = remote.deployment
    eps = list(dep.applied.endpoints)
    first = urlsplit(eps[0].url)
    relay = Relay(first.port or 0, first.hostname or "")
    try:
        dep.applied.endpoints = [dataclasses.replace(eps[0], url=f"https://127.0.0.1:{relay.port}")]
        marker = b"SNIFF-ME-" + secrets.token_hex(8).encode()
        futures = [remote.submit(marker * n) for n in range(1, 9)]
        values = [f.result(timeout=120) for f in futures]
        assert values == [[len(marker) * n] for n in range(1, 9)]  # one rank, one value each
        links = [k for k in ktlite.net.client._links._links.values() if k.key[1] == relay.port]
        assert len(links) == 1 and links[0].tls  # the eight calls shared one link
        seen = relay.seen()
        assert relay.connections == 1 and seen
        assert dep.applied.token.encode() not in seen and marker not in seen
    finally:
        dep.applied.endpoints = eps
        relay.close()
        remote.teardown()
