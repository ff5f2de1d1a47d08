"""Issue 26, item 2: the call tree, forced at a small size (7 pods × 1 rank, ``tree_fanout=2``,
``tree_minimum=2``) on real local pod servers and rank processes.

Pod 0 sends a call to pods 1 and 4 only; pod 1 relays it to 2 and 3, pod 4 to 5 and 6
(``ktlite_wire.calltree.split``). The tests check what must survive the relays: values in
rank order, every rank's log lines, per-rank items, a gloo collective across all of them,
a rank failing in a leaf, an inner pod killed mid-call (its subtree reported, the call ending
at once, the next call healing or failing clearly), a cancel reaching the leaves, a broken
stream re-attached with every call run once, and the code push sent once, to pod 0.

No check is a wall-clock bound; times are reported (``pytest -s``). A rank stopped when its
heartbeat lines stop (``faults_mod.beat``), long before the end it would have reached.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faults_mod as fm
import pytest
from loadscale import time_scale
from test_reattach import CuttingProxy, record

import ktlite as kt
import ktlite.net.client
from ktlite.backends.local import LocalBackend
from ktlite.net.call_reply import FrameReader
from ktlite.net.client import PodClient
from ktlite_wire import envelope
from ktlite_wire.frames import RESULT
from ktlite_wire.heartbeat import HEARTBEAT_S, SILENCE_ENV
from ktlite_wire.outcome import CallResult

NAME = "fx-tree"
PODS = 7
RANKS = range(PODS)
SILENCE_S = round(HEARTBEAT_S + 2.0 * time_scale(), 1)
COMPUTE = kt.Compute(cpus=0.5, stream_logs=False, env={SILENCE_ENV: str(SILENCE_S)}).distribute(
    "pytorch", workers=PODS, num_proc=1, tree_fanout=2, tree_minimum=2
)
INNER, BELOW_INNER = 1, (2, 3)  # pod 1 relays the call to pods 2 and 3
LONG_S = 60.0  # how long a faulted call's ranks would beat if nothing stopped them
JOIN_S = LONG_S + 30


def shout(lines: int, fail_rank: int = -1) -> int:
    """Print ``lines`` lines; rank ``fail_rank`` raises; returns the rank."""
    rank = int(os.environ["RANK"])
    for k in range(lines):
        print(f"rank {rank} line {k}", flush=True)
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank


def item_times_rank(item: int) -> int:
    return item * int(os.environ["RANK"])


def all_reduce() -> float:
    """A gloo all_reduce of every rank's number: each gets the sum (the process group is
    formed once per generation, as a training step's would be)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return float(t.item())


@pytest.fixture(scope="module")
def deployment():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ktlite.net.client, "SILENCE_TIMEOUT", SILENCE_S)
        yield NAME
    LocalBackend.shared().teardown(NAME, timeout=5.0)


def _to(fn: Any) -> Any:
    return kt.fn(fn, name=NAME).to(COMPUTE)


def _spy(monkeypatch: pytest.MonkeyPatch, method: str) -> list[tuple[Any, ...]]:
    """Record each call of ``PodClient.<method>`` (its arguments), letting it through."""
    seen: list[tuple[Any, ...]] = []
    real = getattr(PodClient, method)

    def spy(self: PodClient, *args: Any, **kwargs: Any) -> Any:
        seen.append((*args, kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PodClient, method, spy)
    return seen


@pytest.mark.timeout(240)
def test_the_code_push_goes_once_to_pod_0_which_relays_it(deployment, monkeypatch) -> None:
    deploys = _spy(monkeypatch, "deploy")
    remote = _to(shout)
    urls = [ep.url for ep in remote.deployment.endpoints]
    assert [args[0] for args in deploys] == [urls[0]], deploys  # one push, to pod 0
    launch = remote.deployment.launch_id
    for pod in remote.status():  # every pod installed that launch, each as its own ordinal
        assert pod.get("launch_id", launch) == launch
    assert remote(0) == list(RANKS)


@pytest.mark.timeout(240)
def test_each_relay_passes_its_subtrees_push_answers_on_as_they_came(
    deployment, monkeypatch
) -> None:
    """A relayed code push's answer is passed on as a call's is (small answers lifted, large
    ones nested as they came): no pod decodes the outcomes of the pods below it (at a
    thousand pods each relay decoded its 31 children's 8 ranks' outcomes and pod 0 its 999
    pods')."""
    answers: list[bytes] = []
    real = CallResult.decode.__func__  # type: ignore[attr-defined]

    def decode(cls: type[CallResult], data: Any) -> CallResult:
        answers.append(bytes(data))
        return real(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(CallResult, "decode", classmethod(decode))
    remote = _to(item_times_rank)
    assert len(answers) == 1, "one push, answered by pod 0"
    assert _shape(answers[0]) == (list(RANKS), [])
    assert remote(3) == [3 * r for r in RANKS]


@pytest.mark.timeout(240)
def test_values_in_rank_order_logs_from_every_rank_and_per_rank_items(
    deployment, monkeypatch, capfd
) -> None:
    remote = _to(shout)
    plans = _spy(monkeypatch, "call")
    assert remote.options(stream_logs=True)(3) == list(RANKS)
    assert plans[0][1].tree == 2, plans[0][1]  # the plan asked pod 0 for a tree of 2
    out = capfd.readouterr().out
    for r in RANKS:
        for k in range(3):
            line = f"[rank {r} @ {NAME}-{r}] rank {r} line {k}"
            assert out.count(line) == 1, (line, out)
    each = _to(item_times_rank)
    assert each.each([10 + r for r in RANKS]) == [(10 + r) * r for r in RANKS]


def _result_frames(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record the RESULT frame of each call the caller reads, letting it through."""
    seen: list[bytes] = []
    real = FrameReader.take

    def take(self: FrameReader, frames: Iterator[tuple[int, Any]]) -> Any:
        def watch() -> Iterator[tuple[int, Any]]:
            for kind, payload in frames:
                if kind == RESULT:
                    seen.append(bytes(payload))
                yield kind, payload

        return real(self, watch())

    monkeypatch.setattr(FrameReader, "take", take)
    return seen


def _shape(result: Any) -> tuple[list[int], list[Any]]:
    """The ranks one pod's result message holds itself, and the same of each result nested
    in it untouched (a relay's subtrees)."""
    header, bufs = envelope.decode(result)
    own = [row[0] for row in header["outcomes"]]
    own += [r for first, count, *_ in header.get("runs", []) for r in range(first, first + count)]
    return sorted(own), [_shape(bufs[i]) for i in header.get("subtrees", [])]


@pytest.mark.timeout(240)
def test_each_relay_passes_its_subtrees_results_on_as_they_came(deployment, monkeypatch) -> None:
    remote = _to(shout)
    results = _result_frames(monkeypatch)
    assert remote(0) == list(RANKS)
    # every answer here is small: pod 1 lifts pod 2's and 3's into its own, pod 0 pod 1's and
    # pod 4's; no pod decodes a value of another (a large answer is nested as it came:
    # tests/test_call_results.py), and the caller reads one message
    assert _shape(bytearray(results[0])) == (list(RANKS), [])


@pytest.mark.timeout(300)
def test_a_gloo_collective_spans_the_tree_and_survives_a_failed_call(deployment) -> None:
    remote = _to(all_reduce)
    total = float(sum(RANKS))
    assert remote() == [total] * PODS
    failing = _to(shout)
    with pytest.raises(kt.RemoteError) as info:
        failing(0, fail_rank=6)  # a leaf under pod 4
    err = info.value
    assert "fails on purpose" in str(err), str(err)
    by_rank = {f.rank: f for f in err.failures}
    assert by_rank[6].pod == f"{NAME}-6", err.failures
    kinds = {r: f.kind for r, f in by_rank.items()}
    assert kinds.pop(6) == "error", err.failures
    assert set(kinds.values()) <= {"cancelled"}, err.failures
    # the failed call moved the deployment to a new process group: formed anew through the
    # relays, by every rank
    assert _to(all_reduce)() == [total] * PODS


@pytest.mark.timeout(240)
def test_an_inner_pod_killed_mid_call_reports_its_subtree(deployment, tmp_path) -> None:
    remote = _to(fm.beat)
    pid = remote.status()[INNER]["server_pid"]
    call = fm.Call(remote, str(tmp_path), "c", LONG_S)
    assert fm.wait_for(lambda: fm.all_beating(tmp_path, "c", RANKS), 60), "never started"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert call.join(JOIN_S), "the call hangs after its inner pod died"
    fm.report("inner pod SIGKILL -> the call fails", call.ended - t0, SILENCE_S)
    err = call.error
    assert isinstance(err, kt.RemoteError), repr(err)
    text = str(err)
    assert f"pod {NAME}-{INNER}" in text and "stopped responding" not in text, text
    kinds = {f.rank: f for f in err.failures}
    assert sorted(kinds) == list(RANKS), text  # every rank is reported, none left out
    assert kinds[INNER].kind == "died", text
    for r in BELOW_INNER:  # the ranks it relayed to: not reached, naming the relay
        assert kinds[r].kind == "unreachable", text
        assert f"pod {NAME}-{INNER}, which relays the call" in kinds[r].message, text
    for r in set(RANKS) - {INNER, *BELOW_INNER}:
        assert kinds[r].kind == "cancelled", text
    for r in RANKS:  # orphans included: nothing runs the call on
        last = fm.last_beat_after_quiet(tmp_path, "c", r, quiet=1.0, timeout=JOIN_S)
        assert last is not None and last < fm.starts(tmp_path, "c", r)[0][1] + LONG_S - 5, r
        assert len(fm.starts(tmp_path, "c", r)) == 1, f"rank {r} ran the call twice"
    # the next call fails clearly (the pod is gone, naming it) or heals; a fresh .to() works
    try:
        value = remote(str(tmp_path), "next", 0)
    except kt.KtliteError as e:
        assert f"{NAME}-{INNER}" in str(e), str(e)
    else:
        assert value == list(RANKS)
    assert _to(fm.beat)(str(tmp_path), "after", 0) == list(RANKS)


@pytest.mark.timeout(240)
def test_a_cancel_reaches_the_leaves(deployment, tmp_path, monkeypatch) -> None:
    remote = _to(fm.beat)
    cancels = _spy(monkeypatch, "cancel")
    future = remote.submit(str(tmp_path), "c", LONG_S)
    assert fm.wait_for(lambda: fm.all_beating(tmp_path, "c", RANKS), 60), "never started"
    t0 = time.monotonic()
    assert future.cancel()
    assert fm.wait_for(future.done, JOIN_S), "the cancelled call never ended"
    assert future.cancelled()
    for r in RANKS:  # the leaves 2, 3, 5, 6 got it through their relays
        last = fm.last_beat_after_quiet(tmp_path, "c", r, quiet=1.0, timeout=JOIN_S)
        assert last is not None and last < fm.starts(tmp_path, "c", r)[0][1] + LONG_S - 5, r
        fm.report(f"cancel -> rank {r} stops", max(0.0, last - t0), 3.0)
    eps = remote.deployment.endpoints
    sent = {args[0] for args in cancels}
    assert sent == {eps[0].url, eps[1].url, eps[4].url}, sent  # pod 0 and its children
    assert remote(str(tmp_path), "after", 0) == list(RANKS)


@pytest.mark.timeout(240)
def test_cut_streams_are_reattached_through_the_tree_and_run_once(deployment, tmp_path) -> None:
    remote = _to(record)
    proxy = CuttingProxy(rate=0.5, seed=11)
    dep = remote.deployment
    old, dep.client = dep.client, PodClient(dep.applied.token, transport=proxy)
    ledger = tmp_path / "ledger"
    calls = 30
    try:
        for i in range(calls):
            assert remote(str(ledger), i, i % 2) == [i] * PODS, i
    finally:
        dep.client.close()
        dep.client = old
    assert proxy.cuts > 5 and proxy.resumes >= proxy.cuts, (proxy.cuts, proxy.resumes)
    for r in RANKS:
        ran = [int(x) for x in Path(f"{ledger}-{r}").read_text().split()]
        assert ran == list(range(calls)), f"rank {r} ran a call twice or missed one"


@pytest.fixture
def stopped(deployment):
    """Pids a test SIGSTOPs; resumed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    fm.recover(NAME, pids)


@pytest.mark.timeout(240)
def test_a_hung_inner_pod_is_named_by_the_silence_and_its_subtree_stopped(
    deployment, stopped, tmp_path
) -> None:
    remote = _to(fm.beat)
    pid = remote.status()[INNER]["server_pid"]
    call = fm.Call(remote, str(tmp_path), "c", LONG_S)
    assert fm.wait_for(lambda: fm.all_beating(tmp_path, "c", RANKS), 60), "never started"
    stopped.append(pid)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)  # alive, connections open, silent: a vanished relay
    assert call.join(JOIN_S), "the call hangs after its inner pod stopped answering"
    fm.report("inner pod SIGSTOP -> the call fails", call.ended - t0, SILENCE_S)
    err = call.error
    assert isinstance(err, kt.RemoteError), repr(err)
    text = str(err)
    assert f"pod {NAME}-{INNER} stopped responding" in text, text
    kinds = {f.rank: f for f in err.failures}
    assert sorted(kinds) == list(RANKS), text
    assert kinds[INNER].kind == "died", text
    assert all(kinds[r].kind == "unreachable" for r in BELOW_INNER), text
    # the pods below the hung relay cannot hear it: pod 0 told them to stop, past it
    for r in set(RANKS) - {INNER}:
        last = fm.last_beat_after_quiet(tmp_path, "c", r, quiet=1.0, timeout=JOIN_S)
        assert last is not None and last < fm.starts(tmp_path, "c", r)[0][1] + LONG_S - 5, r
    os.kill(pid, signal.SIGCONT)  # resumed, it finds its caller gone and stops its rank
    last = fm.last_beat_after_quiet(tmp_path, "c", INNER, quiet=1.0, timeout=JOIN_S)
    assert last is not None and last < fm.starts(tmp_path, "c", INNER)[0][1] + LONG_S - 5
    for r in RANKS:
        assert len(fm.starts(tmp_path, "c", r)) == 1, f"rank {r} ran the call twice"
    assert _to(fm.beat)(str(tmp_path), "after", 0) == list(RANKS)
