"""Per-deployment TLS on real pod servers of the local backend (``Compute(tls=True)``): what
crosses the wire (a relay that records every byte, caller to pod and pod to pod), the pinned
certificate (a client with another deployment's is refused, saying what it expected and what
it got), and the key kept out of plans and reprs."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from tcp_relay import Relay

import ktlite as kt
from ktlite.backends.processes import pid_alive
from ktlite.errors import PodUnreachable
from ktlite.net import tls
from ktlite.net.client import PodClient
from ktlite_wire import pinning


def echo(x: bytes) -> int:
    return len(x)


def _deploy(name: str, on: bool) -> Any:
    # a peer that is not this deployment's must fail a call at once, not after quorum_timeout
    compute = kt.Compute(tls=on).distribute("spmd", workers=2, quorum_timeout=3600)
    return kt.fn(echo, name=name).to(compute)


@pytest.fixture(scope="module")
def secured() -> Iterator[object]:
    remote = _deploy("tls-on", True)
    yield remote
    remote.teardown()


@pytest.fixture(scope="module")
def plain() -> Iterator[object]:
    remote = _deploy("tls-off", False)
    yield remote
    remote.teardown()


def _sniff(remote: object) -> tuple[bytes, bytes, bytes, list[int]]:
    """Call ``remote`` with pod 0 reached through one relay and pod 1 (from pod 0) through
    another: (what crossed caller->pod 0, what crossed pod 0->pod 1, the marker sent, the
    values)."""
    dep = remote.deployment  # type: ignore[attr-defined]
    eps = list(dep.applied.endpoints)
    to_pod0 = Relay(urlsplit(eps[0].url).port or 0)
    to_pod1 = Relay(urlsplit(eps[1].peer_url).port or 0)
    scheme = urlsplit(eps[0].url).scheme
    try:
        dep.applied.endpoints = [
            dataclasses.replace(eps[0], url=f"{scheme}://127.0.0.1:{to_pod0.port}"),
            dataclasses.replace(eps[1], peer_url=f"{scheme}://127.0.0.1:{to_pod1.port}"),
        ]
        marker = b"SNIFF-ME-" + secrets.token_hex(8).encode()
        values = remote(marker * 4)  # type: ignore[operator]
    finally:
        dep.applied.endpoints = eps
        to_pod0.close()
        to_pod1.close()
    assert to_pod0.connections and to_pod1.connections  # both hops went through the relays
    return to_pod0.seen(), to_pod1.seen(), marker, values


def test_without_tls_a_sniffer_reads_the_token_and_the_arguments(plain: object) -> None:
    """The control: the relay does see what travels in clear."""
    caller_hop, peer_hop, marker, values = _sniff(plain)
    token = plain.deployment.applied.token.encode()  # type: ignore[attr-defined]
    assert values == [len(marker) * 4] * 2
    for hop in (caller_hop, peer_hop):
        assert token in hop
        assert marker in hop


def test_with_tls_a_sniffer_reads_neither_token_nor_arguments(secured: object) -> None:
    caller_hop, peer_hop, marker, values = _sniff(secured)
    dep = secured.deployment  # type: ignore[attr-defined]
    assert all(ep.url.startswith("https://") for ep in dep.endpoints)
    assert values == [len(marker) * 4] * 2
    token = dep.applied.token.encode()
    for hop in (caller_hop, peer_hop):
        assert hop  # bytes did cross (a TLS handshake at least)
        assert token not in hop
        assert marker not in hop
        assert b"HTTP/1.1" not in hop  # not even the request line


def test_a_client_pinned_to_another_certificate_is_refused_and_told_why(secured: object) -> None:
    dep = secured.deployment  # type: ignore[attr-defined]
    url = dep.endpoints[0].url
    stranger = "not-" + secrets.token_urlsafe(16)
    with pytest.raises(PodUnreachable) as caught:
        PodClient(stranger).health(url)
    message = str(caught.value)
    assert "not this deployment's pod" in message
    assert tls.identity(stranger).fingerprint in message  # what was expected
    assert tls.identity(dep.applied.token).fingerprint in message  # what arrived
    assert "deploy again" in message  # what to do
    assert dep.applied.token not in message and stranger not in message
    # the deployment's own client is unaffected
    assert PodClient(dep.applied.token).health(url)["protocol"]


def test_a_tls_client_facing_a_plain_server_says_so(plain: object) -> None:
    dep = plain.deployment  # type: ignore[attr-defined]
    url = dep.endpoints[0].url.replace("http://", "https://")
    with pytest.raises(PodUnreachable, match="plain HTTP"):
        PodClient(dep.applied.token).health(url)


def test_a_plain_client_gets_nothing_from_a_tls_pod(secured: object) -> None:
    dep = secured.deployment  # type: ignore[attr-defined]
    url = dep.endpoints[0].url.replace("https://", "http://")
    with pytest.raises(PodUnreachable):
        PodClient(dep.applied.token).health(url, timeout=10)


def test_the_key_stays_out_of_plans_and_reprs() -> None:
    token = secrets.token_urlsafe(32)
    ident = tls.identity(token)
    assert ident == tls.identity(token)  # made again from the token, the same key
    assert b"PRIVATE KEY" in ident.key_pem
    assert "PRIVATE" not in repr(ident) and ident.fingerprint in repr(ident)
    compute = kt.Compute(tls=True)
    plan = str(kt.fn(echo, name="tls-plan").to(compute, dryrun=True))
    assert tls.KEY_PLACEHOLDER in plan and "--tls-stdin" in plan
    assert "BEGIN" not in plan
    assert pinning.SERVER_NAME == "ktlite-pod"


def test_another_process_makes_the_same_certificate_and_key_from_the_token() -> None:
    """What a client that did not start the pods (another process, `ktlite status`, a
    reattach) pins, and what an unchanged Kubernetes Secret holds, must be the very bytes the
    pods got."""
    token = secrets.token_urlsafe(32)
    code = (
        "import sys; from ktlite.net.tls import identity; i = identity(sys.stdin.read()); "
        "print((i.cert_pem + i.key_pem).hex())"
    )
    made = subprocess.run(
        [sys.executable, "-c", code], input=token, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    here = tls.identity(token)
    assert bytes.fromhex(made.stdout.strip()) == here.cert_pem + here.key_pem
    assert tls.identity("another-" + token).key_pem != here.key_pem


def test_tls_is_a_bool_or_none() -> None:
    with pytest.raises(kt.ConfigError, match="tls='yes'"):
        kt.Compute(tls="yes")


def test_a_redeploy_switches_tls_as_asked_and_keeps_tls_pods_that_did_not_change() -> None:
    remote = _deploy("tls-switch", False)
    try:
        assert remote.deployment.endpoints[0].url.startswith("http://")
        remote = _deploy("tls-switch", True)
        started = [ep.incarnation for ep in remote.deployment.endpoints]
        assert remote.deployment.endpoints[0].url.startswith("https://")
        assert remote(b"abc") == [3, 3]
        remote = _deploy("tls-switch", True)  # the same pods: asked over TLS if they answer
        assert [ep.incarnation for ep in remote.deployment.endpoints] == started
        assert remote(b"abcd") == [4, 4]
    finally:
        remote.teardown()


def test_a_pod_refuses_a_peer_with_another_deployments_certificate(secured: object) -> None:
    """Pod to pod is pinned too: pod 0 told that its peer is another deployment's TLS pod
    (same port kind, another certificate) refuses it before sending the call, at its first
    try: waiting cannot make another deployment's server this one's."""
    other = kt.fn(echo, name="tls-other").to(kt.Compute(tls=True))
    dep = secured.deployment  # type: ignore[attr-defined]
    eps = list(dep.applied.endpoints)
    stranger = Relay(urlsplit(other.deployment.endpoints[0].peer_url).port or 0)
    try:
        peer_url = f"https://127.0.0.1:{stranger.port}"
        dep.applied.endpoints = [eps[0], dataclasses.replace(eps[1], peer_url=peer_url)]
        with pytest.raises(kt.KtliteError, match="not this deployment's") as caught:
            secured(b"x")  # type: ignore[operator]
        assert dep.applied.token not in str(caught.value)
        assert stranger.connections == 1, stranger.connections
    finally:
        dep.applied.endpoints = eps
        stranger.close()
        other.teardown()
    assert secured(b"xy") == [2, 2]  # type: ignore[operator]


def test_a_tls_pod_server_stops_at_once_with_idle_connections_open() -> None:
    """SIGTERM with the caller's pooled TLS connection and pod 0's to pod 1 idle: each server
    drops them and exits, instead of waiting for a TLS close_notify that an idle peer never
    sends (uvicorn's graceful timeout then cancels: every TLS teardown took 3 s longer)."""
    name = f"tls-stop-{secrets.token_hex(3)}"
    remote = kt.fn(echo, name=name).to(kt.Compute(tls=True).distribute("spmd", workers=2))
    try:
        assert remote(b"abc") == [3, 3]  # pooled: caller -> pod 0, pod 0 -> pod 1
        pids = [pod["server_pid"] for pod in remote.status()]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        for pid in pids:
            _wait_gone(pid)
        pod_logs = Path(os.environ["KTLITE_HOME"], "local", name).glob("pod-*.log")
        logs = "\n".join(path.read_text() for path in pod_logs)
        assert "graceful shutdown exceeded" not in logs, logs
    finally:
        remote.teardown()


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"pod server {pid} still running after SIGTERM"
        time.sleep(0.05)  # polling the pid, bounded by the deadline


def test_a_code_push_relayed_to_a_peer_with_another_deployments_certificate_fails_at_once(
    secured: object,
) -> None:
    """Pod 0 relays a code push to pod 1; told that pod 1 is another deployment's TLS server, it
    fails the push at its first try, naming the pod, instead of retrying until launch_timeout
    (600 s here): waiting cannot make another deployment's server this one's."""
    other = kt.fn(echo, name="tls-other-push").to(kt.Compute(tls=True))
    dep = secured.deployment  # type: ignore[attr-defined]
    eps = list(dep.applied.endpoints)
    stranger = Relay(urlsplit(other.deployment.endpoints[0].peer_url).port or 0)
    pushed: list[BaseException | None] = []
    try:
        peer_url = f"https://127.0.0.1:{stranger.port}"
        dep.applied.endpoints = [eps[0], dataclasses.replace(eps[1], peer_url=peer_url)]

        def push() -> None:
            try:
                dep.push(*dep.code)
                pushed.append(None)
            except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
                pushed.append(e)

        pushing = threading.Thread(target=push, daemon=True)
        pushing.start()
        pushing.join(timeout=120)
        assert pushed, "the push was still retrying pod 1 after 120 s (launch_timeout is 600 s)"
        error = pushed[0]
        assert isinstance(error, kt.KtliteError), error
        assert "not this deployment's" in str(error) and "tls-on-1" in str(error), error
        assert dep.applied.token not in str(error)
    finally:
        dep.applied.endpoints = eps
        stranger.close()
        other.teardown()
    dep.push(*dep.code)  # both pods on one launch again
    assert secured(b"xy") == [2, 2]  # type: ignore[operator]
