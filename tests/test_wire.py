"""The wire contract package ``ktlite_wire``: what it imports, what a pod server and a rank
process import, and every typed message's encode/decode (and refusal of a malformed one)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from dataclasses import fields, replace

import pytest

import ktlite_server
import ktlite_wire
from ktlite_wire import codec, envelope, rankchannel
from ktlite_wire.distenv import DistributedLayout
from ktlite_wire.errors import ErrorCode, ProtocolError, WireError
from ktlite_wire.frames import ERROR, LogLine, Notice, decode_error, error_frame, read_frames
from ktlite_wire.launch import Colocation, Launch, decode_deploy
from ktlite_wire.outcome import CallResult, RankOutcome, ShmRef
from ktlite_wire.plan import decode_plan
from ktlite_wire.status import Status
from ktlite_wire.version import PROTOCOL_VERSION


def _modules_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _all(pkg: object) -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))  # type: ignore[attr-defined]


def test_the_wire_package_imports_neither_side() -> None:
    mods = _modules_after("\n".join(f"import {m}" for m in ["ktlite_wire", *_all(ktlite_wire)]))
    bad = [
        m
        for m in mods
        if m.split(".")[0]
        in ("ktlite", "ktlite_server", "fastapi", "httpx", "starlette", "uvicorn")
    ]
    assert not bad, f"importing ktlite_wire imported {bad}"


def test_importing_ktlite_wire_runs_nothing() -> None:
    """The package itself is a docstring: its modules load only when named."""
    mods = _modules_after("import ktlite_wire")
    assert [m for m in mods if m.startswith("ktlite_wire")] == ["ktlite_wire"]


def test_the_pod_server_and_the_rank_process_import_no_client_module() -> None:
    """Every module of the server package (the pod server, the store, a rank process's own
    ``ktlite_server.rank``), imported in a fresh interpreter, leaves ``ktlite`` out."""
    names = [m for m in _all(ktlite_server) if m != "ktlite_server.__main__"]
    assert "ktlite_server.rank" in names and "ktlite_server.app" in names
    mods = _modules_after(
        "import ktlite_server.__main__ as m\n" + "\n".join(f"import {n}" for n in names)
    )
    assert "ktlite_server.app" in mods
    bad = [m for m in mods if m == "ktlite" or m.startswith("ktlite.")]
    assert not bad, f"the pod server imported client modules: {bad}"


# ---- the envelope -----------------------------------------------------------------------------


def test_an_envelope_carries_json_and_buffers_untouched() -> None:
    big = bytes(range(256)) * 300
    data = envelope.encode_bytes({"a": [1, "x"]}, [b"", big, bytearray(b"y")])
    header, bufs = envelope.decode(bytearray(data))
    assert header == {"a": [1, "x"]}
    assert [bytes(b) for b in bufs] == [b"", big, b"y"]
    assert all(b.obj is not None for b in bufs)  # views, not copies


@pytest.mark.parametrize("cut", [1, 10, 30, -1])
def test_a_truncated_envelope_is_a_protocol_error(cut: int) -> None:
    data = envelope.encode_bytes({"a": 1}, [b"z" * 100])
    with pytest.raises(ProtocolError, match="truncated"):
        envelope.decode(data[:cut])


def test_another_version_names_both_and_the_fix() -> None:
    data = bytearray(envelope.encode_bytes({"a": 1}))
    data[3] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError) as info:
        envelope.decode(data)
    text = str(info.value)
    assert f"speaks {PROTOCOL_VERSION + 1}" in text and f"speaks {PROTOCOL_VERSION}" in text
    assert "install the same ktlite version" in text


def test_a_value_message_is_not_a_typed_message() -> None:
    with pytest.raises(ProtocolError, match="magic"):
        envelope.decode(codec.dumps({"x": 1}))
    with pytest.raises(ProtocolError, match="magic"):
        codec.check(envelope.encode_bytes({"x": 1}))


@pytest.mark.parametrize("head", [b"[1, 2]", b"{", b"\xff"])
def test_a_header_that_is_not_a_json_object_is_refused(head: bytes) -> None:
    data = envelope.join(envelope.pack(envelope.MAGIC, [head], []))
    with pytest.raises(ProtocolError):
        envelope.decode(data)


# ---- typed messages --------------------------------------------------------------------------

LAYOUT = DistributedLayout("pytorch", workers=2, num_proc=[1, 2])


def _launch(**kw: object) -> Launch:
    base = Launch(
        launch_id="abc",
        bundle=b"\x80code",
        kind="cls",
        distributed=LAYOUT,
        pod_ips=["10.0.0.1", "10.0.0.2"],
        master_port=29500,
        init=b"init",
        sources={"mod": ("/x/mod.py", "X = 1\n", False)},
        cpus=2.5,
        concurrency=3,
        engine={"kind": "ray", "token": "s3cret"},
        store={"url": "http://s", "token": "s3cret"},
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_a_launch_round_trips_and_hides_its_secrets() -> None:
    launch = _launch(ordinal=1, restart=True, replica=True, generation=7)
    assert decode_deploy(launch.encode()) == launch
    assert "s3cret" not in repr(launch) and "code" not in repr(launch)
    assert decode_deploy(_launch(init=None).encode()).init is None


def test_a_colocation_round_trips() -> None:
    col = Colocation(
        target="b",
        launch_id="abc",
        kind="fn",
        bundle=b"fn",
        init=None,
        sources={"m": ("/m.py", "", True)},
        if_missing=True,
    )
    assert decode_deploy(col.encode()) == col
    drop = Colocation(target="b", launch_id="abc", drop=True)
    assert decode_deploy(drop.encode()) == drop


@pytest.mark.parametrize(
    "field,value",
    [
        ("kind", "lambda"),
        ("pod_ips", "10.0.0.1"),
        ("pod_ips", ["10.0.0.1", 7]),
        ("master_port", "29500"),
        ("launch_id", ""),
        ("distributed", {"framework": "mpi"}),
        ("distributed", {"workers": 2, "num_proc": [1]}),
        ("sources", {"m": "text"}),
        ("bundle", 7),
        ("type", "exec"),
        ("generation", -1),
        ("generation", "2"),
        ("generation", True),
    ],
)
def test_a_malformed_launch_is_a_protocol_error(field: str, value: object) -> None:
    header, bufs = envelope.decode(_launch().encode())
    header[field] = value
    with pytest.raises(ProtocolError):
        decode_deploy(envelope.encode_bytes(header, bufs))


def test_a_call_result_round_trips_without_copying_values() -> None:
    value = codec.dumps([1, 2, 3])
    result = CallResult(
        [
            RankOutcome(0, "p0", Status.OK, value, "", 1.5),
            RankOutcome(1, "p0", Status.ERROR, b"info", "", 2.0),
            RankOutcome(2, "p1", Status.OK, ShmRef("/dev/shm/ktlite-res-x", 9), "", 3.0),
            RankOutcome(3, "p1", Status.UNREACHABLE, None, "gone", 4.0),
        ],
        started=False,
    )
    got = CallResult.decode(bytearray(result.encode_bytes()))
    assert got.started is False
    assert [(o.rank, o.pod, o.status, o.message, o.at) for o in got.outcomes] == [
        (o.rank, o.pod, o.status, o.message, 0.0 if o.status is Status.OK else o.at)
        for o in result.outcomes
    ]  # a value's time is not sent: only a failure's is read
    assert codec.loads(got.outcomes[0].data) == [1, 2, 3]
    assert (
        got.outcomes[2].data == ShmRef("/dev/shm/ktlite-res-x", 9) and got.outcomes[3].data is None
    )


@pytest.mark.parametrize(
    "row",
    [
        ["0", "p", "ok", "", 0.0, None, None],
        [0, "p", "fine", "", 0.0, None, None],
        [0, "p", "ok", "", 0.0, 3, None],
        [0, "p", "ok", "", "later", None, None],
        [0, "p", "ok", "", 0.0, None, ["/dev/shm/x"]],
        [0, "ok"],
        {"rank": 0, "pod": "p", "status": "ok"},
    ],
)
def test_a_malformed_outcome_is_a_protocol_error(row: object) -> None:
    with pytest.raises(ProtocolError):
        CallResult.decode(envelope.encode_bytes({"outcomes": [row]}))


def test_statuses_are_their_own_json() -> None:
    assert json.dumps([Status.OK, Status.STALE]) == '["ok", "stale"]'
    assert Status.parse("died") is Status.DIED
    assert [s for s in Status if s.failed] == [
        Status.ERROR,
        Status.DIED,
        Status.UNREACHABLE,
        Status.STALE,
    ]
    with pytest.raises(ValueError, match="not one of"):
        Status.parse("fine")


@pytest.mark.parametrize(
    "msg",
    [
        rankchannel.Ready(42),
        rankchannel.Load(
            env={"RANK": "0"},
            kind="cls",
            bundle=b"b",
            init=b"i",
            sources={"m": ("/m.py", "", False)},
            concurrency=2,
        ),
        rankchannel.Load(env={}, target="t", drop=True),
        rankchannel.Loaded(False, b"err"),
        rankchannel.Call(
            id="c1", args=b"args", size=4, item=b"item", generation=3, group_port=29501
        ),
        rankchannel.Call(id="c2", path="/dev/shm/ktlite-arg-x", size=10, item_at=[4, 6]),
        rankchannel.Result(id="c1", ok=True, inline=b"value", has_pg=True, tainted=False),
        # every field apart from its neighbours (the pod server decodes a Result by position)
        rankchannel.Result(
            id="c3",
            ok=False,
            path="/dev/shm/ktlite-res-y",
            size=99,
            tainted=True,
            streaming=True,
            released=True,
        ),
        rankchannel.Result(id="c4", ok=True, inline=b"", size=7, has_pg=True, released=True),
        rankchannel.Interrupt("c1"),
        rankchannel.Exit(),
    ],
)
def test_rank_channel_messages_round_trip(msg: rankchannel.Message) -> None:
    parts = rankchannel.encode(msg)
    data = envelope.join(parts)
    assert rankchannel.LEN.unpack(data[:8])[0] == len(data) - 8
    got = rankchannel.decode(data[8:])
    assert type(got) is type(msg)

    def values(m: object) -> dict[str, object]:
        return {f.name: getattr(m, f.name) for f in fields(m)}  # type: ignore[arg-type]

    norm = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in values(got).items()}
    assert norm == values(msg)


def test_hot_rank_messages_are_binary_and_checked() -> None:
    """Call and Result have a fixed binary header (no JSON); a truncated one, one with bytes
    left over, bad text or another protocol version is refused with a ProtocolError."""
    call = rankchannel.Call(id="c1", args=b"\x00" * 100, generation=7, group_port=29500)
    data = envelope.join(rankchannel.encode(call))[8:]
    assert data[:3] == rankchannel.CALL_MAGIC and b"{" not in data[: rankchannel.CALL.size]
    got = rankchannel.decode(data)
    assert isinstance(got, rankchannel.Call) and bytes(got.args or b"") == bytes(100)
    assert (got.generation, got.group_port, got.path, got.item_at) == (7, 29500, None, None)
    result = envelope.join(rankchannel.encode(rankchannel.Result(id="c1", ok=False)))[8:]
    got_result = rankchannel.decode(result)
    assert isinstance(got_result, rankchannel.Result)
    assert (got_result.ok, got_result.inline, got_result.path) == (False, None, None)
    with pytest.raises(ProtocolError, match="truncated"):
        rankchannel.decode(data[:20])
    with pytest.raises(ProtocolError, match="fields take"):
        rankchannel.decode(data[:-1])
    with pytest.raises(ProtocolError, match="fields take"):
        rankchannel.decode(data + b"x")
    other = bytearray(data)
    other[3] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"speaks {PROTOCOL_VERSION + 1}"):
        rankchannel.decode(bytes(other))
    bad_id = bytearray(data)
    bad_id[rankchannel.CALL.size] = 0xFF
    with pytest.raises(ProtocolError, match="malformed"):
        rankchannel.decode(bytes(bad_id))


def test_a_rank_channel_message_of_another_kind_is_refused() -> None:
    with pytest.raises(ProtocolError, match="unknown type"):
        rankchannel.decode(envelope.encode_bytes({"type": "exec", "code": "print(1)"}))


def test_frames_and_errors_carry_a_code() -> None:
    stream = [
        LogLine(3, "p1", "err", "hi").encode(),
        Notice("waiting", "pods 1", {"pods": [1]}).encode(),
        error_frame(WireError(ErrorCode.INTERNAL, "boom", "RuntimeError")),
    ]
    frames = list(read_frames(stream))
    assert LogLine.decode(frames[0][1]) == LogLine(3, "p1", "err", "hi")
    assert Notice.decode(frames[1][1]).as_dict() == {
        "pods": [1],
        "kind": "waiting",
        "message": "pods 1",
    }
    assert frames[2][0] == ERROR
    assert decode_error(frames[2][1]) == WireError(ErrorCode.INTERNAL, "boom", "RuntimeError")
    assert decode_error(b"not json").code is ErrorCode.INTERNAL
    assert (
        ErrorCode.parse("what") is None
        and ErrorCode.parse("not_deployed") is ErrorCode.NOT_DEPLOYED
    )


def test_a_call_plan_is_validated_at_decode() -> None:
    plan = decode_plan(
        json.dumps(
            {"id": "c", "pods": ["http://a", "http://b"], "fanout": True, "num_proc": [1, 2]}
        )
    )
    assert list(plan.pod_ranks(1)) == [1, 2]
    for bad in ('{"id": ""}', "[]", '{"id": "c", "fanout": true}', "{" * 100000):
        with pytest.raises(ValueError):
            decode_plan(bad)


# ---- the client classifies refusals by code --------------------------------------------------


@pytest.mark.parametrize(
    "code, detail, error",
    [
        (
            "not_deployed",
            "pod p-0 has no code deployed (its protocol version is fine)",
            "NotDeployedError",
        ),
        ("protocol_mismatch", "protocol version mismatch: ...", "ProtocolMismatch"),
        ("redeployed", "pod p-0 runs launch b, not the caller's a", "NotDeployedError"),
        ("unknown_call", "pod p-0 does not know call x", "PodUnreachable"),
        ("unauthorized", "missing or wrong deployment token", "AuthError"),
        (None, "pod p-0 does not know call x (an older pod, no code)", "KtliteError"),
    ],
)
def test_the_client_classifies_a_refusal_by_its_code_not_its_text(code, detail, error) -> None:
    import httpx

    import ktlite as kt
    from ktlite.net.client import PodClient
    from ktlite_wire.headers import ERROR_CODE_HEADER

    status = {"unknown_call": 404, "unauthorized": 401}.get(code or "", 409)

    def pod(request: httpx.Request) -> httpx.Response:
        headers = {ERROR_CODE_HEADER: code} if code else {}
        return httpx.Response(status, json={"detail": detail}, headers=headers)

    client = PodClient("t0k3n", transport=httpx.MockTransport(pod))
    try:
        with pytest.raises(getattr(kt, error)) as info:
            client.status("https://pod.example")
        assert type(info.value).__name__ == error
    finally:
        client.close()
