"""Issue 4 point 9: bad user input fails before anything starts, with the field, the value,
what is allowed and the fix.

Every case runs the whole user-facing path (``kt.fn(...).to(...)``, ``remote(...)``,
``remote.options(...)``) and checks, besides the message, that nothing started: no new pod
server process of this test process, no state directory for the deployment name, and for
call-time errors, no call reached the running pod (same rank process, nothing ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hostile_mod as hm
import pytest

import ktlite as kt
from ktlite.api.adverbs import _options
from ktlite.backends.local_pods import visible_gpus

_LOCK = threading.Lock()  # a global that cannot be pickled
TARGET = "badin-target"


def uses_lock() -> bool:
    return _LOCK.locked()


def make_closure() -> Callable[[], bool]:
    lock = threading.Lock()

    def uses_closure_lock() -> bool:
        return lock.locked()

    return uses_closure_lock


class UsesLock:
    def ping(self) -> bool:
        return _LOCK.locked()


class Plain:
    def __init__(self, lock: Any = None, n: int = 0) -> None:
        self.n = n


def target(mode: str = "pid", arg: Any = None, **kw: Any) -> Any:
    if mode == "touch":
        Path(str(arg)).write_text("ran")
    return os.getpid()


def _my_servers() -> set[int]:
    """Running ktlite_server processes started by this (test) process."""
    me = os.getpid()
    return {
        c
        for c in hm.children(me)
        if hm.alive(c) and b"ktlite_server" in Path(f"/proc/{c}/cmdline").read_bytes()
    }


@contextlib.contextmanager
def starts_nothing(*names: str) -> Iterator[None]:
    before = _my_servers()
    dirs = {n: hm.local_dir(n).exists() for n in names}
    yield
    assert _my_servers() == before, "a pod server was started for bad input"
    for n in names:
        if not dirs[n]:
            assert not hm.local_dir(n).exists(), f"bad input created the state directory of {n!r}"


def _expect(
    exc: type[BaseException],
    thunk: Callable[[], Any],
    parts: list[str],
    names: tuple[str, ...] = (),
) -> str:
    with starts_nothing(*names), pytest.raises(exc) as info:
        thunk()
    text = str(info.value)
    missing = [p for p in parts if p not in text]
    assert not missing, f"{type(info.value).__name__} {text!r} does not mention {missing}"
    assert isinstance(info.value, kt.ConfigError) and isinstance(info.value, ValueError)
    return text


C = kt.Compute


# (id, thunk, exception, parts of the message: field, value, what is allowed / the fix)
CASES: list[tuple[str, Callable[[], Any], type[BaseException], list[str]]] = [
    # unpicklable code: names the object and the global / closure variable that holds it
    (
        "unpicklable-global",
        lambda: kt.fn(uses_lock, name="badin-lock").to(C(cpus=1)),
        kt.SerializationError,
        [
            "uses_lock",
            "global '_LOCK'",
            "_thread.lock",
            "cannot be pickled",
            "create it inside the function",
        ],
    ),
    (
        "unpicklable-closure",
        lambda: kt.fn(make_closure(), name="badin-closure").to(C(cpus=1)),
        kt.SerializationError,
        [
            "uses_closure_lock",
            "closure variable 'lock'",
            "_thread.lock",
            "create it inside the function",
        ],
    ),
    (
        "unpicklable-class",
        lambda: kt.cls(UsesLock, name="badin-cls").to(C(cpus=1)),
        kt.SerializationError,
        ["UsesLock", "global '_LOCK'", "_thread.lock"],
    ),
    (
        "unpicklable-global-dryrun",
        lambda: kt.fn(uses_lock, name="badin-lock").to(C(), dryrun=True),
        kt.SerializationError,
        ["global '_LOCK'"],
    ),
    # reserved env names
    *[
        (
            f"reserved-env-{key}",
            (lambda key=key: kt.fn(target, name="badin-env").to(C(env={key: "1"}))),
            kt.ConfigError,
            ["env sets", key, "remove"],
        )
        for key in (
            "RANK",
            "MASTER_ADDR",
            "KTLITE_TOKEN",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_PORT",
        )
    ],
    (
        "reserved-env-vars-alias",
        lambda: C(env_vars={"RANK": "0"}),
        kt.ConfigError,
        ["RANK", "remove"],
    ),
    (
        "env-and-env-vars",
        lambda: C(env={"A": "1"}, env_vars={"B": "2"}),
        kt.ConfigError,
        ["env=", "env_vars=", "not both"],
    ),
    ("env-not-strings", lambda: C(env={"A": 1}), kt.ConfigError, ["env=", "str to str", "str()"]),
    # deployment names
    # deployment names: Kubetorch's normalisation makes "My_Fn" "my-fn"; only a name that
    # normalises to nothing, or to too long a name, is refused
    (
        "name-nothing-left",
        lambda: kt.fn(target, name="__"),
        kt.ConfigError,
        ["name='__'", "lowercase letters, digits and '-'", "'my-fn'"],
    ),
    ("name-in-to", lambda: kt.fn(target).to(C(), name="!!"), kt.ConfigError, ["name='!!'"]),
    ("name-not-a-string", lambda: kt.cls(Plain, name=3), kt.ConfigError, ["name=3", "string"]),
    (
        "name-too-long",
        lambda: kt.fn(target, name="x" * 60),
        kt.ConfigError,
        ["at most 52 characters", "'" + "x" * 52 + "'"],
    ),
    ("name-decorator", lambda: kt.compute(cpus=1, name="--"), kt.ConfigError, ["name='--'"]),
    # resources
    (
        "memory-512m",
        lambda: kt.fn(target, name="badin-res").to(C(memory="512m")),
        kt.ConfigError,
        ["memory='512m'", "m is milli", "512Mi", "512M"],
    ),
    (
        "memory-words",
        lambda: C(memory="lots"),
        kt.ConfigError,
        ["memory='lots'", "allowed", "'512Mi'"],
    ),
    (
        "memory-limit-words",
        lambda: C(memory_limit="4 gigs"),
        kt.ConfigError,
        ["memory_limit='4 gigs'", "allowed"],
    ),
    (
        "memory-limit-below",
        lambda: C(memory="4Gi", memory_limit="1Gi"),
        kt.ConfigError,
        ["memory_limit='1Gi'", "memory='4Gi'", "at least the request"],
    ),
    (
        "memory-limit-below-GB",
        lambda: C(memory="4Gi", memory_limit="4GB"),
        kt.ConfigError,
        ["memory_limit='4G'", "memory='4Gi'", "at least the request"],
    ),
    (
        "shared-memory-8m",
        lambda: C(shared_memory="8m"),
        kt.ConfigError,
        ["shared_memory='8m'", "8Mi"],
    ),
    (
        "volume-size",
        lambda: kt.Volume("data", size="10 gigs"),
        kt.ConfigError,
        ["Volume.size='10 gigs'", "allowed"],
    ),
    (
        "cpus-two",
        lambda: kt.fn(target, name="badin-res").to(C(cpus="two")),
        kt.ConfigError,
        ["cpus='two'", "allowed", "'500m'"],
    ),
    ("cpus-zero", lambda: C(cpus=0), kt.ConfigError, ["cpus=0", "greater than 0"]),
    ("cpu-limit-below", lambda: C(cpus=2, cpu_limit=1), kt.ConfigError, ["cpu_limit=1", "cpus=2"]),
    ("gpus-negative", lambda: C(gpus=-1), kt.ConfigError, ["gpus=-1", ">= 0"]),
    ("gpus-fraction", lambda: C(gpus=0.5), kt.ConfigError, ["gpus=0.5", "whole number"]),
    (
        "launch-timeout",
        lambda: C(launch_timeout=0),
        kt.ConfigError,
        ["launch_timeout=0", "positive number of seconds"],
    ),
    (
        "call-timeout",
        lambda: C(call_timeout=-1),
        kt.ConfigError,
        ["call_timeout=-1", "positive number of seconds"],
    ),
    ("max-restarts", lambda: C(max_restarts=-1), kt.ConfigError, ["max_restarts=-1", ">= 0"]),
    (
        "backend",
        lambda: C(backend="k8s"),
        kt.ConfigError,
        ["backend='k8s'", "'local'", "'kubernetes'"],
    ),
    # layout
    *[
        (
            f"workers-{w}",
            (
                lambda w=w: kt.fn(target, name="badin-layout").to(
                    C(cpus=1).distribute("pytorch", workers=w)
                )
            ),
            kt.ConfigError,
            [f"workers={w!r}", "use workers=1"] + ([">= 1"] if isinstance(w, int) else ["integer"]),
        )
        for w in (0, -1, 1.5, "2")
    ],
    (
        "workers-decorator",
        lambda: kt.distribute("pytorch", workers=0),
        kt.ConfigError,
        ["workers=0", ">= 1"],
    ),
    *[
        (
            f"num-proc-{n}",
            (
                lambda n=n: kt.fn(target, name="badin-layout").to(
                    C(cpus=1).distribute("spmd", workers=1, num_proc=n)
                )
            ),
            kt.ConfigError,
            [f"num_proc={n!r}", "rank processes per pod"],
        )
        for n in (0, -2)
    ],
    *[
        (
            f"framework-{fw}",
            (lambda fw=fw: kt.fn(target, name="badin-layout").to(C().distribute(fw, workers=2))),
            kt.ConfigError,
            [f"framework={fw!r}", "'spmd', 'pytorch', 'jax', 'tensorflow'"],
        )
        for fw in ("torch", "PyTorch", "mpi")
    ],
    (
        "monarch-uneven",
        lambda: kt.fn(target, name="badin-layout").to(
            C().distribute("monarch", workers=2, num_proc=[2, 4])
        ),
        kt.ConfigError,
        ["num_proc=[2, 4]", "same procs on every host", "give one number"],
    ),
    (
        "ray-num-proc",
        lambda: kt.fn(target, name="badin-layout").to(C().distribute("ray", workers=2, num_proc=2)),
        kt.ConfigError,
        ["num_proc=2", "no meaning"],
    ),
    (
        "ray-worker-node-options",
        lambda: kt.fn(target, name="badin-layout").to(
            C().distribute("ray", workers=2, worker_node_options={"gpu": 1})
        ),
        kt.ConfigError,
        ["worker_node_options", "'gpu'", "allowed: cpus, memory, gpus"],
    ),
    (
        "num-proc-beyond-gpus",
        lambda: kt.fn(target, name="badin-gpu").to(C(gpus=1).distribute("pytorch", num_proc=2)),
        kt.ConfigError,
        ["num_proc=2", "gpus=1", "GPU pod", "num_proc<=1"],
    ),
    (
        "num-proc-beyond-gpus-replace",
        lambda: dataclasses.replace(C().distribute("pytorch", workers=2, num_proc=4), gpus=2),
        kt.ConfigError,
        ["num_proc=4", "gpus=2", "num_proc<=2"],
    ),
    (
        "distribute-unknown-option",
        lambda: C().distribute("pytorch", workers=2, nprocs=2),
        kt.ConfigError,
        ["unknown option", "nprocs", "allowed", "num_proc"],
    ),
    (
        "quorum-timeout",
        lambda: C().distribute(quorum_timeout=0),
        kt.ConfigError,
        ["quorum_timeout=0", "positive number of seconds"],
    ),
    (
        "port",
        lambda: C().distribute(port=70000),
        kt.ConfigError,
        ["port=70000", "between 1 and 65535"],
    ),
    (
        "gpus-beyond-this-machine",
        lambda: kt.fn(target, name="badin-gpu").to(C(cpus=1, gpus=len(visible_gpus()) + 1)),
        kt.ConfigError,
        ["gpus=", "this machine has", "backend='kubernetes'"],
    ),
    # what .to() / kt.fn / kt.cls accept
    (
        "to-not-a-compute",
        lambda: kt.fn(target, name="badin-misc").to("cpus=1"),
        kt.ConfigError,
        [".to() needs a kt.Compute", "str", "kt.Compute(cpus=1)"],
    ),
    ("fn-of-a-class", lambda: kt.fn(Plain), kt.ConfigError, ["kt.cls(Plain)"]),
    ("cls-of-a-function", lambda: kt.cls(target), kt.ConfigError, ["kt.fn()"]),
    (
        "init-args-type",
        lambda: kt.cls(Plain, name="badin-misc").to(C(), init_args=3),
        kt.ConfigError,
        ["init_args=3", "dict", "tuple"],
    ),
]

_NAMES = (
    "badin-lock",
    "badin-closure",
    "badin-cls",
    "badin-env",
    "badin-res",
    "badin-layout",
    "badin-gpu",
    "badin-misc",
    "my-fn",
    "target",
    "plain",
    "uses-lock",
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_anything_starts(case) -> None:
    _id, thunk, exc, parts = case
    _expect(exc, thunk, parts, _NAMES)


# ---- call-time input against a running deployment ----------------------------------------------


@pytest.fixture(scope="module")
def remote():
    r = kt.fn(target, name=TARGET).to(kt.Compute(cpus=1, stream_logs=False))
    yield r
    r.teardown()


def _no_call_reached(remote, pid: int, marker: Path) -> None:
    assert not marker.exists()
    status = remote.status()
    assert all(not pod["active_calls"] for pod in status)
    assert [r["pid"] for pod in status for r in pod["ranks"]] == [pid], (
        "the rank process was restarted"
    )
    assert remote() == pid, "the next call does not work"


@pytest.mark.timeout(60)
def test_unpicklable_call_arguments_are_named(remote, tmp_path) -> None:
    pid = remote()
    marker = tmp_path / "ran"
    cases = [
        (
            lambda: remote("touch", str(marker), threading.Lock()),
            ["positional argument 2", "_thread.lock"],
        ),
        (
            lambda: remote("touch", [str(marker), threading.Lock()]),
            ["positional argument 1", "builtins.list"],
        ),
        (
            lambda: remote("touch", str(marker), extra=threading.Lock()),
            ["keyword argument 'extra'", "_thread.lock"],
        ),
        (
            lambda: remote("touch", str(marker), gen=(i for i in range(3))),
            ["keyword argument 'gen'", "generator"],
        ),
        (lambda: remote.options(timeout=5)("touch", threading.Lock()), ["positional argument 1"]),
    ]
    for thunk, parts in cases:
        text = _expect(
            kt.SerializationError, thunk, [*parts, "cannot be pickled", "pass plain data"]
        )
        assert isinstance(text, str)
    _no_call_reached(remote, pid, marker)


@pytest.mark.timeout(60)
def test_bad_call_options_fail_before_the_call(remote, tmp_path) -> None:
    pid = remote()
    marker = tmp_path / "ran"
    for bad in (-1, 0, "5", True):
        _expect(
            kt.ConfigError,
            lambda bad=bad: remote.options(timeout=bad)("touch", str(marker)),
            [f"timeout={bad!r}", "positive number of seconds", "None for no limit"],
        )
    _expect(
        kt.ConfigError,
        lambda: remote.options(timeuot=5)("touch", str(marker)),
        ["unknown call option", "timeuot", "allowed", "timeout"],
    )
    for workers in ([5], [], [-1], [0.5]):
        _expect(
            kt.ConfigError,
            lambda w=workers: remote.options(workers=w)("touch", str(marker)),
            [f"workers={workers!r}", "between 0 and 0"],
        )
    # Kubetorch's forms: an IP (or a piece of one) that no pod has, or a word that is not one
    for workers in (["10.9.9.9"], "10.9.", "some"):
        _expect(
            kt.ConfigError,
            lambda w=workers: remote.options(workers=w)("touch", str(marker)),
            [f"workers={workers!r}", "no pod", "127.0.0.1"],
        )
    _expect(
        kt.ConfigError,
        lambda: remote.distribute("pytorch", workers=0),
        ["workers=0", ">= 1"],
        (TARGET,),
    )
    _expect(kt.ConfigError, lambda: remote.logs(rank=3), ["rank=3", "between 0 and 0"])
    _no_call_reached(remote, pid, marker)


# ---- input that slipped through before: refused before anything starts ------------------------


def test_non_finite_numbers_are_refused() -> None:
    nan, inf = float("nan"), float("inf")
    thunks = {
        "cpus=nan": lambda: C(cpus=nan),
        "cpus=inf": lambda: C(cpus=inf),
        "launch_timeout=nan": lambda: C(launch_timeout=nan),
        "call_timeout=nan": lambda: C(call_timeout=nan),
        "teardown_timeout=nan": lambda: C(teardown_timeout=nan),
        "quorum_timeout=nan": lambda: C().distribute(quorum_timeout=nan),
        "options(timeout=nan)": lambda: _options({"timeout": nan}),
    }
    accepted = []
    for what, thunk in thunks.items():
        try:
            thunk()
        except kt.ConfigError:
            continue
        accepted.append(what)
    assert not accepted, f"accepted: {accepted}"


def test_invalid_env_names_and_values_are_refused() -> None:
    accepted = []
    for env in ({"A=B": "1"}, {"": "x"}, {"MY VAR": "x"}, {"1ABC": "x"}, {"OK": "x\0y"}):
        try:
            C(env=env)
        except kt.ConfigError:
            continue
        accepted.append(env)
    assert not accepted, f"kt.Compute accepted env={accepted}"


def test_unpicklable_init_args_name_the_argument() -> None:
    _expect(
        kt.SerializationError,
        lambda: kt.cls(Plain, name="badin-init").to(
            C(), init_args={"lock": threading.Lock(), "n": 1}
        ),
        ["init_args", "'lock'", "_thread.lock"],
        ("badin-init",),
    )
    _expect(
        kt.SerializationError,
        lambda: kt.cls(Plain, name="badin-init").to(C(), init_args=(threading.Lock(),)),
        ["init_args", "0", "_thread.lock"],
        ("badin-init",),
    )
