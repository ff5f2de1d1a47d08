"""``remote.status()``'s per-rank health and resources, on a real local deployment (2 ranks):
pid, CPU %, RSS and process count read from /proc by the pod server, the calls each rank
runs now, and GPU memory/utilisation parsed from an ``nvidia-smi`` on the pod's PATH (here
a script standing in for it, the only way to reach that path on a machine without GPUs).
The usage module's parsers and its nvidia-smi guard (failure, hang) run against real files
and processes too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ktlite as kt
from ktlite.backends import local_pods
from ktlite_server import usage

FAKE_SMI = """\
#!/bin/sh
# stands in for nvidia-smi: two GPUs; compute apps from apps.csv beside this script
dir=$(dirname "$0")
case "$1" in
  --query-gpu=*)
    echo "0, GPU-aaaa1111-0000-0000-0000-000000000000, NVIDIA Fake, 1024, 81920, 35"
    echo "1, GPU-bbbb2222-0000-0000-0000-000000000000, NVIDIA Fake, 2048, 81920, [N/A]"
    ;;
  --query-compute-apps=*)
    cat "$dir/apps.csv" 2>/dev/null || true
    ;;
  *) exit 3 ;;
esac
"""

GIB = 1 << 30
MIB = 1 << 20


def work(mode: str, flag: str = "", seconds: float = 0.0) -> Any:
    """pid: this rank's pid. busy: start a child process, spin until ``flag`` exists."""
    import os as _os
    import subprocess as _sp
    import sys as _sys
    import time as _time
    from pathlib import Path as _Path

    if mode == "pid":
        return _os.getpid()
    child = _sp.Popen([_sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = _time.monotonic() + seconds
        while not _Path(flag).exists() and _time.monotonic() < deadline:
            pass  # busy: CPU time the status must see
    finally:
        child.kill()
        child.wait()
    return _os.getpid()


@pytest.fixture(scope="module")
def fake_smi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("smi")
    script = where / "nvidia-smi"
    script.write_text(FAKE_SMI)
    script.chmod(0o755)
    return where


@pytest.fixture(scope="module")
def remote(fake_smi: Path) -> Iterator[Any]:
    saved = local_pods._gpu_cache
    local_pods._gpu_cache = ["0", "1"]  # what this machine offers the local backend: two GPU ids
    try:
        compute = kt.Compute(cpus=1, gpus=2, env={"PATH": f"{fake_smi}:{os.environ['PATH']}"})
        r = kt.fn(work, name="status-usage").to(compute.distribute("spmd", workers=1, num_proc=2))
    finally:
        local_pods._gpu_cache = saved
    try:
        yield r
    finally:
        r.teardown()


def _ranks(remote: Any) -> list[dict[str, Any]]:
    return [r for pod in remote.status() for r in pod["ranks"]]


@pytest.mark.timeout(60)
def test_status_has_each_ranks_pid_memory_and_cpu(remote: Any) -> None:
    pids = remote("pid")
    ranks = _ranks(remote)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["pid"] for r in ranks] == pids  # the process that ran the call
    for r in ranks:
        assert r["state"] == "idle" and r["calls"] == [] and r["busy_for_s"] is None
        assert 1 * MIB < r["rss_bytes"] < 4 * GIB, r
        assert isinstance(r["cpu_percent"], float) and r["cpu_percent"] >= 0.0, r
        assert r["procs"] == 1, r
        assert not r["stuck"] and r["restarts"] == 0  # the fields from before are still there


@pytest.mark.timeout(90)
def test_busy_call_shows_its_id_its_age_its_child_and_cpu(remote: Any, tmp_path: Path) -> None:
    flag = tmp_path / "stop"
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(out=remote("busy", str(flag), 60.0)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            pods = remote.status()
            ranks = pods[0]["ranks"]
            if all(r["calls"] and (r["procs"] or 0) >= 2 for r in ranks):
                break
            assert time.monotonic() < deadline, pods
            time.sleep(0.1)
        call_id = pods[0]["active_calls"][0]
        for r in ranks:
            assert [c["id"] for c in r["calls"]] == [call_id]
            assert r["calls"][0]["running_s"] >= 0 and r["state"] == "busy"
        # CPU: sampled between status requests (at least 0.25 s apart); take the best of a few
        best = {0: 0.0, 1: 0.0}
        later = time.monotonic() + 2.5
        first_age = ranks[0]["calls"][0]["running_s"]
        while time.monotonic() < later:
            time.sleep(0.4)
            for r in _ranks(remote):
                best[r["rank"]] = max(best[r["rank"]], r["cpu_percent"] or 0.0)
                age = r["calls"][0]["running_s"]
        assert age > first_age  # the call's age grows
        # a spinning process gets well over 10% of a core, even on a loaded 2-core machine
        assert min(best.values()) > 10.0, best
    finally:
        flag.touch()
        thread.join(30)
    assert not thread.is_alive()
    ranks = _ranks(remote)
    assert all(r["calls"] == [] and r["state"] == "idle" and r["procs"] == 1 for r in ranks), ranks


@pytest.mark.timeout(60)
def test_gpu_memory_and_utilisation_come_from_nvidia_smi(remote: Any, fake_smi: Path) -> None:
    pids = remote("pid")
    uuid0 = "GPU-aaaa1111-0000-0000-0000-000000000000"
    (fake_smi / "apps.csv").write_text(f"{pids[0]}, {uuid0}, 512\n99999999, {uuid0}, 100\n")
    try:
        deadline = time.monotonic() + 15  # the pod keeps an nvidia-smi answer for 1.5 s
        while True:
            pod = remote.status()[0]
            ranks = pod["ranks"]
            if ranks[0]["gpu_process_memory_bytes"]:
                break
            assert time.monotonic() < deadline, pod
            time.sleep(0.3)
    finally:
        (fake_smi / "apps.csv").unlink()
    assert pod["gpu_error"] is None
    assert [g["index"] for g in pod["gpus"]] == [0, 1]  # the pod's own GPUs
    r0, r1 = ranks
    # each rank sees the GPU its CUDA_VISIBLE_DEVICES names
    assert [g["index"] for g in r0["gpus"]] == [0] and [g["index"] for g in r1["gpus"]] == [1]
    assert r0["gpu_memory_used_bytes"] == 1024 * MIB and r0["gpu_memory_total_bytes"] == 80 * GIB
    assert r0["gpu_utilization_percent"] == 35.0
    assert r0["gpu_process_memory_bytes"] == 512 * MIB  # its own process; not the other app
    assert r0["gpus"][0]["name"] == "NVIDIA Fake"
    assert r1["gpu_memory_used_bytes"] == 2048 * MIB
    assert r1["gpu_utilization_percent"] is None  # "[N/A]"
    assert r1["gpu_process_memory_bytes"] == 0


# ---- the usage module against real files and processes ------------------------------------------


def test_stat_parsing_survives_odd_process_names(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    rows = {
        100: "100 (python) S 1 100 100 0 -1 0 0 0 0 0 150 50 0 0 20 0 1 0 500 0 2560",
        101: "101 (a (b) c) S 100 100 100 0 -1 0 0 0 0 0 100 0 40 10 20 0 1 0 600 0 512",
        102: "102 (detached) S 101 102 102 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 700 0 256",
        200: "200 (other) S 1 200 200 0 -1 0 0 0 0 0 999 0 0 0 20 0 1 0 800 0 100",
    }
    for pid, text in rows.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(text + "\n")
    (proc / "self").mkdir()
    procs = usage.read_procs(str(proc))
    assert sorted(procs) == [100, 101, 102, 200]
    assert procs[101].ppid == 100 and procs[101].session == 100
    tick = os.sysconf("SC_CLK_TCK")
    assert procs[101].cpu_s == pytest.approx(150 / tick)  # utime + stime + cutime + cstime
    assert procs[100].rss_bytes == 2560 * os.sysconf("SC_PAGE_SIZE")
    # the session, and a descendant that started a session of its own
    assert [p.pid for p in usage.tree(100, procs)] == [100, 101, 102]


def test_process_usage_of_this_process_and_its_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        measured = asyncio.run(usage.ProcessUsage().measure([os.getpid(), 2**22 + 12345]))
    finally:
        child.kill()
        child.wait()
    assert list(measured) == [os.getpid()]  # a pid that does not exist is left out
    me = measured[os.getpid()]
    assert me["procs"] >= 2 and me["rss_bytes"] > 1 * MIB and me["cpu_percent"] >= 0.0


def test_gpu_rows_and_visible_devices() -> None:
    gpus = usage.parse_gpus(
        "0, GPU-1a, A100, 10, 80, 5\n1, GPU-2b, Name, with comma, [N/A], 80, "
        "[Not Supported]\nNo devices were found\n"
    )
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[1]["name"] == "Name, with comma" and gpus[1]["memory_used_bytes"] is None
    assert gpus[1]["utilization_percent"] is None and gpus[0]["memory_total_bytes"] == 80 * MIB
    assert [g["index"] for g in usage.visible(gpus, None)] == [0, 1]
    assert [g["index"] for g in usage.visible(gpus, "1")] == [1]
    assert [g["index"] for g in usage.visible(gpus, "GPU-2b,0")] == [1, 0]
    assert usage.visible(gpus, "") == [] and usage.visible(gpus, "7,0") == []  # CUDA stops there
    assert usage.parse_apps("12, GPU-1a, 300\nbad line\n13, GPU-1a, [N/A]\n") == [
        (12, "GPU-1a", 300 * MIB),
        (13, "GPU-1a", None),
    ]
    summary = usage.rank_gpu_summary(usage.visible(gpus, "0,1"), [(12, "GPU-1a", 300 * MIB)], {12})
    assert summary["gpu_memory_used_bytes"] == 10 * MIB  # the GPU whose value is known
    assert (
        summary["gpu_utilization_percent"] == 5.0
        and summary["gpu_process_memory_bytes"] == 300 * MIB
    )


@pytest.mark.timeout(30)
def test_nvidia_smi_absent_failing_or_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all: no GPUs, no error
    assert asyncio.run(usage.GpuQuery().snapshot()) == (None, None, None)

    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: driver not loaded' >&2\nexit 9\n")
    script.chmod(0o755)
    gpus, apps, error = asyncio.run(usage.GpuQuery().snapshot())
    assert gpus == [] and error is not None and "code 9" in error and "driver not loaded" in error

    script.write_text(
        "#!/bin/sh\ncase \"$1\" in --query-gpu=*) echo '0, GPU-1, X, 1, 2, 3';; *) exit 4;; esac\n"
    )
    gpus, apps, error = asyncio.run(usage.GpuQuery().snapshot())  # only per-process memory is lost
    assert [g["index"] for g in gpus] == [0] and apps is None and "--query-compute-apps" in error

    # processes named by pids of another pid namespace (a container): their memory is unknown
    script.write_text(
        "#!/bin/sh\ncase \"$1\" in --query-gpu=*) echo '0, GPU-1, X, 1, 2, 3';; "
        f"*) echo '{2**22 + 4321}, GPU-1, 5';; esac\n"
    )
    gpus, apps, error = asyncio.run(usage.GpuQuery().snapshot())
    assert len(gpus) == 1 and apps is None and error is None
    assert usage.rank_gpu_summary(gpus, apps, {1})["gpu_process_memory_bytes"] is None

    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(20)'\n")
    monkeypatch.setattr(usage, "GPU_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    gpus, apps, error = asyncio.run(usage.GpuQuery().snapshot())
    assert time.monotonic() - t0 < 5 and error is not None and "did not answer" in error
