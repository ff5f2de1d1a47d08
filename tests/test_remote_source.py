"""Issue 9, item 5: a remote traceback shows the caller's source lines, although the pod
has none of the caller's files.

Code pickled by value carries its file's lines (``ktlite_wire.sourcelines``); local modules
imported on the pod register their shipped text. The local-backend tests delete the
caller's file after ``.to()``, so the pod, which could read it on this machine, cannot; a
notebook cell never had a file at all.
"""

from __future__ import annotations

import importlib
import linecache
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import ktlite as kt
from ktlite.backends.local import LocalBackend
from ktlite.net import packaging
from ktlite_wire import codec, envelope

COMPUTE = kt.Compute(cpus=1, stream_logs=False)
FAIL = "def fail(x):\n    raise ValueError(f'bad shard {x}')  # {marker}\n"
PAD = "# padding, so that shipping this file's lines shows in a pickle's size\n" * 300  # ~21 KB


def call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def call_module(module_name: str) -> Any:
    return importlib.import_module(module_name).boom()  # what `import helpers` in a body does


@pytest.fixture(scope="module")
def name() -> Iterator[str]:
    """One deployment for the module, redeployed with each test's function."""
    name = f"rsrc-{uuid.uuid4().hex[:8]}"
    yield name
    LocalBackend.shared().teardown(name, timeout=5)


@pytest.fixture
def new_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Write a module under tmp_path and import it: a local module, pickled by value.

    It stays in sys.modules: packaging notices new local modules by the size of sys.modules,
    so removing one and importing the next would go unnoticed."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> ModuleType:
        module_name = f"rsrc_mod_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module_name}.py").write_text(source)
        return importlib.import_module(module_name)

    return make


def remote_traceback(remote: Any, *args: Any) -> str:
    with pytest.raises(kt.RemoteError) as info:
        remote(*args)
    return info.value.failures[0].traceback


def fail_source(marker: str) -> str:
    return FAIL.replace("{marker}", marker)


# ---- on the pod (local backend) ------------------------------------------------------------


def test_a_function_whose_file_is_gone_shows_its_lines(name, new_module):
    mod = new_module(fail_source("rsrc-marker-1"))
    remote = kt.fn(mod.fail, name=name).to(COMPUTE)
    try:
        Path(mod.__file__).unlink()  # the pod can no more read it than a real cluster's
        tb = remote_traceback(remote, 3)
        assert f'File "{mod.__file__}", line 2, in fail' in tb, tb
        assert "raise ValueError(f'bad shard {x}')  # rsrc-marker-1" in tb, tb
    finally:
        remote.deployment.close()


def test_a_function_passed_as_an_argument_shows_its_lines(name, new_module):
    mod = new_module(fail_source("rsrc-marker-2"))
    remote = kt.fn(call, name=name).to(COMPUTE)
    try:
        linecache.getlines(mod.__file__)  # the caller has read it, as an earlier traceback would
        Path(mod.__file__).unlink()  # ... and the pod never can
        tb = remote_traceback(remote, mod.fail, 4)
        assert f'File "{mod.__file__}", line 2, in fail' in tb, tb
        assert "raise ValueError(f'bad shard {x}')  # rsrc-marker-2" in tb, tb
    finally:
        linecache.cache.pop(mod.__file__, None)
        remote.deployment.close()


def test_a_local_module_imported_on_the_pod_shows_its_lines(name, new_module):
    mod = new_module("def boom():\n    raise KeyError('rsrc-marker-3')\n")
    remote = kt.fn(call_module, name=name).to(COMPUTE)  # ships mod's source: it is imported here
    try:
        Path(mod.__file__).unlink()
        tb = remote_traceback(remote, mod.__name__)
        assert f'File "{mod.__file__}", line 2, in boom' in tb, tb
        assert "raise KeyError('rsrc-marker-3')" in tb, tb
    finally:
        remote.deployment.close()


@pytest.mark.parametrize("pattern", ["<ipython-input-3-{}>", "/tmp/ipykernel_1/{}.py"])
def test_a_notebook_cell_shows_its_lines(name, pattern, monkeypatch):
    filename = pattern.format(uuid.uuid4().hex[:12])
    assert not os.path.exists(filename)
    source = fail_source("rsrc-marker-4")
    # what IPython does with each cell it runs: the text in linecache, no file anywhere
    entry = (len(source), None, source.splitlines(True), filename)
    monkeypatch.setitem(linecache.cache, filename, entry)
    cell: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), cell)
    remote = kt.fn(cell["fail"], name=name).to(COMPUTE)
    try:
        tb = remote_traceback(remote, 5)
        assert f'File "{filename}", line 2, in fail' in tb, tb
        assert "raise ValueError(f'bad shard {x}')  # rsrc-marker-4" in tb, tb
    finally:
        remote.deployment.close()


_SCRIPT = textwrap.dedent("""
    import os, sys
    import ktlite as kt

    def fail(x):
        raise ValueError(f"bad shard {x}")  # rsrc-marker-5

    if __name__ == "__main__":
        remote = kt.fn(fail, name=sys.argv[1]).to(kt.Compute(cpus=1, stream_logs=False))
        try:
            os.remove(__file__)  # from here on, only the lines shipped with the code exist
            try:
                remote(6)
            except kt.RemoteError as e:
                print("TRACEBACK>" + e.failures[0].traceback + "<TRACEBACK")
        finally:
            remote.teardown()
""")


def test_a_function_of_a_main_script_shows_its_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), f"rsrc-main-{uuid.uuid4().hex[:8]}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "TRACEBACK>" in proc.stdout, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    tb = proc.stdout.split("TRACEBACK>", 1)[1].split("<TRACEBACK", 1)[0]
    assert not script.exists()
    assert f'File "{script}", line 6, in fail' in tb, tb
    assert 'raise ValueError(f"bad shard {x}")  # rsrc-marker-5' in tb, tb


# ---- what a message carries (no processes) -------------------------------------------------


def test_one_copy_of_a_files_lines_however_many_functions(new_module):
    other = "\n\ndef other():\n    return [lambda: i for i in range(3)]\n"
    mod = new_module(PAD + fail_source("one") + other)
    alone = len(packaging.bundle(mod.fail))
    both = len(packaging.bundle((mod.fail, mod.other)))
    assert alone > len(PAD), "the file's lines were not shipped"
    assert both - alone < len(PAD) // 4, f"{alone} -> {both} bytes: the lines went twice"
    call_size = envelope.parts_size(packaging.encode_call(None, (mod.fail, mod.other), {}))
    assert len(PAD) < call_size < len(PAD) * 5 // 4


def test_unpickling_registers_the_lines_for_good(new_module):
    mod = new_module(PAD + fail_source("registered"))
    blob = packaging.bundle(mod.fail)
    path = mod.__file__
    Path(path).unlink()
    linecache.cache.pop(path, None)
    try:
        fn = pickle.loads(blob)
        linecache.checkcache(path)  # what formatting a traceback does: no file, yet kept
        line = linecache.getline(path, 302)
        assert line == "    raise ValueError(f'bad shard {x}')  # registered\n"
        with pytest.raises(ValueError):
            fn(1)
    finally:
        linecache.cache.pop(path, None)


def test_what_a_pod_sends_back_carries_no_lines(new_module):
    """Results and exceptions go back without sources: the caller has its own."""
    mod = new_module(PAD + fail_source("back"))
    with packaging.by_value():
        back, sent = codec.dumps(mod.fail), codec.dumps(mod.fail, sources=True)
    assert len(back) < len(PAD) < len(sent)


def test_no_lines_for_a_huge_file_or_a_pseudo_file(new_module):
    huge = new_module("# padding\n" * 220_000 + fail_source("huge"))  # 2.2 MB, over the cap
    assert len(packaging.bundle(huge.fail)) < 10_000
    for filename in ("<string>", f"/nonexistent/{uuid.uuid4().hex}.py"):
        cell: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(fail_source("pseudo"), filename, "exec"), cell)
        assert len(packaging.bundle(cell["fail"])) < 10_000


def test_a_call_without_code_pickles_as_before():
    """Plain data meets the source hook nowhere: the same bytes either way."""
    value = (None, (1, 2.5, "x", np.arange(5), [{"a": (1, 2)}]), {"k": b"v"})
    assert codec.dumps(value, sources=True) == codec.dumps(value)
