"""The pod server on the wire, with real pod servers and rank processes: it never unpickles
anything (from the client, its ranks or its peers), and a protocol version clash, either
way round, is an error that names both versions and what to do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

import ktlite as kt
from ktlite.backends.registry import get_backend
from ktlite.net.client import PodClient
from ktlite_wire.errors import ErrorCode
from ktlite_wire.headers import ERROR_CODE_HEADER, TOKEN_HEADER, VERSION_HEADER, bearer
from ktlite_wire.version import PROTOCOL_VERSION

AUDIT = str(Path(__file__).parent / "wire_audit")  # its sitecustomize.py records unpickling


def probe(mode: str) -> object:
    """The user's code: a value, a failure, or what this rank process has imported."""
    import os
    import sys

    if mode == "fail":
        raise KeyError(f"on purpose on rank {os.environ['RANK']}")
    if mode == "modules":
        return sorted(m for m in sys.modules if m == "ktlite" or m.startswith("ktlite."))
    return {"rank": int(os.environ["RANK"]), "tensor-ish": bytes(8192)}


class Refuses:
    """A class whose constructor fails on every rank: a failed load, reported through the
    rank channel as the exception's pickled info."""

    def __init__(self) -> None:
        raise RuntimeError("this class cannot be built, on purpose")


def _audit_env(log_dir: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([AUDIT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "KTLITE_PICKLE_AUDIT": str(log_dir), **extra}


def test_the_pod_server_never_unpickles(tmp_path) -> None:
    """Deploy, a call, a failing call, a failed load, a colocation, all fanned out from pod 0 to
    pod 1: the pod servers' processes unpickle nothing (their rank processes do, and the audit
    hook shows the hook itself works)."""
    compute = kt.Compute(cpus=1, stream_logs=False, env=_audit_env(tmp_path))
    remote = kt.fn(probe, name="wire-nopickle").to(
        compute.distribute("spmd", workers=2, num_proc=1)
    )
    try:
        got = remote("value")
        assert [g["rank"] for g in got] == [0, 1]
        with pytest.raises(KeyError, match="on purpose"):
            remote("fail")
        with pytest.raises(RuntimeError, match="cannot be built"):
            kt.cls(Refuses, name="wire-nopickle-cls").to(remote)
        servers = {p["server_pid"] for p in remote.status()}
    finally:
        remote.teardown()
    assert len(servers) == 2
    logs = {int(p.stem): p.read_text() for p in tmp_path.glob("*.log")}
    assert set(logs) - servers, "the audit hook saw no unpickling at all, not even in the ranks"
    for pid in servers:
        assert pid not in logs, f"pod server {pid} unpickled:\n{logs[pid][:3000]}"


def test_rank_processes_load_no_client_module(tmp_path) -> None:
    """A rank process runs the user's code without ``ktlite`` (only ``ktlite_wire`` and
    ``ktlite_server``) unless that code imports it."""
    compute = kt.Compute(cpus=1, stream_logs=False)
    remote = kt.fn(probe, name="wire-modules").to(compute.distribute("spmd", workers=2, num_proc=1))
    try:
        assert remote("modules") == [[], []]
    finally:
        remote.teardown()


@pytest.fixture(scope="module")
def old_server(tmp_path_factory):
    """A real pod server that speaks the previous protocol version (as an older ktlite does)."""
    old = str(PROTOCOL_VERSION - 1)
    compute = kt.Compute(
        cpus=1,
        stream_logs=False,
        env=_audit_env(tmp_path_factory.mktemp("old"), KTLITE_WIRE_VERSION=old),
    )
    with pytest.raises(kt.ProtocolMismatch) as info:  # the new client refuses it at once
        kt.fn(probe, name="wire-old-server").to(compute)
    yield info.value, old
    get_backend("local").teardown("wire-old-server")


def test_a_new_client_refuses_an_old_server_naming_both_versions(old_server) -> None:
    error, old = old_server
    text = str(error)
    assert f"speaks {old}" in text and f"speaks {PROTOCOL_VERSION}" in text, text
    assert "install the same ktlite version" in text, text


def test_a_new_server_refuses_an_old_client_with_a_code(tmp_path) -> None:
    """An old client's request (its version header) is refused with the mismatch code and a
    message naming both versions; the real client maps the code to ProtocolMismatch."""
    compute = kt.Compute(cpus=1, stream_logs=False)
    remote = kt.fn(probe, name="wire-old-client").to(compute)
    try:
        pod = remote.status()[0]
        token = remote._deployment.applied.token
        url = remote._deployment.endpoints[0].url
        old = str(PROTOCOL_VERSION - 1)
        resp = httpx.get(
            f"{url}/status", headers={TOKEN_HEADER: bearer(token), VERSION_HEADER: old}, timeout=30
        )
        assert resp.status_code == 409, resp.text
        assert resp.headers[ERROR_CODE_HEADER] == ErrorCode.PROTOCOL_MISMATCH.value
        detail = resp.json()["detail"]
        assert f"speaks {old}" in detail and f"speaks {PROTOCOL_VERSION}" in detail, detail
        assert "install the same ktlite version" in detail and token not in detail
        assert pod["pod"] in detail
        client = PodClient(token)
        with pytest.raises(kt.ProtocolMismatch, match=f"speaks {old}"):
            client._check(resp, url)
    finally:
        remote.teardown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
